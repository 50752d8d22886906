"""The generation interface every backend implements (:class:`GenerationBackend`: requests in,
generated ids and their sampling log-probs out), and the sampling rule they share."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class GenerationRequest:
    """Continue ``prompt_ids`` (the whole trajectory so far) for one episode, identified by ``key``
    (a backend may keep per-episode state, e.g. a KV cache, under it). ``messages`` (the conversation
    so far) and ``tools`` (the environment's tool schemas) serve backends that are not language
    models, such as :class:`AgentBackend`."""

    key: Hashable
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    messages: list[dict] | None = None
    tools: list[dict] | None = None


@dataclass
class GenerationResult:
    """Generated ids (ending with a stop id when ``stopped``) and their sampling log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


class GenerationBackend(Protocol):
    """What :func:`collect_rollouts` needs from a generator."""

    stop_token_ids: set[int]

    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]: ...

    def release(self) -> None:
        """Forget per-episode state (caches)."""


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability reaches ``top_p``. (B, V)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p (the top one always stays).
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits (B, V) float -> (tokens (B,), sampling log-probs (B,)).

    Each row draws one uniform number from its own generator, so that a row's sample does not depend on
    the others, and takes the token where that number falls in the row's cumulative distribution
    (inverse-CDF sampling: one vectorised search for the whole batch instead of a ``torch.multinomial``
    call per row). A token of probability 0 is never drawn."""
    # Refused here, where every backend's sampling passes: a negative temperature inverts the
    # distribution and top_p <= 0 leaves no token, and both would sample on with wrong or NaN log-probs.
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = logits.log_softmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = _top_p_filter(logits / temperature, top_p).log_softmax(dim=-1)
    probs = logp.exp()
    cdf = probs.double().cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to the total itself: then the last token that has any probability.
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    tokens = torch.minimum(tokens, last)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


# --------------------------------------------------------------------------------------------------
# Generation internals of HFBackend: a KV cache that grows in place, and GQA attention without
# expanding the cache
# --------------------------------------------------------------------------------------------------
