"""The records of rollouts: how to play a batch of episodes (:class:`RolloutConfig`), one episode's
tokens, masks and log-probs (:class:`Trajectory`), and a batch of them as padded (B, L) tensors or
packed into rows (:class:`RolloutBatch`, :class:`PackedRollouts`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ENDED_BY = ("env", "max_turns", "max_total_tokens", "max_turn_tokens")


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
            # the environments' reset and every episode's sampling seed derive from it (None included)
            (isinstance(self.seed, numbers.Integral) and self.seed >= 0, "seed must be an int >= 0"),
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
    ``(row, start, length)`` of trajectory i.

    A transformers model given the 2-D ``attention_mask`` (or none) attends across the trajectories
    of a row; give it :meth:`attention_mask_4d` with the ``position_ids``."""

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

    def attention_mask_4d(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The packed-document causal mask as an additive (R, 1, T, T) tensor of ``dtype`` (0 where a
        query sees a key: the same trajectory, not later; the dtype's lowest value elsewhere), the form a
        transformers model takes with any attention implementation. It holds R x T x T values (64 MiB
        a row of 4,096 tokens in float32); padding queries see the padding before them."""
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point type, got {dtype}")
        T = self.doc_ids.shape[1]
        causal = torch.ones((T, T), dtype=torch.bool).tril()
        seen = (self.doc_ids[:, :, None] == self.doc_ids[:, None, :]) & causal
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
        return mask[:, None]


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

