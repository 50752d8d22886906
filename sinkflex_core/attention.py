"""Sink-aware attention: sink tokens + sliding window masks, the learnable zero-value sink, an exact
chunked PyTorch path, a float64 reference, Hugging Face registration and per-layer sink estimation.

The attention computed here, for query ``i`` and key ``j`` of one row (keys indexed in the row):

* ``j`` is visible when ``j <= i`` (causal), ``j`` and ``i`` lie in the same document (packed rows),
  ``j`` is not padding, and either ``j`` is one of the first ``n_sink`` tokens of its document or
  ``i - j < window``. The window therefore holds ``window`` keys **counting the query itself**: keys
  ``i - window + 1 .. i`` (the same convention as Hugging Face's ``sliding_window``). Padding is not a
  token: sinks and window count real tokens only, and only the first real token of a row (or a real
  change of document: a new segment id, a position that does not continue) starts a document, so a
  row padded in the middle (a batch of turns of different lengths) attends as it would alone.
* With sink logits ``s`` (one per query head) the softmax gets one extra term ``exp(s)`` that carries no
  value vector. Since ``softmax`` over ``[scores, s]`` with the last column dropped equals the plain
  softmax times ``Z / (Z + e^s)``, the output is ``out * sigmoid(lse - s)`` with ``lse`` the
  log-sum-exp of the visible scores; it is applied in float32.

Two backends compute the same numbers: FlexAttention (block-sparse, used on CUDA, compiled) and an exact
chunked path in plain PyTorch (queries in chunks against only the keys they can see; a custom backward
recomputes each chunk from the saved log-sum-exp), used wherever FlexAttention has no backward (CPU).
Neither builds the ``L x L`` score matrix (FlexAttention only when compiled, as on CUDA; its uncompiled
CPU fallback is for checks). GQA is handled by FlexAttention's ``enable_gqa`` and, in the chunked path,
by folding the query heads of one KV head into the query rows: K and V are never repeated per head.

Use::

    from sinkflex_core import attention
    attention.apply(model, n_sink=4, window=4096, learn_sinks=True)      # a loaded HF causal LM
    # or: from_pretrained(..., attn_implementation="sinkflex") after importing this module
    est = attention.estimate_layer_sinks(model, calibration_ids)        # per-layer sink counts
    attention.save_layer_sinks(est, model_dir)                          # model_dir/sinkflex_sinks.json
    attention.apply(model, window=4096, layer_sinks=model_dir)
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from torch.nn.attention.flex_attention import (  # isort: skip
    AuxRequest,
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
    or_masks,
)

__all__ = [
    "IMPLEMENTATION",
    "DEFAULT_SINK_LOGIT",
    "SINKS_FILENAME",
    "causal_mask",
    "sliding_window_mask",
    "sink_token_mask",
    "document_mask",
    "key_padding_mask",
    "sink_window_mask",
    "document_starts",
    "SinkFlexMask",
    "apply_zero_value_sink",
    "sink_attention",
    "reference_attention",
    "register",
    "sinkflex_attention_forward",
    "sinkflex_mask",
    "apply",
    "sink_parameters",
    "load_sink_logits",
    "attention_settings",
    "save_attention_settings",
    "early_key_mass",
    "SinkEstimate",
    "estimate_layer_sinks",
    "save_layer_sinks",
    "load_layer_sinks",
]

IMPLEMENTATION = "sinkflex"
PROBE_IMPLEMENTATION = "sinkflex_probe"
SINKS_FILENAME = "sinkflex_sinks.json"
SETTINGS_FILENAME = "sinkflex_attention.json"
DEFAULT_N_SINK = 4
DEFAULT_WINDOW = 4096
# Initial sink logit s0. Each attention output row is scaled by 1 - eps, eps = sigmoid(s0 - lse) <=
# exp(s0 - lse): with s0 = -10 that is <= 4.5e-5 for every row whose log-sum-exp is >= 0 (a row with any
# non-negative score, or log(n_keys) above its mean score), and ~4.5e-5 / n_keys for near-uniform rows.
# Far more negative values (-16) leave the outputs even closer but make the gradient (~eps) fall below
# Adam's epsilon (1e-8), so the sinks would not learn.
DEFAULT_SINK_LOGIT = -10.0
DEFAULT_CHUNK = 256

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _check_count(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``. A sink count or a window is a number of tokens: a fractional
    value (or a bool) is refused rather than rounded, and a whole float such as 4096.0 is accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a whole number of tokens, got {value!r} ({type(value).__name__})")
    if not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}" + (" (it counts the query itself)" if name == "window" else "")
                         + f", got {value}")
    return value


# --------------------------------------------------------------------------------------------------
# mask_mods: index-based, composable with torch's and_masks / or_masks; they work on scalars (vmap in
# FlexAttention) and on broadcastable index tensors (the chunked path and the dense reference).
# --------------------------------------------------------------------------------------------------
def causal_mask(b, h, q_idx, kv_idx):
    """Key ``kv_idx`` is not after query ``q_idx``."""
    return q_idx >= kv_idx


def sliding_window_mask(window: int, real_count: Tensor | None = None) -> MaskMod:
    """Keys ``q_idx - window + 1 .. q_idx`` (the window counts the query itself); combine with causal.

    With ``real_count`` (B, L) long, the running count of real (non-padding) keys of each row, the window
    holds the last ``window`` *real* keys instead: padding columns inside a row take no place in it."""
    window = _check_count("window", window, 1)
    if real_count is None:

        def sliding_window(b, h, q_idx, kv_idx):
            return q_idx - kv_idx < window

    else:

        def sliding_window(b, h, q_idx, kv_idx):
            return real_count[b, q_idx] - real_count[b, kv_idx] < window

    return sliding_window


def sink_token_mask(n_sink: int, document_start: Tensor | None = None, real_count: Tensor | None = None) -> MaskMod:
    """The first ``n_sink`` keys of each document (of the row when ``document_start`` (B, L) is None);
    the first ``n_sink`` real keys when ``real_count`` (B, L), the running count of real keys, is given."""
    n_sink = _check_count("n_sink", n_sink, 0)
    if real_count is not None:
        start = document_start if document_start is not None else torch.zeros_like(real_count)
        # real keys before each key in its document (0 for the document's first token, a real one)
        rank = real_count - real_count.gather(1, start)

        def sink_tokens(b, h, q_idx, kv_idx):
            return rank[b, kv_idx] < n_sink

    elif document_start is None:

        def sink_tokens(b, h, q_idx, kv_idx):
            return kv_idx < n_sink

    else:

        def sink_tokens(b, h, q_idx, kv_idx):
            return kv_idx - document_start[b, kv_idx] < n_sink

    return sink_tokens


def document_mask(document_ids: Tensor) -> MaskMod:
    """Query and key in the same document; ``document_ids`` (B, L) numbers the packed documents of a row."""

    def same_document(b, h, q_idx, kv_idx):
        return document_ids[b, q_idx] == document_ids[b, kv_idx]

    return same_document


def key_padding_mask(key_valid: Tensor) -> MaskMod:
    """Keys that are real tokens; ``key_valid`` (B, L) bool."""

    def real_key(b, h, q_idx, kv_idx):
        return key_valid[b, kv_idx]

    return real_key


def sink_window_mask(n_sink: int, window: int | None, document_start: Tensor | None = None,
                     real_count: Tensor | None = None) -> MaskMod:
    """causal AND (sink tokens OR sliding window); plain causal when ``window`` is None. ``real_count``
    (B, L): count sinks and window in real keys (see :func:`sliding_window_mask`)."""
    if window is None:
        return causal_mask
    if _check_count("n_sink", n_sink, 0) == 0:
        return and_masks(causal_mask, sliding_window_mask(window, real_count))
    return and_masks(causal_mask, or_masks(sink_token_mask(n_sink, document_start, real_count),
                                           sliding_window_mask(window, real_count)))


def _shift_queries(mask_mod: MaskMod, offset: int) -> MaskMod:
    if offset == 0:
        return mask_mod

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + offset, kv_idx)

    return shifted


def document_starts(valid: Tensor, continues: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Which tokens start a document: (B, L) bool, from ``valid`` (B, L) bool, True on real tokens.

    The one rule behind every mask here: a real token starts a document when it is the first real token
    of its row, or when ``continues(prev)`` says it does not continue the document of the previous *real*
    token of its row (``prev`` (B, L) long: index of that token, 0 where there is none; ``continues``
    returns (B, L) bool). Padding never starts a document, and a run of padding inside a row (a batch of
    turns of different lengths, padded to one width) does not cut the row in two: the tokens after it
    keep their sinks and their prompt.
    """
    valid = valid.to(torch.bool)
    b, n = valid.shape
    pos = torch.arange(n, device=valid.device).expand(b, n)
    last_real = torch.where(valid, pos, torch.full_like(pos, -1)).cummax(-1).values
    prev = torch.full_like(last_real, -1)
    prev[:, 1:] = last_real[:, :-1]
    starts = valid & (prev < 0)
    if continues is not None:
        starts |= valid & ~starts & ~continues(prev.clamp(min=0)).to(torch.bool)
    return starts


def _boundaries_to_layout(is_start: Tensor) -> tuple[Tensor, Tensor]:
    """(B, L) bool document starts -> document ids and each position's document start, both (B, L)."""
    is_start = is_start.clone()
    is_start[:, 0] = True
    ids = is_start.long().cumsum(-1) - 1
    pos = torch.arange(is_start.shape[1], device=is_start.device).expand_as(ids)
    start = torch.where(is_start, pos, torch.zeros_like(pos)).cummax(-1).values
    return ids, start


@dataclass(eq=False)
class SinkFlexMask:
    """What one batch's attention masks need, built once per batch and shared by every layer.

    Keys are indexed ``0 .. kv_len-1``; query ``i`` sits at key index ``q_offset + i`` (``q_offset`` > 0
    when decoding with a cache). ``document_ids`` / ``document_start`` (B, kv_len) describe packed rows,
    ``key_valid`` (B, kv_len) marks real (non-padding) keys; all three may be None (one document, no
    padding). BlockMasks and the chunked path's sink indices are cached per ``(n_sink, window)``, so layers
    sharing a mask share one BlockMask.
    """

    batch_size: int
    q_len: int
    kv_len: int
    q_offset: int = 0
    document_ids: Tensor | None = None
    document_start: Tensor | None = None
    key_valid: Tensor | None = None
    device: torch.device | str = "cpu"
    keys_dropped: int = 0  # keys a sliding-window cache has evicted before key 0 (sinks need the first ones)
    _cache: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def causal(cls, batch_size: int, q_len: int, kv_len: int | None = None, device="cpu") -> SinkFlexMask:
        """One document per row, no padding; the ``q_len`` queries are the last ``q_len`` of the
        ``kv_len`` keys (``q_len <= kv_len``)."""
        kv_len = q_len if kv_len is None else kv_len
        return cls(batch_size, q_len, kv_len, q_offset=kv_len - q_len, device=device)

    @classmethod
    def from_segment_ids(cls, segment_ids: Tensor, attention_mask: Tensor | None = None) -> SinkFlexMask:
        """Packed rows from segment ids (B, L): a new document starts wherever the id changes.
        Padding: ``attention_mask`` (B, L) with 0 on padding, or segment id < 0."""
        if segment_ids.dim() != 2:
            raise ValueError(f"segment_ids must be (batch, length), got shape {tuple(segment_ids.shape)}")
        valid = segment_ids >= 0
        if attention_mask is not None:
            valid = valid & attention_mask.to(torch.bool)
        is_start = document_starts(valid, lambda prev: segment_ids == segment_ids.gather(1, prev))
        return cls._from_starts(is_start, valid)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor, attention_mask: Tensor | None = None) -> SinkFlexMask:
        """Packed rows from position ids (B, L): a new document starts wherever the position does not
        continue the previous one by +1 (the rule Hugging Face uses to detect packing)."""
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be (batch, length), got shape {tuple(position_ids.shape)}")
        valid = (
            torch.ones_like(position_ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        is_start = document_starts(valid, lambda prev: position_ids == position_ids.gather(1, prev) + 1)
        return cls._from_starts(is_start, valid)

    @classmethod
    def _from_starts(cls, is_start: Tensor, valid: Tensor) -> SinkFlexMask:
        b, n = valid.shape
        ids, start = _boundaries_to_layout(is_start)
        packed = bool(is_start[:, 1:].any())
        return cls(
            b,
            n,
            n,
            0,
            ids if packed else None,
            start if packed else None,
            None if bool(valid.all()) else valid,
            valid.device,
        )

    def contiguous(self) -> SinkFlexMask:
        """Itself: ``generate`` with a static cache calls ``.contiguous()`` on the masks it prepares."""
        return self

    # ------------------------------------------------------------------ masks
    @property
    def real_count(self) -> Tensor | None:
        """(B, kv_len) long: real keys up to and including each key, None without padding. Sinks and
        the window count real keys, so padding columns inside a row (a cache holding turns of different
        lengths) neither take a place in the window nor push a sink out."""
        if self.key_valid is None:
            return None
        if "count" not in self._cache:
            self._cache["count"] = self.key_valid.long().cumsum(-1)
        return self._cache["count"]

    def mask_mod(self, n_sink: int, window: int | None) -> MaskMod:
        """The composed mask_mod in (query index, key index) of this batch."""
        parts = [sink_window_mask(n_sink, window, self.document_start, self.real_count)]
        if self.document_ids is not None:
            parts.append(document_mask(self.document_ids))
        if self.key_valid is not None:
            parts.append(key_padding_mask(self.key_valid))
        mod = parts[0] if len(parts) == 1 else and_masks(*parts)
        return _shift_queries(mod, self.q_offset)

    def block_mask(self, n_sink: int, window: int | None) -> BlockMask:
        """FlexAttention BlockMask, built once per (n_sink, window) and reused by every layer."""
        key = ("block", n_sink, window)
        if key not in self._cache:
            per_row = self.document_ids is not None or self.key_valid is not None
            self._cache[key] = create_block_mask(
                self.mask_mod(n_sink, window),
                self.batch_size if per_row else None,
                None,
                self.q_len,
                self.kv_len,
                device=self.device,
                _compile=torch.device(self.device).type == "cuda",
            )
        return self._cache[key]

    def dense(self, n_sink: int, window: int | None) -> Tensor:
        """(B, q_len, kv_len) bool; for tests and pictures only (it is L x L)."""
        dev = self.device
        b = torch.arange(self.batch_size, device=dev)[:, None, None]
        q = torch.arange(self.q_len, device=dev)[None, :, None]
        kv = torch.arange(self.kv_len, device=dev)[None, None, :]
        out = self.mask_mod(n_sink, window)(b, torch.zeros((), dtype=torch.long, device=dev), q, kv)
        return out.expand(self.batch_size, self.q_len, self.kv_len)

    def sink_index(self, n_sink: int) -> Tensor:
        """(B, S) key indices that are sink tokens (first ``n_sink`` of each document), -1 padded."""
        key = ("sinks", n_sink)
        if key not in self._cache:
            pos = torch.arange(self.kv_len, device=self.device).expand(self.batch_size, -1)
            start = self.document_start if self.document_start is not None else torch.zeros_like(pos)
            count = self.real_count
            is_sink = (pos - start if count is None else count - count.gather(1, start)) < n_sink
            if self.key_valid is not None:
                is_sink = is_sink & self.key_valid
            width = max(int(is_sink.sum(-1).max()), 1)
            # stable sort keeps sinks in order and moves non-sinks behind them
            order = torch.argsort((~is_sink).to(torch.int8), dim=-1, stable=True)[:, :width]
            idx = torch.where(is_sink.gather(-1, order), order, torch.full_like(order, -1))
            self._cache[key] = idx
        return self._cache[key]


# --------------------------------------------------------------------------------------------------
# the zero-value sink
# --------------------------------------------------------------------------------------------------
def apply_zero_value_sink(out: Tensor, lse: Tensor, sink_logits: Tensor | None) -> Tensor:
    """``out * sigmoid(lse - s)`` in float32.

    out (B, H, L, D), lse (B, H, L) (natural log), sink_logits (H,). Returns out's dtype.
    """
    if sink_logits is None:
        return out
    if sink_logits.shape != (out.shape[1],):
        raise ValueError(f"sink_logits must have shape ({out.shape[1]},) (one per query head), got "
                         f"{tuple(sink_logits.shape)}")
    # 1 - sigmoid(s - lse) is sigmoid(lse - s) written so that its gradient survives in float32 at a
    # very negative initial s (sigmoid(lse - s) would round to exactly 1 and pass a zero gradient)
    gate = 1.0 - torch.sigmoid(sink_logits.float().view(1, -1, 1) - lse.float())
    return (out.float() * gate.unsqueeze(-1)).to(out.dtype)


# --------------------------------------------------------------------------------------------------
# the exact chunked path
# --------------------------------------------------------------------------------------------------
class _ChunkPlan:
    """For each query chunk: which keys it may see (sinks before the window, then the window range)
    and the boolean mask over them. Recomputed in backward instead of being stored."""

    def __init__(self, mask: SinkFlexMask, n_sink: int, window: int | None, chunk: int):
        self.mask, self.n_sink, self.window, self.chunk = mask, n_sink, window, chunk
        self.mod = mask.mask_mod(n_sink, window)
        self.sinks = mask.sink_index(n_sink) if (window is not None and n_sink > 0) else None

    def _window_start(self, q: int) -> int:
        """The first key index any row's window can reach from query index ``q`` (the chunk's first)."""
        count = self.mask.real_count
        if count is None:
            return max(0, q - self.window + 1)
        q = min(max(q, 0), self.mask.kv_len - 1)
        # first key whose count of real keys up to the query is below the window, the lowest over rows
        first = torch.searchsorted(count, count[:, q:q + 1] - self.window, right=True)
        return int(first.min())

    def chunks(self):
        m = self.mask
        dev = m.device
        for q0 in range(0, m.q_len, self.chunk):
            q1 = min(q0 + self.chunk, m.q_len)
            hi = min(m.q_offset + q1, m.kv_len)
            lo = 0 if self.window is None else self._window_start(m.q_offset + q0)
            win = torch.arange(lo, hi, device=dev).expand(m.batch_size, -1)
            extra_ok = torch.ones_like(win, dtype=torch.bool)
            if self.sinks is not None and lo > 0:
                s = self.sinks
                ok = (s >= 0) & (s < lo)
                # masked slots point at key 0 with probability exactly 0, so adding them back is harmless
                kv = torch.cat([torch.where(ok, s, torch.zeros_like(s)), win], dim=1)
                extra_ok = torch.cat([ok, extra_ok], dim=1)
            else:
                kv = win
            b = torch.arange(m.batch_size, device=dev)[:, None, None]
            q = torch.arange(q0, q1, device=dev)[None, :, None]
            allowed = self.mod(b, torch.zeros((), dtype=torch.long, device=dev), q, kv[:, None, :])
            allowed = allowed.expand(m.batch_size, q1 - q0, kv.shape[1]) & extra_ok[:, None, :]
            yield q0, q1, kv, allowed


def _gather_keys(x: Tensor, kv: Tensor) -> Tensor:
    """x (B, Hkv, Lk, D), kv (B, K) -> (B, Hkv, K, D) float32."""
    idx = kv[:, None, :, None].expand(x.shape[0], x.shape[1], kv.shape[1], x.shape[3])
    return x.gather(2, idx).float()


def _chunk_scores(q: Tensor, k: Tensor, q0: int, q1: int, kv: Tensor, allowed: Tensor, scale: float):
    """Masked scores of one query chunk, query heads of a KV head folded into rows.
    Returns qc (B, Hkv, G*C, D), k_sel (B, Hkv, K, D), s (B, Hkv, G, C, K) float32."""
    bsz, hq, _, d = q.shape
    hkv = k.shape[1]
    g, c = hq // hkv, q1 - q0
    qc = q[:, :, q0:q1].float().reshape(bsz, hkv, g * c, d)
    k_sel = _gather_keys(k, kv)
    s = (qc @ k_sel.transpose(-1, -2)).mul_(scale).view(bsz, hkv, g, c, -1)
    s.masked_fill_(~allowed[:, None, None], float("-inf"))
    return qc, k_sel, s


def _probs_(s: Tensor, lse: Tensor) -> Tensor:
    """exp(s - lse), in place in ``s``; rows with no visible key (lse = -inf) get all zeros."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return s.sub_(safe.unsqueeze(-1)).exp_()


class _ChunkedAttention(torch.autograd.Function):
    """(out, lse) of masked softmax attention, chunked over queries, exact backward from lse."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _ChunkPlan, scale: float):
        bsz, hq, lq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        out = torch.empty(bsz, hkv, g, lq, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, hkv, g, lq, dtype=torch.float32, device=q.device)
        for q0, q1, kv, allowed in plan.chunks():
            _, _, s = _chunk_scores(q, k, q0, q1, kv, allowed, scale)
            lse_c = torch.logsumexp(s, dim=-1)
            p = _probs_(s, lse_c)
            c = q1 - q0
            o = p.view(bsz, hkv, g * c, -1) @ _gather_keys(v, kv)
            out[:, :, :, q0:q1] = o.view(bsz, hkv, g, c, -1)
            lse[:, :, :, q0:q1] = lse_c
        out = out.view(bsz, hq, lq, -1)
        lse = lse.view(bsz, hq, lq)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        bsz, hq, lq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        d_out = torch.zeros_like(out) if d_out is None else d_out.float()
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.float()
        # softmax backward: dS = P * (dP - rowsum(dO * O) + dLSE)
        delta = (d_out * out).sum(-1)
        d_out5 = d_out.view(bsz, hkv, g, lq, -1)
        delta5, dlse5, lse5 = (x.view(bsz, hkv, g, lq) for x in (delta, d_lse, lse))
        dq = torch.zeros(bsz, hkv, g, lq, d, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for q0, q1, kv, allowed in plan.chunks():
            c = q1 - q0
            qc, k_sel, s = _chunk_scores(q, k, q0, q1, kv, allowed, scale)
            p = _probs_(s, lse5[:, :, :, q0:q1])
            do = d_out5[:, :, :, q0:q1].reshape(bsz, hkv, g * c, -1)
            p2 = p.view(bsz, hkv, g * c, -1)
            v_sel = _gather_keys(v, kv)
            dp = (do @ v_sel.transpose(-1, -2)).view_as(p)
            ds = dp.sub_((delta5[:, :, :, q0:q1] - dlse5[:, :, :, q0:q1]).unsqueeze(-1)).mul_(p)
            ds2 = ds.view(bsz, hkv, g * c, -1)
            dq[:, :, :, q0:q1] = (ds2 @ k_sel).mul_(scale).view(bsz, hkv, g, c, d)
            idx_k = kv[:, None, :, None].expand(bsz, hkv, kv.shape[1], d)
            idx_v = kv[:, None, :, None].expand(bsz, hkv, kv.shape[1], v.shape[-1])
            dk.scatter_add_(2, idx_k, (ds2.transpose(-1, -2) @ qc).mul_(scale))
            dv.scatter_add_(2, idx_v, p2.transpose(-1, -2) @ do)
        return dq.view(bsz, hq, lq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: SinkFlexMask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            # integer or boolean inputs would be computed in float and truncated back to their dtype
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, length, head_dim)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in batch, heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch size or head_dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if (q.shape[0], q.shape[2], k.shape[2]) != (mask.batch_size, mask.q_len, mask.kv_len):
        raise ValueError(
            f"mask is for batch {mask.batch_size}, {mask.q_len} queries, {mask.kv_len} keys; got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if mask.q_offset < 0:
        raise ValueError(
            f"more queries than keys ({mask.q_len} queries, {mask.kv_len} keys, query 0 at key index "
            f"{mask.q_offset}): the first queries would see no key at all. The queries are the last "
            "q_len positions of the keys (a cache holds the earlier ones)")


_COMPILED_FLEX: dict = {}
# torch.compile's ``dynamic`` for FlexAttention: None (default) recompiles once per new shape and then
# switches to dynamic shapes, which suits training on varying lengths; benchmarks set False.
FLEX_COMPILE_DYNAMIC: bool | None = None


def _flex(device_type: str):
    if device_type != "cuda":
        # uncompiled flex is forward-only on CPU and materialises the scores: tests and pictures only
        return flex_attention
    key = ("cuda", FLEX_COMPILE_DYNAMIC)
    if key not in _COMPILED_FLEX:
        _COMPILED_FLEX[key] = torch.compile(flex_attention, dynamic=FLEX_COMPILE_DYNAMIC)
    return _COMPILED_FLEX[key]


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: SinkFlexMask | None = None,
    *,
    n_sink: int = 0,
    window: int | None = None,
    sink_logits: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
    return_lse: bool = False,
):
    """Sink-aware attention. q (B, H, Lq, D), k and v (B, Hkv, Lk, D) with H a multiple of Hkv,
    ``mask`` describes the batch (default: causal, one document per row), ``sink_logits`` (H,).

    backend: "flex" (FlexAttention; forward only on CPU), "chunked" (exact pure PyTorch) or "auto"
    (flex on CUDA, chunked elsewhere). Returns out (B, H, Lq, D) in q's dtype, and the log-sum-exp
    (B, H, Lq) float32 of the visible scores (before the sink) when ``return_lse``.
    """
    if mask is None:
        mask = SinkFlexMask.causal(q.shape[0], q.shape[2], k.shape[2], device=q.device)
    _check_inputs(q, k, v, mask)
    n_sink = _check_count("n_sink", n_sink, 0)
    window = None if window is None else _check_count("window", window, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "chunked"
    if backend == "flex":
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sink_logits)
        )
        if q.device.type == "cpu" and needs_grad:
            raise NotImplementedError(
                "FlexAttention has no backward on CPU; use backend='chunked' (or 'auto') for training on CPU"
            )
        if q.device.type == "cpu":
            # flex refuses CPU inputs that require grad even under no_grad
            q, k, v = q.detach(), k.detach(), v.detach()
        out, aux = _flex(q.device.type)(
            q,
            k,
            v,
            block_mask=mask.block_mask(n_sink, window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
        )
        lse = aux.lse.float()
    elif backend == "chunked":
        chunk_size = _check_count("chunk_size", chunk_size, 1)
        out, lse = _ChunkedAttention.apply(q, k, v, _ChunkPlan(mask, n_sink, window, chunk_size), scale)
    else:
        raise ValueError(f"backend must be 'auto', 'flex' or 'chunked', got {backend!r}")
    out = apply_zero_value_sink(out, lse, sink_logits)
    return (out, lse) if return_lse else out


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: SinkFlexMask | None = None,
    *,
    n_sink: int = 0,
    window: int | None = None,
    sink_logits: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Dense float64 reference: full score matrix, K/V repeated, the sink as an extra softmax column
    that is dropped after normalising. Same arguments as :func:`sink_attention`; returns float64."""
    if mask is None:
        mask = SinkFlexMask.causal(q.shape[0], q.shape[2], k.shape[2], device=q.device)
    _check_inputs(q, k, v, mask)
    n_sink = _check_count("n_sink", n_sink, 0)
    window = None if window is None else _check_count("window", window, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double() for x in (q, k, v))
    k64, v64 = k64.repeat_interleave(g, dim=1), v64.repeat_interleave(g, dim=1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    allowed = mask.dense(n_sink, window)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    if sink_logits is not None:
        col = sink_logits.double().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, col], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sink_logits is not None:
        p = p[..., :-1]
    return p @ v64


# --------------------------------------------------------------------------------------------------
# Hugging Face integration
# --------------------------------------------------------------------------------------------------
def sinkflex_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs,
) -> SinkFlexMask:
    """Mask function for ``transformers.AttentionMaskInterface``: turns what ``create_causal_mask``
    passes (a causal mask_function, possibly AND-ed with Hugging Face's packed-sequence mask, and a 2D
    padding mask (B, kv_length)) into a :class:`SinkFlexMask` that every layer shares.

    Document boundaries are read from ``mask_function`` on adjacent positions only (position ``p``
    continues the document of ``p - 1`` iff ``mask_function(p, p - 1)`` holds), so no L x L mask is
    evaluated. Other overlays Hugging Face may add (e.g. bidirectional blocks) are
    not carried over. With a static cache (``generate(..., cache_implementation="static")``) the keys are
    the whole preallocated cache and the padding mask covers only the tokens seen so far; the slots
    after them count as padding.
    """
    q_offset = int(q_offset)
    valid = None
    if attention_mask is not None:
        valid = attention_mask.to(device=device, dtype=torch.bool)[:, -kv_length:]
        if valid.dim() == 2 and valid.shape[0] == batch_size and valid.shape[1] < kv_length:
            # a static cache: keys are the whole preallocated buffer, the mask covers the tokens seen so
            # far, and the slots after them are not written yet (causality hides them too)
            valid = torch.nn.functional.pad(valid, (0, kv_length - valid.shape[1]), value=False)
        if valid.shape != (batch_size, kv_length):
            raise ValueError(f"padding mask must be (batch, kv_length)={batch_size, kv_length}, "
                             f"got {tuple(valid.shape)}")
    continues = None
    if mask_function is not None and kv_length > 1:
        # breaks between adjacent positions, then: a token continues the previous real one when no break
        # lies between them (a padding run between the two is not a break of its own)
        b = torch.arange(batch_size, device=device)[:, None]
        p = torch.arange(kv_offset + 1, kv_offset + kv_length, device=device)[None, :]
        joined = mask_function(b, torch.zeros((), dtype=torch.long, device=device), p, p - 1)
        breaks = torch.zeros(batch_size, kv_length, dtype=torch.long, device=device)
        breaks[:, 1:] = (~torch.as_tensor(joined, device=device)).expand(batch_size, kv_length - 1).long()
        count = breaks.cumsum(-1)

        def continues(prev):
            return count == count.gather(1, prev)

    all_real = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
    is_start = document_starts(all_real if valid is None else valid, continues)
    packed = bool(is_start[:, 1:].any())
    ids, start = _boundaries_to_layout(is_start) if packed else (None, None)
    if valid is not None and bool(valid.all()):
        valid = None
    return SinkFlexMask(
        batch_size,
        q_length,
        kv_length,
        q_offset - kv_offset,
        ids,
        start,
        valid,
        device,
        keys_dropped=int(kv_offset),
    )


_NO_SETTINGS = object()


def _layer_settings(module: nn.Module) -> tuple[int, int | None]:
    """(n_sink, window) of one attention layer: set by :func:`apply`, else read from the config
    (``sinkflex_n_sink`` or ``sinkflex_layer_sinks``, and ``sinkflex_window``). There is no silent
    default: a model switched to ``"sinkflex"`` with neither gets a ValueError that says what to do."""
    cfg = getattr(module, "config", None)
    n_sink = getattr(module, "sinkflex_n_sink", None)
    if n_sink is None:
        per_layer = getattr(cfg, "sinkflex_layer_sinks", None)
        layer = getattr(module, "layer_idx", None)
        if per_layer is not None and layer is not None:
            n_sink = per_layer[layer]
        else:
            n_sink = getattr(cfg, "sinkflex_n_sink", None)
    window = getattr(module, "sinkflex_window", getattr(cfg, "sinkflex_window", _NO_SETTINGS))
    if n_sink is None or window is _NO_SETTINGS:
        raise ValueError(
            f"attn_implementation='{IMPLEMENTATION}' but layer {getattr(module, 'layer_idx', '?')} has no sink "
            "settings: call sinkflex_core.attention.apply(model, n_sink=..., window=...) (it also adds the "
            "learned sinks), or load a saved policy with sinkflex_core.models.load_policy(folder)")
    return _check_count("n_sink", n_sink, 0), None if window is None else _check_count("window", window, 1)


def sinkflex_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: SinkFlexMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention function for ``transformers.AttentionInterface``.

    query (B, H, Lq, D), key/value (B, Hkv, Lk, D) -> (B, Lq, H, D). The layer's sink count and window
    come from the module (set by :func:`apply`) or the config (``sinkflex_n_sink``, ``sinkflex_window``,
    ``sinkflex_layer_sinks``), the window capped by the layer's own ``sliding_window`` if it has one; the
    sink logits from the module's ``sinkflex_sink_logits`` or, for models that already have sinks
    (gpt-oss), from ``s_aux``. ``attention_mask`` is the batch's :class:`SinkFlexMask`, built by
    :func:`sinkflex_mask` or passed by the caller as ``attention_mask={"full_attention": mask}``.
    """
    if dropout and module.training:
        raise NotImplementedError("sinkflex attention has no attention dropout; set attention_dropout=0")
    if attention_mask is None:
        attention_mask = SinkFlexMask.causal(query.shape[0], query.shape[2], key.shape[2], device=query.device)
    elif not isinstance(attention_mask, SinkFlexMask):
        raise TypeError(
            "sinkflex attention needs the mask built by its own mask function (got "
            f"{type(attention_mask).__name__}); call sinkflex_core.attention.register() before the model runs"
        )
    n_sink, window = _layer_settings(module)
    if getattr(getattr(module, "config", None), "sinkflex_learn_sinks", False) and \
            getattr(module, "sinkflex_sink_logits", None) is None:
        raise ValueError(
            f"this model was trained with learned sink logits, which layer {getattr(module, 'layer_idx', '?')} "
            "lacks (from_pretrained drops them): load it with sinkflex_core.models.load_policy(folder), or "
            "call attention.apply(model, ...) then attention.load_sink_logits(model, folder)")
    if n_sink and attention_mask.keys_dropped:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: {n_sink} sink tokens, but the cache has "
                         f"evicted the first {attention_mask.keys_dropped} keys (a sliding-window cache layer); "
                         "generate with a cache that keeps every key, or with n_sink=0 on sliding layers")
    own_window = kwargs.get("sliding_window")
    if own_window:
        # layers that are sliding-window by design (gpt-oss, Mistral-style) keep at most their own window
        window = own_window if window is None else min(window, own_window)
    sinks = getattr(module, "sinkflex_sink_logits", None)
    if sinks is None:
        sinks = s_aux
    out = sink_attention(
        query,
        key,
        value,
        attention_mask,
        n_sink=n_sink,
        window=window,
        sink_logits=sinks,
        scale=scaling,
        backend=getattr(module, "sinkflex_backend", "auto"),
        chunk_size=getattr(module, "sinkflex_chunk_size", DEFAULT_CHUNK),
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``attn_implementation="sinkflex"`` (attention and mask) with transformers; idempotent."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, sinkflex_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sinkflex_mask)
    AttentionInterface.register(PROBE_IMPLEMENTATION, _probe_attention_forward)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, sinkflex_mask)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    mods = [
        m
        for m in model.modules()
        if "Attention" in type(m).__name__ and hasattr(m, "layer_idx") and hasattr(m, "o_proj")
    ]
    if not mods:
        raise ValueError(f"no attention layers (with layer_idx and o_proj) found in {type(model).__name__}")
    return mods


def _set_implementation(model: nn.Module, name: str) -> None:
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def apply(
    model: nn.Module,
    n_sink: int = DEFAULT_N_SINK,
    window: int | None = DEFAULT_WINDOW,
    learn_sinks: bool = True,
    *,
    layer_sinks: Sequence[int] | str | os.PathLike | None = None,
    sink_init: float = DEFAULT_SINK_LOGIT,
    backend: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
) -> nn.Module:
    """Switch a Hugging Face causal LM (Qwen2, Llama, ...) to sink-aware attention, in place.

    Every attention layer keeps ``n_sink`` sink tokens per document plus a window of ``window`` keys
    (counting the query); ``window=None`` keeps full causal attention. ``layer_sinks`` (a list with one
    count per layer, or a JSON file / model folder written by :func:`save_layer_sinks`) overrides
    ``n_sink`` layer by layer. ``learn_sinks`` adds a float32 parameter ``sinkflex_sink_logits`` (H,)
    to every attention layer, initialised at ``sink_init`` so that outputs are unchanged (see
    ``DEFAULT_SINK_LOGIT``), or at the layer's own trained sink logits where it has them (gpt-oss). Call it before wrapping the model with peft; :func:`sink_parameters` lists
    the new parameters (to keep them trainable next to LoRA). Returns the model.
    """
    register()
    window = None if window is None else _check_count("window", window, 1)
    n_sink = _check_count("n_sink", n_sink, 0)
    chunk_size = _check_count("chunk_size", chunk_size, 1)
    mods = _attention_modules(model)
    if isinstance(layer_sinks, str | os.PathLike):  # a str is a Sequence too: test the path types first
        layer_sinks = load_layer_sinks(layer_sinks)
    if layer_sinks is not None and len(layer_sinks) != len(mods):
        raise ValueError(f"layer_sinks has {len(layer_sinks)} entries for {len(mods)} attention layers")
    if layer_sinks is not None:
        layer_sinks = [_check_count("layer_sinks entry", x, 0) for x in layer_sinks]
    cfg = model.config
    n_heads = cfg.num_attention_heads
    for m in mods:
        m.sinkflex_n_sink = int(layer_sinks[m.layer_idx]) if layer_sinks is not None else int(n_sink)
        m.sinkflex_window = window
        m.sinkflex_backend = backend
        m.sinkflex_chunk_size = chunk_size
        if learn_sinks and not hasattr(m, "sinkflex_sink_logits"):
            dev = m.o_proj.weight.device
            own = getattr(m, "sinks", None)  # gpt-oss's trained sink logits: start from them, not from sink_init
            init = (own.detach().float().clone() if isinstance(own, torch.Tensor) and own.shape == (n_heads,)
                    else torch.full((n_heads,), float(sink_init), dtype=torch.float32, device=dev))
            m.register_parameter("sinkflex_sink_logits", nn.Parameter(init))
    cfg.sinkflex_n_sink = n_sink
    cfg.sinkflex_window = window
    cfg.sinkflex_layer_sinks = None if layer_sinks is None else [int(x) for x in layer_sinks]
    # saved with the config: a model loaded without its learned sinks then refuses to run (see
    # sinkflex_attention_forward) instead of running a different attention
    cfg.sinkflex_learn_sinks = any(hasattr(m, "sinkflex_sink_logits") for m in mods)
    _set_implementation(model, IMPLEMENTATION)
    return model


def sink_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The sink-logit parameters added by :func:`apply` (one (H,) tensor per layer)."""
    return [p for n, p in model.named_parameters() if n.endswith("sinkflex_sink_logits")]


def load_sink_logits(model: nn.Module, model_dir: str | os.PathLike) -> int:
    """Copy the sink logits saved by ``save_pretrained`` (``*.safetensors`` in ``model_dir``) into a model
    switched by :func:`apply` (``from_pretrained`` drops them as unknown keys). Returns how many tensors
    were loaded; raises if the folder holds none or if one has no matching parameter."""
    from safetensors import safe_open

    params = {n.split("sinkflex_sink_logits")[0]: p for n, p in model.named_parameters()
              if n.endswith("sinkflex_sink_logits")}
    loaded = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if not key.endswith("sinkflex_sink_logits"):
                    continue
                prefix = key.split("sinkflex_sink_logits")[0]
                # saved names may lack or add a wrapper prefix (peft's base_model.model., ...)
                match = [p for n, p in params.items() if n.endswith(prefix) or prefix.endswith(n)]
                if len(match) != 1:
                    raise KeyError(f"no unique sink-logit parameter for {key} (call apply(..., learn_sinks=True) first)")
                with torch.no_grad():
                    match[0].copy_(f.get_tensor(key).to(match[0].dtype))
                loaded += 1
    if loaded == 0:
        raise FileNotFoundError(f"no sink logits in the safetensors files of {model_dir}")
    return loaded


def _saved_sink_logit_files(folder: Path) -> list[Path]:
    from safetensors import safe_open

    found = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if any(k.endswith("sinkflex_sink_logits") for k in f.keys()):
                found.append(file)
    return found


def attention_settings(source: nn.Module | str | os.PathLike) -> dict | None:
    """The sink attention a model runs with, or that a saved model folder was trained with: a dict
    ``{"n_sink", "window", "layer_sinks", "learn_sinks"}``, or None for a model without sink attention.

    A folder is read from ``sinkflex_attention.json`` (written by :func:`save_attention_settings`, the only
    record beside LoRA adapters) or else from the ``sinkflex_*`` entries :func:`apply` put in its
    ``config.json``; ``learn_sinks`` then says whether its safetensors files hold learned sink logits."""
    if isinstance(source, nn.Module):
        cfg = getattr(source, "config", None)
        if cfg is None or getattr(cfg, "sinkflex_n_sink", None) is None:
            return None
        return {"n_sink": cfg.sinkflex_n_sink, "window": getattr(cfg, "sinkflex_window", None),
                "layer_sinks": getattr(cfg, "sinkflex_layer_sinks", None),
                "learn_sinks": bool(sink_parameters(source))}
    folder = Path(source)
    saved = folder / SETTINGS_FILENAME
    if saved.is_file():
        data = json.loads(saved.read_text())
    elif (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        if cfg.get("sinkflex_n_sink") is None:
            return None
        data = {"n_sink": cfg["sinkflex_n_sink"], "window": cfg.get("sinkflex_window"),
                "layer_sinks": cfg.get("sinkflex_layer_sinks")}
    else:
        return None
    data = {k: data.get(k) for k in ("n_sink", "window", "layer_sinks")}
    data["learn_sinks"] = bool(_saved_sink_logit_files(folder))
    return data


def save_attention_settings(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write ``sinkflex_attention.json`` (sink counts and window of a model switched by :func:`apply`)
    into ``folder``, so that :func:`sinkflex_core.models.load_policy` rebuilds the attention even where
    no ``config.json`` is saved (LoRA adapters). Returns the path, or None for a model without sinks."""
    settings = attention_settings(model)
    if settings is None:
        return None
    path = Path(folder) / SETTINGS_FILENAME
    path.write_text(json.dumps({"format": "sinkflex-attention/1", **settings}, indent=1))
    return path


# --------------------------------------------------------------------------------------------------
# per-layer sink estimation
# --------------------------------------------------------------------------------------------------
def early_key_mass(
    q: Tensor,
    k: Tensor,
    n_probe: int,
    *,
    query_start: int | None = None,
    scale: float | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Tensor, int]:
    """Attention mass that the first ``n_probe`` key positions receive under plain causal attention.

    q (B, H, L, D), k (B, Hkv, L, D). Queries are processed in chunks (never L x L); only queries at
    positions >= ``query_start`` (default ``n_probe``) count, so that early queries, which see few
    keys, do not inflate the figures. Returns (sum over batch, query heads and counted queries of the
    softmax probability on each key position (n_probe,) float64, number of (row, head, query) counted).
    """
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    n_probe = min(n_probe, n)
    start = n_probe if query_start is None else query_start
    total = torch.zeros(n_probe, dtype=torch.float64, device=q.device)
    count = 0
    for q0 in range(start, n, chunk_size):
        q1 = min(q0 + chunk_size, n)
        c = q1 - q0
        qc = q[:, :, q0:q1].float().reshape(bsz, hkv, g * c, d)
        s = (qc @ k[:, :, :q1].float().transpose(-1, -2)).mul_(scale).view(bsz, hkv, g, c, q1)
        causal = torch.arange(q0, q1, device=q.device)[:, None] >= torch.arange(q1, device=q.device)[None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        total += p[..., :n_probe].sum(dim=(0, 1, 2, 3)).double()
        count += bsz * hq * c
    return total, count


_PROBE: dict = {}


def _probe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stock causal attention that also records the mass the early key positions receive."""
    acc = _PROBE["acc"]
    mass, count = early_key_mass(query, key, _PROBE["n_probe"], query_start=_PROBE["query_start"],
                                 scale=scaling)
    layer = module.layer_idx
    acc[layer][0] += mass
    acc[layer][1] += count
    out = sink_attention(query, key, value, attention_mask, n_sink=0, window=None, scale=scaling,
                         backend="chunked")
    return out.transpose(1, 2).contiguous(), None


@dataclass
class SinkEstimate:
    """Per-layer sink estimate. ``mass[l][j]``: mean probability a query of layer ``l`` puts on key
    position ``j`` (over calibration rows, heads and queries at positions >= ``query_start``);
    ``n_sink[l]``: the count chosen by the threshold rule (see :func:`estimate_layer_sinks`)."""

    mass: list[list[float]]
    n_sink: list[int]
    threshold: float
    min_sinks: int
    max_sinks: int
    query_start: int
    num_sequences: int
    sequence_length: int

    def to_json(self) -> dict:
        return {"format": "sinkflex-layer-sinks/1", **self.__dict__}


def choose_sink_count(mass: Sequence[float], threshold: float, min_sinks: int, max_sinks: int) -> int:
    """The threshold rule: the smallest prefix of positions holding every early position whose mean
    received mass is >= ``threshold``, clipped to ``[min_sinks, max_sinks]`` (the mask keeps a prefix of
    each document, so a sink at position 3 keeps positions 0..3)."""
    hits = [j for j, m in enumerate(mass) if m >= threshold]
    n = hits[-1] + 1 if hits else 0
    return int(min(max(n, min_sinks), max_sinks))


@torch.no_grad()
def estimate_layer_sinks(
    model: nn.Module,
    calibration_ids: Tensor,
    *,
    n_probe: int = 16,
    threshold: float = 0.05,
    min_sinks: int = 1,
    max_sinks: int = 16,
    query_start: int | None = None,
) -> SinkEstimate:
    """Estimate each layer's sink count from calibration sequences (B, L) of token ids (one document
    per row, no padding), running the model with its stock causal attention.

    Rule: a key position ``j < n_probe`` is a sink of layer ``l`` when queries (at positions >=
    ``query_start``, default ``n_probe``) put on average at least ``threshold`` of their attention on it
    (a uniform causal attention over ``L`` keys would give ~``log(L)/L``); the layer keeps the prefix up to
    its last sink, at least ``min_sinks`` and at most ``max_sinks`` positions.
    """
    if calibration_ids.dim() != 2:
        raise ValueError("calibration_ids must be (batch, length)")
    register()
    mods = _attention_modules(model)
    n_layers = len(mods)
    start = n_probe if query_start is None else query_start
    if calibration_ids.shape[1] <= start:
        raise ValueError(f"calibration sequences must be longer than query_start={start}")
    _PROBE.update(
        acc=[[torch.zeros(min(n_probe, calibration_ids.shape[1]), dtype=torch.float64), 0]
             for _ in range(n_layers)],
        n_probe=n_probe,
        query_start=start,
    )
    before = model.config._attn_implementation
    try:
        _set_implementation(model, PROBE_IMPLEMENTATION)
        model(input_ids=calibration_ids.to(mods[0].o_proj.weight.device), use_cache=False)
    finally:
        _set_implementation(model, before)
    mass = [(m / max(c, 1)).tolist() for m, c in _PROBE.pop("acc")]
    return SinkEstimate(
        mass=mass,
        n_sink=[choose_sink_count(m, threshold, min_sinks, max_sinks) for m in mass],
        threshold=threshold,
        min_sinks=min_sinks,
        max_sinks=max_sinks,
        query_start=start,
        num_sequences=int(calibration_ids.shape[0]),
        sequence_length=int(calibration_ids.shape[1]),
    )


def save_layer_sinks(estimate: SinkEstimate, model_dir: str | os.PathLike) -> Path:
    """Write ``sinkflex_sinks.json`` into the model's folder; returns its path."""
    path = Path(model_dir) / SINKS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(estimate.to_json(), indent=1))
    return path


def load_layer_sinks(path: str | os.PathLike) -> list[int]:
    """Per-layer sink counts from a JSON file written by :func:`save_layer_sinks` (or its folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / SINKS_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no per-layer sink file at {path} (write one with save_layer_sinks)")
    data = json.loads(path.read_text())
    if "n_sink" not in data or not all(isinstance(x, int) and x >= 0 for x in data["n_sink"]):
        raise ValueError(f"{path} has no valid 'n_sink' list of non-negative integers")
    return list(data["n_sink"])


@torch.no_grad()
def plant_attention_sink(model: nn.Module, layers: Sequence[int], token_id: int = 0, strength: float = 4.0) -> None:
    """Give a randomly initialised Qwen2/Llama-style model an attention sink on ``token_id``, in place,
    so that the estimator has something to find (sinks emerge in training; random weights have none).

    The token's embedding is set to one hidden direction no other token uses; in each layer of
    ``layers`` the keys pick that direction up, and the queries get a constant bias, on the rotary pair
    with the lowest frequency (so the score barely depends on distance). Queries then put a large,
    ``strength``-controlled share of their attention on every occurrence of the token. Needs q_proj with
    a bias (Qwen2) and the rotate-half rotary layout.
    """
    emb = model.get_input_embeddings().weight
    d0 = emb.shape[1] - 1
    emb[:, d0] = 0.0
    emb[token_id] = 0.0
    emb[token_id, d0] = 1.0
    for m in _attention_modules(model):
        if m.layer_idx not in layers:
            continue
        if m.q_proj.bias is None:
            raise ValueError("plant_attention_sink needs attention layers whose q_proj has a bias (Qwen2)")
        d = m.head_dim
        pair = d // 2 - 1  # lowest rotary frequency
        n_kv = m.k_proj.weight.shape[0] // d
        for h in range(n_kv):
            # after RMSNorm the token's hidden state is sqrt(hidden) on d0
            m.k_proj.weight[h * d + pair, d0] = strength / emb.shape[1] ** 0.5
        for h in range(m.q_proj.weight.shape[0] // d):
            m.q_proj.bias[h * d + pair] = strength


def uniform_baseline_mass(length: int, query_start: int) -> float:
    """Mean probability a uniform causal attention gives one early key, over queries >= query_start."""
    return float(sum(1.0 / (i + 1) for i in range(query_start, length)) / max(length - query_start, 1))


register()
