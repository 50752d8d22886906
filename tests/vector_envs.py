"""Check that a Gymnasium vector env runs, worker for worker, what single envs run."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


def assert_workers_replay_single_envs(env_id: str, num_envs: int, action: str, steps: int = 3) -> tuple:
    """Worker i of ``gym.make_vec(env_id, num_envs, "async")`` reset with seed 0 is seeded 0 + i: its
    first observation, task and ``steps`` answers to ``action`` must be those of a single env reset with
    seed i. Returns the workers' last observations."""
    expected = []
    for i in range(num_envs):
        single = gym.make(env_id, split="test")
        try:
            first, single_info = single.reset(seed=i)
            expected.append((first, single_info["task_index"], [single.step(action)[:2] for _ in range(steps)]))
        finally:
            single.close()
    assert len({e[1] for e in expected}) > 1  # the seeds pick different tasks: the comparison is not vacuous
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="async", split="test")
    try:
        obs, info = envs.reset(seed=0)
        assert isinstance(obs, tuple) and list(obs) == [e[0] for e in expected]
        assert list(info["task_index"]) == [e[1] for e in expected]
        for t in range(steps):
            obs, rewards, terminated, truncated, info = envs.step((action,) * num_envs)
            assert isinstance(rewards, np.ndarray) and rewards.shape == (num_envs,)
            assert [(o, float(r)) for o, r in zip(obs, rewards)] == [e[2][t] for e in expected], t
    finally:
        envs.close()
    return obs
