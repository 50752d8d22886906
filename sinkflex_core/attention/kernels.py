"""The attention computed with a :class:`~sinkflex_core.attention.masks.SinkFlexMask`: the learnable
zero-value sink (``out * sigmoid(lse - s)``), FlexAttention (block-sparse, compiled on CUDA), PyTorch's
fused CPU attention kernel under an additive mask, a block of queries at a time against only the keys
the block can see (the sink logits' gradient added by hand), an exact chunked path in plain PyTorch
(queries in chunks against only the keys they can see, a custom backward that recomputes each chunk),
and a float64 dense reference; :func:`sink_attention` picks."""

from __future__ import annotations

import torch
from torch import Tensor

from torch.nn.attention.flex_attention import (  # isort: skip
    AuxRequest,
    flex_attention,
)

from .masks import SinkFlexMask, _check_count

DEFAULT_CHUNK = 256
# "auto" on CPU runs the fused kernel while the batch's mask (batch x queries x keys, were it dense) stays
# under this many entries, and the chunked path otherwise. The fused kernel runs DEFAULT_CHUNK queries at
# a time against the keys those can see (the sinks and the window range), under each block's additive
# mask; in a causal windowed batch all blocks together hold about B x Lq x (window + chunk + sinks) mask
# entries (more where padding offsets the rows' windows from each other), and a dense one never exists.
# Measured fwd+bwd on a 2-core AMD EPYC (one thread; 4 query and 2 key-value heads of 32 dims, 4 sinks and
# a 768-key window, float32): the fused kernel in blocks took 0.49x the chunked path's time at 8 x 1,024
# tokens, 0.57x at 4 x 2,048, 0.58x at 2 x 4,096 and 0.56x at 1 x 8,192; the same kernel in one call under
# the whole mask (how it ran before its blocks) 0.84x, 1.30x, 2.40x and 4.38x (docs/experiments.md).
DENSE_MASK_LIMIT = 1 << 26


def _check_sink_shape(sink_logits: Tensor, n_heads: int) -> Tensor:
    if sink_logits.shape != (n_heads,):
        raise ValueError(f"sink_logits must have shape ({n_heads},) (one per query head), got "
                         f"{tuple(sink_logits.shape)}")
    return sink_logits


def apply_zero_value_sink(out: Tensor, lse: Tensor, sink_logits: Tensor | None) -> Tensor:
    """``out * sigmoid(lse - s)`` in float32.

    out (B, H, L, D), lse (B, H, L) (natural log), sink_logits (H,). Returns out's dtype.
    """
    if sink_logits is None:
        return out
    _check_sink_shape(sink_logits, out.shape[1])
    lse = lse.float()
    # a row that sees no key (a padding query: lse = -inf) has output 0 whatever its gate; a finite
    # stand-in keeps a sink logit of -inf from making that 0 * sigmoid(-inf + inf) = NaN, which the
    # next layer would spread to the real tokens (0 * NaN in probabilities @ values)
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    # 1 - sigmoid(s - lse) is sigmoid(lse - s) written so that its gradient survives in float32 at a
    # very negative initial s (sigmoid(lse - s) would round to exactly 1 and pass a zero gradient)
    gate = 1.0 - torch.sigmoid(sink_logits.float().view(1, -1, 1) - lse)
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


# --------------------------------------------------------------------------------------------------
# PyTorch's fused CPU kernel under an additive mask, in blocks of queries
# --------------------------------------------------------------------------------------------------
def _fused_cpu(q, k, v, attn_mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=attn_mask,
                                                                      scale=scale)


def _fused_cpu_backward(d_out, q, k, v, out, lse, attn_mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, False, attn_mask=attn_mask, scale=scale)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_groups(dx: Tensor, groups: int) -> Tensor:
    """(B, Hkv * G, L, D) -> (B, Hkv, L, D): the gradient of a repeated key or value, summed over its group."""
    if groups == 1:
        return dx
    b, h, n, d = dx.shape
    return dx.view(b, h // groups, groups, n, d).sum(2)


class _FusedCPUAttention(torch.autograd.Function):
    """(out with the zero-value sink, lse before it) from PyTorch's fused CPU kernel under an additive
    mask, one block of queries at a time against only the keys that block can see (:func:`_fused_blocks`).
    The kernel knows no sink: the forward gates its output by ``sigmoid(lse - s)``; the backward hands the
    kernel the gated output and the log-sum-exp *with* the sink, so that the probabilities it recomputes
    are the sink softmax's (its gradients of q, k and v are then exact), and adds the sink logits' own
    gradient, ``-sum_i p_sink,i (dO_i . O_i)``. The returned lse carries no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sink_logits, blocks, has_key, scale: float):
        g = q.shape[1] // k.shape[1]
        kk, vv = _repeat_kv(k, g), _repeat_kv(v, g)
        out = q.new_empty(q.shape[:3] + (v.shape[-1],))
        lse = None
        for q0, q1, keys, additive in blocks:
            o, l_ = _fused_cpu(q[:, :, q0:q1].contiguous(), _select_keys(kk, keys), _select_keys(vv, keys), additive, scale)
            if lse is None:
                lse = l_.new_empty(q.shape[:3])
            out[:, :, q0:q1] = o
            lse[:, :, q0:q1] = l_
        lse_dtype = lse.dtype
        # the kernel gives a row without any visible key lse 0 and output 0; here such a row has lse -inf
        lse = lse.float().masked_fill(~has_key, float("-inf"))
        out = apply_zero_value_sink(out, lse, sink_logits)
        lse_all = lse
        if sink_logits is not None:
            lse_all = torch.logaddexp(lse, sink_logits.float().view(1, -1, 1).expand_as(lse))
        # the backward recomputes exp(score - lse): any finite value serves a row whose scores are all -inf
        lse_all = lse_all.masked_fill(~has_key, 0.0).to(lse_dtype).contiguous()
        ctx.save_for_backward(q, kk, vv, out, lse_all, sink_logits)
        ctx.blocks, ctx.scale, ctx.groups = blocks, scale, g
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, kk, vv, out, lse_all, sink_logits = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
        for q0, q1, keys, additive in ctx.blocks:
            rows = slice(q0, q1)
            dqb, dkb, dvb = _fused_cpu_backward(
                d_out[:, :, rows].contiguous(), q[:, :, rows].contiguous(), _select_keys(kk, keys),
                _select_keys(vv, keys), out[:, :, rows].contiguous(), lse_all[:, :, rows].contiguous(), additive,
                ctx.scale)
            dq[:, :, rows] = dqb
            if isinstance(keys, slice):
                dk[:, :, keys] += dkb
                dv[:, :, keys] += dvb
            else:
                dk.index_add_(2, keys, dkb)
                dv.index_add_(2, keys, dvb)
        d_sink = None
        if sink_logits is not None and ctx.needs_input_grad[3]:
            # a row without keys has output 0, so it adds nothing whatever its lse placeholder
            p_sink = torch.exp(sink_logits.float().view(1, -1, 1) - lse_all.float())
            d_sink = -(p_sink * (d_out.float() * out.float()).sum(-1)).sum((0, 2)).to(sink_logits.dtype)
        return dq, _fold_groups(dk, ctx.groups), _fold_groups(dv, ctx.groups), d_sink, None, None, None


def _select_keys(x: Tensor, keys) -> Tensor:
    """The keys (or values) of one query block: a slice of the length dimension, or an index tensor."""
    return (x[:, :, keys] if isinstance(keys, slice) else x.index_select(2, keys)).contiguous()


def _fused_blocks(mask: SinkFlexMask, n_sink: int, window: int | None, dtype: torch.dtype, block: int):
    """The fused path's plan: for each block of ``block`` queries, ``(q0, q1, keys, additive)`` with
    ``keys`` the key columns any of its rows can see (a slice when they are contiguous, else an index
    tensor: a window range plus sink tokens before it) and ``additive`` (B, 1, q1 - q0, len(keys)), 0
    where a key is visible and -inf elsewhere; and (B, 1, Lq) whether a row sees any key. Built once per
    batch and shared by every layer with the same sinks and window. Blocks skip the keys a causal,
    windowed row never sees, which the kernel under one dense mask would compute and discard."""
    key = ("fused_blocks", n_sink, window, dtype, block)
    if key not in mask._cache:
        dev = mask.device
        mod = mask.mask_mod(n_sink, window)
        b = torch.arange(mask.batch_size, device=dev)[:, None, None]
        kv = torch.arange(mask.kv_len, device=dev)[None, None, :]
        head = torch.zeros((), dtype=torch.long, device=dev)
        blocks, has_key = [], []
        for q0 in range(0, mask.q_len, block):
            q1 = min(q0 + block, mask.q_len)
            # (B, q1 - q0, kv_len): this block's rows of the dense mask, never the whole L x L
            vis = mod(b, head, torch.arange(q0, q1, device=dev)[None, :, None], kv)
            vis = vis.expand(mask.batch_size, q1 - q0, mask.kv_len)
            has_key.append(vis.any(-1))
            cols = vis.any(1).any(0).nonzero().flatten()
            if len(cols) == 0:  # no row of the block sees a key: one key, masked, keeps the kernel's shapes
                cols = torch.zeros(1, dtype=torch.long, device=dev)
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            keys = slice(lo, hi) if hi - lo == len(cols) else cols
            seen = vis[:, :, keys] if isinstance(keys, slice) else vis.index_select(2, keys)
            additive = torch.zeros(seen.shape, dtype=dtype, device=dev).masked_fill_(~seen, float("-inf"))
            blocks.append((q0, q1, keys, additive.unsqueeze(1)))
        mask._cache[key] = (blocks, torch.cat(has_key, 1).unsqueeze(1))
    return mask._cache[key]


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


def _checked_arguments(q: Tensor, k: Tensor, v: Tensor, mask: SinkFlexMask | None, n_sink, window, scale):
    """The arguments every kernel shares, checked and completed: the causal mask by default, whole
    counts, and the 1/sqrt(D) scale by default. Returns ``(mask, n_sink, window, scale)``."""
    if mask is None:
        mask = SinkFlexMask.causal(q.shape[0], q.shape[2], k.shape[2], device=q.device)
    _check_inputs(q, k, v, mask)
    n_sink = _check_count("n_sink", n_sink, 0)
    window = None if window is None else _check_count("window", window, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return mask, n_sink, window, scale


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

    backend: "flex" (FlexAttention; forward only on CPU), "fused" (PyTorch's fused CPU attention
    kernel under an additive mask, ``chunk_size`` queries at a time against only the keys they can see:
    the sinks and the window range; CPU only, and its lse carries no gradient),
    "chunked" (exact pure PyTorch, memory linear in the length) or "auto": flex on CUDA; on CPU fused
    while ``B x Lq x Lk`` is at most ``DENSE_MASK_LIMIT`` and no gradient is asked of the lse, chunked
    otherwise.
    Returns out (B, H, Lq, D) in q's dtype, and the log-sum-exp (B, H, Lq) float32 of the visible
    scores (before the sink) when ``return_lse``.
    """
    mask, n_sink, window, scale = _checked_arguments(q, k, v, mask, n_sink, window, scale)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sink_logits))
    if backend == "auto":
        if q.device.type == "cuda":
            backend = "flex"
        elif (q.device.type == "cpu" and mask.batch_size * mask.q_len * mask.kv_len <= DENSE_MASK_LIMIT
              and not (return_lse and needs_grad)):
            backend = "fused"
        else:
            backend = "chunked"
    if backend == "flex":
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
    elif backend == "fused":
        if q.device.type != "cpu":
            raise ValueError(f"backend='fused' runs on CPU only, got {q.device.type} tensors; use 'auto'")
        if return_lse and needs_grad:
            raise ValueError("backend='fused' returns an lse without gradient; use backend='chunked' to "
                             "differentiate through the lse")
        chunk_size = _check_count("chunk_size", chunk_size, 1)
        blocks, has_key = _fused_blocks(mask, n_sink, window, q.dtype, chunk_size)
        sinks = None if sink_logits is None else _check_sink_shape(sink_logits, q.shape[1])
        out, lse = _FusedCPUAttention.apply(q, k, v, sinks, blocks, has_key, scale)
        return (out, lse) if return_lse else out
    elif backend == "chunked":
        chunk_size = _check_count("chunk_size", chunk_size, 1)
        out, lse = _ChunkedAttention.apply(q, k, v, _ChunkPlan(mask, n_sink, window, chunk_size), scale)
    else:
        raise ValueError(f"backend must be 'auto', 'flex', 'fused' or 'chunked', got {backend!r}")
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
    mask, n_sink, window, scale = _checked_arguments(q, k, v, mask, n_sink, window, scale)
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


