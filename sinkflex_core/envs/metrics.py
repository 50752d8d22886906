"""pass^k, the chance that k independent tries at a task all succeed, and pass@k, the chance that at
least one of them does."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from numbers import Integral

import numpy as np


def pass_hat_k(successes_per_task: Sequence, k: int) -> float:
    """Mean over tasks of C(c, k) / C(n, k), with n tries and c successes per task.

    ``successes_per_task`` is either a list of per-task outcome lists (``[[True, False, ...], ...]``)
    or a list of ``(c, n)`` pairs. Every task needs at least ``k`` tries.
    """
    _check_k(successes_per_task, k)
    return sum(comb(c, k) / comb(n, k) for c, n in _counts(successes_per_task, k)) / len(successes_per_task)


def pass_at_k(successes_per_task: Sequence, k: int) -> float:
    """Mean over tasks of 1 - C(n - c, k) / C(n, k): the unbiased estimate, from n tries with c
    successes, of the chance that at least one of k tries succeeds. Same input as :func:`pass_hat_k`.

    The share of tasks a policy solves at least sometimes: what sharpening its sampling distribution
    (as reinforcement learning on its own samples mostly does) can raise its mean reward towards."""
    _check_k(successes_per_task, k)
    return sum(1 - comb(n - c, k) / comb(n, k) for c, n in _counts(successes_per_task, k)) / len(successes_per_task)


def _check_k(successes_per_task: Sequence, k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if len(successes_per_task) == 0:
        raise ValueError("pass^k and pass@k need at least one task")


def _is_count(v) -> bool:
    """An integer (numpy's too) that is not a bool: ``(c, n)`` pairs are counts, bools are outcomes."""
    return isinstance(v, Integral) and not isinstance(v, bool | np.bool_)


def _counts(successes_per_task: Sequence, k: int) -> list[tuple[int, int]]:
    """(c, n) per task, checked: 0 <= c <= n and n >= k."""
    out = []
    for i, entry in enumerate(successes_per_task):
        if isinstance(entry, tuple) and len(entry) == 2 and all(_is_count(v) for v in entry):
            c, n = int(entry[0]), int(entry[1])
        else:
            outcomes = [bool(v) for v in entry]
            c, n = sum(outcomes), len(outcomes)
        if not 0 <= c <= n:
            raise ValueError(f"task {i}: successes {c} not in [0, {n}]")
        if n < k:
            raise ValueError(f"task {i} has {n} tries, fewer than k={k}")
        out.append((c, n))
    return out
