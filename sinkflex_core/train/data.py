"""What one step trains on: which tasks, in which order (a seeded sampler whose state is two
integers), and the rollout batches of a step as one dict of (B, L) tensors."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from .config import ConfigError


def count_tasks(env_id: str, split: str) -> int:
    """How many tasks ``split`` of environment ``env_id`` has."""
    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)

    try:
        env = gym.make(env_id, split=split)
    except (gym.error.Error, ValueError) as err:  # ValueError: a split the environment does not have
        raise ConfigError(f"cannot make environment {env_id!r} (split {split!r}): {err}") from None
    try:
        return int(env.unwrapped.num_tasks)
    finally:
        env.close()


class TaskSampler:
    """Tasks in a fresh random order every epoch (seeded), ``batch`` at a time.

    The state is two integers (epoch, cursor): the order of epoch e is a pure function of
    (seed, e), so a resumed run draws exactly the tasks the uninterrupted run would have."""

    def __init__(self, num_tasks: int, batch: int, seed: int):
        if num_tasks < 1:
            raise ValueError("the training split has no task")
        self.num_tasks, self.batch, self.seed = num_tasks, batch, seed
        self.epoch, self.cursor = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(self.num_tasks)

    def next_batch(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch:
            order = self._order(self.epoch)
            take = min(self.batch - len(out), self.num_tasks - self.cursor)
            out.extend(int(i) for i in order[self.cursor:self.cursor + take])
            self.cursor += take
            if self.cursor >= self.num_tasks:
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_tasks": self.num_tasks, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_tasks"] != self.num_tasks or state["seed"] != self.seed:
            raise ValueError(f"checkpoint's task sampler ({state['num_tasks']} tasks, seed {state['seed']}) "
                             f"does not match this run ({self.num_tasks} tasks, seed {self.seed})")
        self.epoch, self.cursor = state["epoch"], state["cursor"]



def derive_seed(*parts) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (run seed, step, chunk, ...)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)



_BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "position_ids")


def _pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    return nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def concat_rollouts(batches: list, pad_id: int) -> dict[str, Any]:
    """Rollout batches of different widths as one dict of (B, L) tensors (padded on the right) plus
    ``rewards`` (B,), ``group_ids`` (B,) (renumbered so groups of different batches stay apart) and
    ``stats`` (list of B dicts)."""
    width = max(int(b.input_ids.shape[1]) for b in batches)
    out: dict[str, Any] = {}
    for key in _BATCH_KEYS:
        fill = pad_id if key == "input_ids" else 0
        out[key] = torch.cat([_pad_right(getattr(b, key), width, fill) for b in batches])
    out["rewards"] = torch.cat([torch.as_tensor(b.rewards, dtype=torch.float32) for b in batches])
    gids, offset = [], 0
    for b in batches:
        _, inv = torch.unique(torch.as_tensor(b.group_ids), return_inverse=True)
        gids.append(inv + offset)
        offset += int(inv.max()) + 1 if inv.numel() else 0
    out["group_ids"] = torch.cat(gids)
    out["stats"] = [s for b in batches for s in (b.stats or [{}] * len(b.rewards))]
    return out


def trim_rows(rows: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of the (B, L) tensors, without the columns that are padding in all of them."""
    sub = {k: rows[k][idx] for k in _BATCH_KEYS}
    cols = sub["attention_mask"].bool().any(0).nonzero()
    if cols.numel():
        lo, hi = int(cols.min()), int(cols.max()) + 1
        sub = {k: v[:, lo:hi] for k, v in sub.items()}
    return sub


def position_in_group(group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) index of each trajectory within its group (0, 1, ... in batch order)."""
    out = torch.zeros_like(group_ids)
    seen: dict[int, int] = {}
    for i, g in enumerate(group_ids.tolist()):
        out[i] = seen.get(g, 0)
        seen[g] = out[i].item() + 1
    return out


# --------------------------------------------------------------------------------------------------
# The trainer
