"""The fast path of :class:`sinkflex_core.rollout.hf.HFBackend`: three tricks that make batched,
multi-turn decoding with a transformers model several times faster on a CPU, kept apart from the
backend so that the backend reads as plain generation.

Why: decoding is memory-bound on the KV cache, and transformers' stock path touches the whole cache
more often than it must. Each trick leaves the attention unchanged (within float rounding):

1. :func:`growing_cache`: a ``DynamicCache`` whose layers write new keys/values into preallocated room
   instead of ``torch.cat`` (which copies the whole layer cache at every decoded token). It subclasses
   transformers' ``DynamicLayer``, an internal class: a transformers upgrade may need this module
   updated, and ``HFBackend(fast_path=False)`` is the stock path to compare against.
2. :func:`grouped_sdpa`: while the model runs, its attention implementation is switched from ``"sdpa"``
   to :func:`grouped_sdpa_forward`, registered with transformers, which runs grouped-query attention
   without expanding the cache to every query head (``repeat_kv`` copies the cache per layer and per
   decoded token); the model's own setting is put back afterwards.
3. Cache rows moved between turns (:func:`compact_rows`) and inside a turn (:func:`park_rows`,
   :func:`unpark_rows`): each turn starts from a cache whose rows hold their real tokens first, as wide
   as the longest row, and rows that stopped early are set aside until the turn ends, so that the
   others do not decode (and grow the cache) for their padding.

The cache is a transformers ``Cache`` with ``layers`` that have ``keys`` and ``values`` (B, H_kv, C, d);
``mask`` is the backend's (B, C) record of which columns hold real tokens.
"""

from __future__ import annotations

import contextlib
import functools

import torch

ROLLOUT_SDPA = "sinkflex_rollout_sdpa"


def grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention, for inference with grouped-query attention, without copying the cache.

    The stock path expands every KV head to its ``n_rep`` query heads (``repeat_kv``), a copy of the
    whole cache per layer and per decoded token. Here the ``n_rep`` query heads that share a KV head
    are stacked along the query axis instead ((B, H, q, d) -> (B, H_kv, n_rep * q, d), a view) and the
    mask is repeated to match; each query row still sees exactly its own keys and mask row, so the
    result is the same attention. Falls back to the stock function where this does not apply (no GQA,
    a causal prefill without a mask, dropout, a per-head mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, q, d = query.shape
    h_kv = key.shape[1]
    rep = H // h_kv
    if (rep == 1 or H != rep * h_kv or (attention_mask is None and q > 1) or dropout or torch.is_grad_enabled()
            or kwargs.get("position_bias") is not None
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
        if q > 1:  # stacked row r * q + t is query t of head r of the group
            mask = mask.repeat(1, 1, rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, h_kv, rep * q, d), key, value,
                                                           attn_mask=mask, scale=scaling)
    return out.view(B, H, q, d).transpose(1, 2).contiguous(), None


@functools.cache
def _register_rollout_attention() -> None:
    """Register :func:`grouped_sdpa_forward` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ROLLOUT_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(ROLLOUT_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def growing_cache(config):
    """A ``DynamicCache`` whose full-attention layers write new keys/values into preallocated room
    instead of concatenating (``torch.cat`` copies the whole layer cache at every decoded token)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """Keys/values are views of buffers with spare columns, grown by half when full. The buffers
        are re-adopted when something outside (the row moves below) assigns ``keys``."""

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, add = self.get_seq_length(), key_states.shape[-2]
            adopted = self._kbuf is not None and self.keys.data_ptr() == self._kbuf.data_ptr() \
                and self.keys.shape[0] == self._kbuf.shape[0]
            if not adopted or n + add > self._kbuf.shape[-2]:
                room = max(n + add + 64, int(1.5 * (n + add)))
                B, h, _, d = key_states.shape
                kbuf = key_states.new_empty((B, h, room, d))
                vbuf = value_states.new_empty((B, h, room, value_states.shape[-1]))
                if n:
                    kbuf[:, :, :n] = self.keys
                    vbuf[:, :, :n] = self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[:, :, n:n + add] = key_states
            self._vbuf[:, :, n:n + add] = value_states
            self.keys, self.values = self._kbuf[:, :, :n + add], self._vbuf[:, :, :n + add]
            return self.keys, self.values

    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache



@contextlib.contextmanager
def grouped_sdpa(model):
    """Run ``model`` with :func:`grouped_sdpa_forward` for its attention while in the block, if it is
    on transformers' ``"sdpa"`` (else unchanged); its own setting is restored on the way out."""
    config = model.config
    stock = getattr(config, "_attn_implementation", None)
    if stock != "sdpa":
        yield
        return
    _register_rollout_attention()
    config._attn_implementation = ROLLOUT_SDPA
    try:
        yield
    finally:
        config._attn_implementation = stock


def compact_rows(cache, mask: torch.Tensor, idx: torch.Tensor, keep: tuple[int, int] | None = None) -> torch.Tensor:
    """Keep the cache rows ``idx`` (in that order), each row's real columns moved to the front in
    order, the cache cut to the longest row; returns the new (len(idx), width) mask. Keys carry their
    rotary positions already and attention does not depend on where a key sits, so the rows attend as
    before, without the padding columns that rows that stopped early, and prefills shorter than the
    longest, left in the middle. ``keep=(sinks, recent)`` (sink attention,
    :func:`sinkflex_core.rollout.sink_decode.rolling_keep`): of each row's real columns only the first
    ``sinks`` and the last ``recent`` stay, the only ones a later query can see."""
    mask = mask[idx]
    real = mask.bool()
    if keep is not None:
        rank = real.long().cumsum(dim=1)  # 1-based rank of each real column in its row
        total = rank[:, -1:]
        real = real & ((rank <= keep[0]) | (rank > total - keep[1]))
    counts = real.sum(dim=1)
    width = int(counts.max())
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices[:, :width]
    at = order[:, None, :, None]
    for layer in cache.layers:
        layer.keys = layer.keys[idx].gather(2, at.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values[idx].gather(2, at.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
    return (torch.arange(width, device=mask.device) < counts[:, None]).to(mask.dtype)


def park_rows(cache, mask: torch.Tensor, positions: list[int], rows: list[int]):
    """Take the cache rows at ``positions`` out of the batch. Returns ``(parked, mask)``: the parked
    part (their requests, per-layer keys and values, mask) for :func:`unpark_rows`, and the mask of
    the rows left."""
    dev = mask.device
    drop = torch.tensor(positions, device=dev)
    gone = set(positions)
    keep = torch.tensor([j for j in range(len(rows)) if j not in gone], device=dev)
    saved = []
    for layer in cache.layers:
        saved.append((layer.keys[drop], layer.values[drop]))
        layer.keys, layer.values = layer.keys[keep], layer.values[keep]
    return ([rows[j] for j in positions], saved, mask[drop]), mask[keep]


def unpark_rows(cache, mask: torch.Tensor, parked: list, rows: list[int]) -> torch.Tensor:
    """Put parked parts back beside the ``rows`` still in the batch, the cache in request order, every
    part padded (masked columns) to the widest; returns the mask of the whole batch."""
    current = (rows, [(layer.keys, layer.values) for layer in cache.layers], mask)
    parts = [current, *parked]
    width = max(m.shape[1] for _, _, m in parts)
    order = torch.tensor([i for r, _, _ in parts for i in r], device=mask.device)
    back = torch.argsort(order)
    pad = torch.nn.functional.pad  # zeros on the right of the column axis
    for n, layer in enumerate(cache.layers):
        layer.keys = torch.cat([pad(kv[n][0], (0, 0, 0, width - m.shape[1])) for _, kv, m in parts])[back]
        layer.values = torch.cat([pad(kv[n][1], (0, 0, 0, width - m.shape[1])) for _, kv, m in parts])[back]
    return torch.cat([pad(m, (0, width - m.shape[1])) for _, _, m in parts])[back]
