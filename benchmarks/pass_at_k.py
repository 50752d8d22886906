"""How far can reinforcement learning on its own samples take a policy? pass@k on the test tasks.

GRPO raises the probability of what a policy already samples now and then; a task the policy never
solves in many tries gives it no signal at all. So pass@k, the share of tasks solved at least once
in k tries, tells what sharpening the policy's sampling could raise its mean reward (pass@1)
towards. This script samples ``--samples`` episodes of every one of the first ``--tasks`` tasks of
``--split`` with a saved policy (the rollout settings of the tiny-cpu GRPO preset, temperature 1),
then prints pass@k and pass^k for k = 1, 2, 4, ... and the tasks solved at least once, by the kind
of request.

    python benchmarks/pass_at_k.py --policy runs/curve/sft_identity      # 60 test tasks x 16, ~8 min on 2 cores
    python benchmarks/pass_at_k.py --policy DIR --tasks 8 --samples 4    # a quick look

``--out FILE`` writes one row per task (successes, tries, the task's write actions; the policy's weights
digest) with provenance (:func:`sinkflex_core.train.success_table`).
Written for the training split, that file is a screen for GRPO (``--set task_screen=FILE``, see
:func:`sinkflex_core.train.screened_tasks`; :func:`sinkflex_core.train.screen_or_reuse` writes it once
per policy): the run then trains only on the tasks solved sometimes.

    python benchmarks/pass_at_k.py --policy runs/curve/sft_identity --split train --tasks 600 --samples 4 \
        --out runs/screen/train_x4.csv                                    # ~20 min on 2 cores
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from sinkflex_core import train

print = functools.partial(print, flush=True)


def main(argv: list[str] | None = None) -> int:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    from sinkflex_core.envs import pass_at_k, pass_hat_k

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policy", required=True, help="a saved policy folder (model and tokenizer)")
    p.add_argument("--env-id", default="sinkflex/Retail-v0",
                   help="the environment (its tasks and reward): a retail or airline form, whose tasks name their "
                        "write actions")
    p.add_argument("--split", default="test")
    p.add_argument("--tasks", type=int, default=60, help="the first N tasks of the split")
    p.add_argument("--samples", type=int, default=16, help="episodes per task")
    p.add_argument("--tasks-per-call", type=int, default=8, help="tasks rolled out in one batched call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="", help="a CSV file for the per-task counts (with provenance)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    if args.tasks < 1 or args.samples < 1 or args.tasks_per_call < 1:
        p.error("--tasks, --samples and --tasks-per-call must be >= 1")
    # before the policy loads: a misspelt split, or more tasks than it has, failed in the rollouts (the
    # first task past the end only after every chunk of tasks before it was played)
    try:
        available = train.count_tasks(args.env_id, args.split)
    except train.ConfigError as err:
        p.error(str(err))
    if args.tasks > available:
        p.error(f"--tasks {args.tasks}: split {args.split!r} of {args.env_id} has {available} tasks")
    # the table names each task's write actions and the reward version, which only a task world knows:
    # an environment without one failed there, after every episode had been played
    from sinkflex_core.envs.worlds import world_of

    try:
        world_of(args.env_id)
    except ValueError as err:
        p.error(f"--env-id: {err}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress:
        from sinkflex_core import models

        models.hide_loading_bars()

    tasks = list(range(args.tasks))
    try:
        table = train.success_table(args.policy, args.split, tasks, args.samples, args.tasks_per_call, args.seed,
                                    progress=not args.no_progress, env_id=args.env_id)
    except FileNotFoundError as err:  # no saved policy there
        p.error(f"--policy: {err}")
    counts, minutes = list(table["successes"]), float(table["minutes"].iloc[0])
    pairs = [(c, args.samples) for c in counts]
    print(f"\n{args.policy}: {len(tasks)} {args.split} tasks x {args.samples} episodes in {minutes:.1f} min")
    print(f"{'k':>3} {'pass@k':>7} {'pass^k':>7}")
    k = 1
    while k <= args.samples:
        print(f"{k:>3} {pass_at_k(pairs, k):>7.3f} {pass_hat_k(pairs, k):>7.3f}")
        k *= 2
    by_kind = table.assign(solved=table["successes"] > 0).groupby("kind").agg(
        tasks=("task", "size"), solved_once=("solved", "sum"), success_rate=("successes", "sum"))
    by_kind["success_rate"] /= by_kind["tasks"] * args.samples  # episodes solved, not mean reward
    print(f"\nTasks solved at least once in {args.samples} tries, by the task's write actions:")
    print(by_kind.sort_values("tasks", ascending=False).round(3).to_string())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out, index=False)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
