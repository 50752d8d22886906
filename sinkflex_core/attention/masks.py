"""The masks of sink-aware attention, as small named ``mask_mod`` functions that compose (causal,
sliding window, sink tokens, documents, key padding), and :class:`SinkFlexMask`, one mask given to
every backend: a FlexAttention block mask, the chunked path's index plan, or a dense boolean matrix."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torch.nn.attention.flex_attention import (  # isort: skip
    BlockMask,
    and_masks,
    create_block_mask,
    or_masks,
)

DEFAULT_N_SINK = 4
DEFAULT_WINDOW = 4096

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


