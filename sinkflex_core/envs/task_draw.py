"""How the customer-service worlds (the retail store, the airline) draw their task splits: the same
sizes, the same user split and the same way of drawing one user's one or two requests."""

from __future__ import annotations

import random

SPLITS = ("train", "test", "synthetic")
N_TRAIN_TASKS = 600
N_TEST_TASKS = 120
N_SYNTHETIC_TASKS = 10_000
N_TEST_USERS = 100


def split_draw(world, split: str, n_tasks: int | None, name: str) -> tuple[int, list[str], random.Random]:
    """``(number of tasks, the split's user ids, the split's task rng)`` for a world named ``name``.

    The users are shuffled once per world seed and cut in two, so that ``"test"`` never shares a user
    with ``"train"`` or ``"synthetic"``; each split has its own task stream."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    n_tasks = n_tasks or {"train": N_TRAIN_TASKS, "test": N_TEST_TASKS, "synthetic": N_SYNTHETIC_TASKS}[split]
    users = sorted(world.users)
    random.Random(f"{name}-users-{world.seed}").shuffle(users)
    pool = users[:N_TEST_USERS] if split == "test" else users[N_TEST_USERS:]
    return n_tasks, pool, random.Random(f"{name}-tasks-{world.seed}-{split}")


def draw_requests(gen, rng: random.Random, kind_weights: dict[str, float], user: dict, state: dict,
                  id_key: str) -> list[dict]:
    """One user's requests (one, or two 30% of the time), each of a kind drawn by ``kind_weights``;
    ``gen.request`` returns None for a kind that does not fit the user, and no two requests touch
    the same record (``id_key``). May return fewer requests than drawn, or none."""
    kinds, weights = list(kind_weights), list(kind_weights.values())
    n_req = 2 if rng.random() < 0.3 else 1
    used: set = set()
    requests = []
    for _ in range(n_req * 4):
        req = gen.request(rng.choices(kinds, weights=weights)[0], user, used, state)
        if req is None:
            continue
        if req.get(id_key):
            used.add(req[id_key])
        for key in ("outputs", "confirm_keys", "answer_keys"):
            req.setdefault(key, [])
        requests.append(req)
        if len(requests) == n_req:
            break
    return requests
