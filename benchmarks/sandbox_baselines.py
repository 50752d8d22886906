"""Baselines of the executing environments: the expert, a random agent and a do-nothing agent on
every test task of ``sinkflex/Bash-v0`` and ``sinkflex/CodeRepair-v0``.

    python benchmarks/sandbox_baselines.py --out data/sandbox_baselines.csv

One row per (environment, agent): mean final reward (verifier mixed with the default formatting judge,
weight 0.1), mean verifier reward, the share of tasks solved (verifier = 1) and the mean judge score,
with provenance columns.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data/sandbox_baselines.csv")
    p.add_argument("--tasks", type=int, default=0, help="first N test tasks (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)
    from sinkflex_core.envs.bash_env import BashExpert
    from sinkflex_core.envs.code_repair import CodeRepairExpert
    from sinkflex_core.envs.oracle import DoNothingAgent, RandomAgent, run_episode
    from sinkflex_core.envs.sandbox import jail_available
    from sinkflex_core.provenance import provenance

    ok, why = jail_available()
    if not ok:
        raise SystemExit(f"the namespace jail does not work here ({why}); baselines are recorded jailed only")
    envs = {env_id: gym.make(env_id, split="test") for env_id in ("sinkflex/Bash-v0", "sinkflex/CodeRepair-v0")}
    # checked before any episode: a task past the end failed after every one before it had been played
    fewest = min(env.unwrapped.num_tasks for env in envs.values())
    if not 0 <= args.tasks <= fewest:
        for env in envs.values():
            env.close()
        p.error(f"--tasks must be in 0..{fewest} (0: all), got {args.tasks}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # not a missing folder after all the episodes
    prov = provenance(seed=args.seed, sandbox="namespaces")
    rows = []
    for env_id, expert in (("sinkflex/Bash-v0", BashExpert), ("sinkflex/CodeRepair-v0", CodeRepairExpert)):
        env = envs[env_id]
        n = args.tasks or env.unwrapped.num_tasks
        for name, make in (("expert", expert), ("random", lambda: RandomAgent(args.seed)),
                           ("do_nothing", DoNothingAgent)):
            start = time.perf_counter()
            rewards, verifier, judge = [], [], []
            for i in range(n):
                _, reward, info = run_episode(env, make(), i, seed=args.seed)
                rewards.append(reward)
                verifier.append(info["reward_info"]["verifier"])
                judge.append(info["reward_info"]["judge"])
            row = {"env": env_id, "agent": name, "split": "test", "tasks": n,
                   "mean_reward": round(sum(rewards) / n, 4), "mean_verifier": round(sum(verifier) / n, 4),
                   "solved": round(sum(v == 1.0 for v in verifier) / n, 4), "mean_judge": round(sum(judge) / n, 4),
                   "judge": "format", "judge_weight": info["reward_info"]["judge_weight"],
                   "seconds": round(time.perf_counter() - start, 1), **prov}
            print(row, flush=True)
            rows.append(row)
        env.close()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
