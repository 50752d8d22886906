"""Sink attention in the rollout fast path: one decoded token against a bounded cache.

Two things make decoding with sink attention (sinks + a window of ``W`` keys + the zero-value sink) as
cheap as decoding with SDPA, computing the same attention as training (within float rounding):

1. :func:`sink_decode_forward`: a query of one token sees at most ``n_sink + W`` keys, so its
   attention is one masked row, computed in one pass over the cache for all heads of a KV group (no
   ``repeat_kv`` copy, no chunk plan, no per-layer index building: the visible keys are one (B, C) mask
   per distinct (sinks, window) pair, shared by the layers). Prefill (several new tokens) goes to
   :func:`sinkflex_core.attention.sinkflex_attention_forward` (on CPU the fused kernel under the mask).
2. :func:`rolling_keep`: keys older than the window, other than the sinks, are never attended again,
   so between turns a row keeps only its first ``max_sinks`` real keys and its last ``W - 1``: the
   cache stops growing with the episode. The mask counts real keys (sinks are the first real keys of a
   row; the window is the last ``W`` real keys up to the query), and what is dropped lies between the
   sinks and the window, so every kept key keeps its sink rank and its distance to every later query.
   The rows' positions (rotary) come from the backend's own token counts, not from the cache width.

Measured with ``python benchmarks/bench_rollout.py --policy data/retail-tiny-start --runs
sinkflex-fast,sdpa-fast,sdpa-stock --threads 2`` (the rollouts of one GRPO step of the tiny-cpu preset:
8 training tasks x 8 episodes, up to 2,048 tokens each; the shipped start with the lookup stage and the
preset's 768-key window; 2 threads on 2 idle cores of an Intel Xeon, with ``--runs
sinkflex-fast-chunked,sinkflex-fast,sdpa-fast``): sink attention on this path 20.5 s (25,004 generated
tokens, 1,287 tokens an episode), stock attention on the fast path 22.4 s (25,458 tokens), and sink
attention with the prefills of new turns on the chunked kernel instead of the fused CPU kernel
(:func:`sinkflex_core.attention.sink_attention`, backend "fused", what "auto" picks here) 40.1 s
(25,332 tokens). Before the fused kernel, on 2 idle cores of an AMD EPYC, the same command gave sink
attention 31.3 s (24,196 tokens), stock attention on the fast path 19.6 s (25,369 tokens) and stock
attention on transformers' stock cache, the rollout path before the fast path, 167.0 s (25,329
tokens). A window of 768 keys is most of these episodes, so the bounded cache saves little here.
With the 256-key window the preset had before, the same command on the start shipped then gave
28.8 s against 51.3 s for stock attention on the fast path and 468.0 s on the stock cache. Earlier, on
a briefly trained policy with one thread on cores shared with other jobs (load average ~6): sink
attention 1,804 s on the stock cache against 99 s on this path; 58 of the 64 stock and fast
trajectories identical (the others drew a token at a boundary that float rounding moves).

The attention of one query ``i`` over keys ``j`` (``count`` = running count of real keys in the row):
visible iff ``j`` is real and (``count[j] <= n_sink`` or ``count[i] - count[j] < W``); out =
``softmax(scores) @ V * sigmoid(lse - s)`` with ``s`` the layer's learned sink logit per head.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..attention import IMPLEMENTATION, SinkFlexMask, sinkflex_attention_forward, sinkflex_mask
from ..attention.hf import _attention_modules, _layer_settings

ROLLOUT_SINKFLEX = "sinkflex_rollout_decode"


def _visible(mask: SinkFlexMask, n_sink: int, window: int | None) -> torch.Tensor:
    """(B, C) bool: the keys the last column's query may see, cached on the batch's mask."""
    key = ("decode", n_sink, window)
    if key not in mask._cache:
        count = mask.real_count
        if count is None:
            count = torch.arange(1, mask.kv_len + 1, device=mask.device).expand(mask.batch_size, -1)
        vis = torch.ones_like(count, dtype=torch.bool) if window is None else \
            (count <= n_sink) | (count[:, -1:] - count < window)
        if mask.key_valid is not None:
            vis = vis & mask.key_valid
        mask._cache[key] = vis
    return mask._cache[key]


def sink_decode_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                        dropout: float = 0.0, scaling: float | None = None, s_aux=None, **kwargs):
    """Attention function for one decoded token per row: query (B, H, 1, D), key/value (B, Hkv, C, D)
    -> (B, 1, H, D). Anything else (prefill, gradients, packed rows, a layer with its own sliding window)
    goes to :func:`sinkflex_core.attention.sinkflex_attention_forward`."""
    m = attention_mask
    if (query.shape[2] != 1 or torch.is_grad_enabled() or not isinstance(m, SinkFlexMask) or m.q_len != 1
            or m.document_ids is not None or m.keys_dropped or kwargs.get("sliding_window")):
        return sinkflex_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, s_aux=s_aux, **kwargs)
    n_sink, window = _layer_settings(module)
    B, H, _, d = query.shape
    h_kv = key.shape[1]
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(B, h_kv, H // h_kv, d).float()  # the query heads of one KV head, as rows
    scores = (q @ key.float().transpose(-1, -2)).mul_(scale)  # (B, Hkv, G, C)
    scores.masked_fill_(~_visible(m, n_sink, window)[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, G)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a padding query sees nothing
    out = scores.sub_(safe.unsqueeze(-1)).exp_() @ value.float()  # (B, Hkv, G, D)
    sinks = getattr(module, "sinkflex_sink_logits", None)
    if sinks is None:
        sinks = s_aux
    if sinks is not None:  # the zero-value sink: out * sigmoid(lse - s), as attention.apply_zero_value_sink
        out = out * (1.0 - torch.sigmoid(sinks.float().view(1, h_kv, -1) - lse)).unsqueeze(-1)
    return out.reshape(B, 1, H, d).to(query.dtype), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ROLLOUT_SINKFLEX, sink_decode_forward)
    AttentionMaskInterface.register(ROLLOUT_SINKFLEX, sinkflex_mask)


@contextlib.contextmanager
def sink_decode(model):
    """Run ``model`` with :func:`sink_decode_forward` while in the block, if it is on sink attention
    (else unchanged); its own setting is put back on the way out."""
    config = model.config
    stock = getattr(config, "_attn_implementation", None)
    if stock != IMPLEMENTATION:
        yield
        return
    _register()
    config._attn_implementation = ROLLOUT_SINKFLEX
    try:
        yield
    finally:
        config._attn_implementation = stock


def rolling_keep(model) -> tuple[int, int] | None:
    """``(sinks, recent)``: how many first and last real keys of a row a sink-attention ``model`` can
    still attend to from any later query (the most sinks and the widest window - 1 of any layer); None when
    every key stays visible (not on sink attention, or a layer without a window)."""
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION:
        return None
    settings = [_layer_settings(m) for m in _attention_modules(model)]
    if any(w is None for _, w in settings):
        return None
    return max(n for n, _ in settings), max(w for _, w in settings) - 1
