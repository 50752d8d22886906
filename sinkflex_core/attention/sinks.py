"""Per-layer sink estimation: how much attention mass each layer puts on the first keys of a
calibration batch (:func:`early_key_mass`), the sink count that covers it (:func:`estimate_layer_sinks`),
saved beside a model (``sinkflex_sinks.json``) for :func:`~sinkflex_core.attention.apply`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from .hf import SINKS_FILENAME, _attention_modules, _is_count, _json_object, _set_implementation, register
from .kernels import DEFAULT_CHUNK, sink_attention

PROBE_IMPLEMENTATION = "sinkflex_probe"


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
    counts = _json_object(path).get("n_sink")
    if not isinstance(counts, list) or not all(_is_count(x) for x in counts):
        raise ValueError(f"{path} has no valid 'n_sink' list of non-negative integers")
    return list(counts)


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
