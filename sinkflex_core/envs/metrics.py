"""pass^k: the chance that k independent tries at a task all succeed."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_hat_k(successes_per_task: Sequence, k: int) -> float:
    """Mean over tasks of C(c, k) / C(n, k), with n tries and c successes per task.

    ``successes_per_task`` is either a list of per-task outcome lists (``[[True, False, ...], ...]``)
    or a list of ``(c, n)`` pairs. Every task needs at least ``k`` tries.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if len(successes_per_task) == 0:
        raise ValueError("pass_hat_k needs at least one task")
    total = 0.0
    for i, entry in enumerate(successes_per_task):
        if isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(v, int) for v in entry):
            c, n = entry
        else:
            outcomes = [bool(v) for v in entry]
            c, n = sum(outcomes), len(outcomes)
        if not 0 <= c <= n:
            raise ValueError(f"task {i}: successes {c} not in [0, {n}]")
        if n < k:
            raise ValueError(f"task {i} has {n} tries, fewer than k={k}")
        total += comb(c, k) / comb(n, k)
    return total / len(successes_per_task)
