"""Synchronous against asynchronous rollouts (``train.async_rollouts``), learning and wall-clock: GRPO
from the shipped start policy (``data/retail-tiny-start``) with the tiny-cpu preset, 3 seeds each of

- ``sync``: the single-process trainer, 2 torch threads (both cores);
- ``async-k1``, ``async-k2``: learner and rollout worker in two processes of 1 thread each, groups at
  most 1 (2) updates old, with the correction ``old_logprobs=recompute`` and ``tis_cap=2``
  (``docs/async_rollouts.md``),

one run at a time (so every run has the machine to itself), the same number of steps each; then each
final policy on the first held-out test tasks, paired with the start's successes on the same tasks.

    python benchmarks/async_curves.py                       # 3 configs x 3 seeds, then the tests
    python benchmarks/async_curves.py --configs sync --seeds 0 --steps 4
    python benchmarks/async_curves.py --smoke               # a few minutes, nothing written to data/
    python benchmarks/async_curves.py --record-only         # rewrite data/ from the finished runs

Runs go to ``OUT_ROOT/{config}/seed{N}`` (a finished run is reused), the smoke runs to
``OUT_ROOT/smoke/{config}/seed{N}``. Writes ``data/async_curves.csv``
(every step of every run, with ``config`` and provenance), ``data/async_timeline.csv`` (the learner's
and the worker's spans of every run, ``train.step_timeline``) and ``data/async_curves_test.csv`` (per run
and task: the start's and the final policy's success rates), and prints per config the median step time,
the staleness, the training reward and the held-out gain with a paired bootstrap 95 % interval over tasks
(each task's gain averaged over the seeds first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd

from sinkflex_core import train
from sinkflex_core.paths import data_dir, repo_root

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce_curve import measure_run, start_test_rows  # noqa: E402  (test tables of the final policy and the start)

CONFIGS = {
    "sync": dict(async_rollouts=False, threads=2),
    "async-k1": dict(async_rollouts=True, max_staleness=1, threads=1, old_logprobs="recompute", tis_cap=2.0),
    "async-k2": dict(async_rollouts=True, max_staleness=2, threads=1, old_logprobs="recompute", tis_cap=2.0),
}
SMOKE = dict(tasks_per_step=2, group_size=2, max_total_tokens=512, max_turns=4, max_new_tokens_per_turn=32,
             micro_batch_size=4, drop_uniform_groups=False)


def run_config(policy: Path, config: str, seed: int, out_dir: Path, steps: int, smoke: bool):
    # eval_tasks=1: the trainer's own evaluations (before the first and after the last step) are kept
    # minimal; the held-out measurement is the paired one below
    values = dict(model=str(policy), seed=seed, out_dir=str(out_dir), steps=steps, max_minutes=0.0, eval_every=0,
                  eval_tasks=1, eval_samples=2, save_every=0, progress=False, tensorboard=False, **CONFIGS[config])
    if smoke:
        values.update(SMOKE)
    return train.resolve_config("tiny-cpu", values)


def finished(run_dir: Path, steps: int) -> bool:
    path = run_dir / "metrics.csv"
    return path.is_file() and (run_dir / "policy").is_dir() and pd.read_csv(path)["step"].max() >= steps


def run_dirs(out_root: Path, configs: list[str], seeds: list[int], smoke: bool) -> list[tuple[str, int, Path]]:
    """``(config, seed, folder)`` of every run. The smoke runs have folders of their own: in the full runs'
    folders a later full run would take a smoke run of as many steps for finished (and record it in data/),
    or refuse to resume from its checkpoint (another config)."""
    root = out_root / "smoke" if smoke else out_root
    return [(c, s, root / c / f"seed{s}") for c in configs for s in seeds]


def start_rates(policy: Path, tasks: int, scratch: Path) -> pd.Series:
    """The start's success rate on each of the first ``tasks`` test tasks as the sink-attention runs play
    it, from the 120 tasks x 8 episodes cached in its ``test_rewards.csv`` (measured there first if not;
    a start in data/ in a copy under ``scratch``, so that its recorded table is never rewritten)."""
    rows = start_test_rows(policy, "sinkflex", 8, 120, scratch=scratch).set_index("task").sort_index()
    return (rows["successes"] / rows["tries"]).iloc[:tasks]


def main(argv: list[str] | None = None) -> int:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default=str(data_dir() / "retail-tiny-start"), help="the start policy folder")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=16, help="GRPO steps of every run")
    p.add_argument("--test-tasks", type=int, default=120, help="held-out tasks each final policy plays")
    p.add_argument("--test-samples", type=int, default=2, help="episodes per held-out task")
    p.add_argument("--out-root", default=str(repo_root() / "runs" / "async_curves"))
    p.add_argument("--smoke", action="store_true", help="tiny settings; nothing written to data/")
    p.add_argument("--record-only", action="store_true", help="only rewrite data/ from finished runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.test_tasks, args.test_samples = min(args.steps, 3), 2, 1
    # checked before any run: the held-out tests come after every run has trained
    n_test = train.count_tasks("sinkflex/Retail-v0", "test")
    if args.steps < 1 or args.test_samples < 1 or not 1 <= args.test_tasks <= n_test:
        p.error(f"--steps and --test-samples must be >= 1 and --test-tasks in 1..{n_test} (the test split's tasks)")
    policy, out_root = Path(args.policy), Path(args.out_root)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"# async_curves: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"{len(args.configs)} configs x {len(args.seeds)} seeds x {args.steps} steps", flush=True)
    runs = run_dirs(out_root, args.configs, args.seeds, args.smoke)
    if args.record_only:
        missing = [str(run_dir) for _, _, run_dir in runs if not finished(run_dir, args.steps)]
        if missing:
            p.error(f"--record-only: no finished run of {args.steps} steps in {', '.join(missing)}")
    else:
        for config, seed, run_dir in runs:
            if finished(run_dir, args.steps):
                print(f"{config} seed {seed}: finished before, reused", flush=True)
                continue
            t0, load = time.perf_counter(), os.getloadavg()[0]
            train.Trainer(run_config(policy, config, seed, run_dir, args.steps, args.smoke)).run()
            print(f"{config} seed {seed}: {args.steps} steps in {time.perf_counter() - t0:.0f} s "
                  f"(load average {load:.1f} before)", flush=True)
        for config, seed, run_dir in runs:
            t0 = time.perf_counter()
            measure_run(run_dir, args.test_samples, args.test_tasks)
            print(f"{config} seed {seed}: held-out test in {time.perf_counter() - t0:.0f} s", flush=True)
    return record(policy, runs, args)


def record(policy: Path, runs: list, args) -> int:
    from sinkflex_core.provenance import provenance

    curves, timelines, tests = [], [], []
    start = None if args.smoke else start_rates(policy, args.test_tasks, Path(args.out_root) / "start_measured")
    for config, seed, run_dir in runs:
        m = pd.read_csv(run_dir / "metrics.csv")
        curves.append(m.assign(config=config, seed=seed))
        timelines.append(train.step_timeline(run_dir).assign(config=config, seed=seed))
        end = pd.read_csv(measure_run(run_dir, args.test_samples, args.test_tasks)).set_index("task").sort_index()
        end_rate = end["successes"] / end["tries"]
        tests.append(pd.DataFrame({"config": config, "seed": seed, "task": end_rate.index,
                                   "start_rate": start.loc[end_rate.index].to_numpy() if start is not None else 0.0,
                                   "end_rate": end_rate.to_numpy(), "end_tries": end["tries"].to_numpy()}))
    curve = pd.concat(curves, ignore_index=True)
    timeline = pd.concat(timelines, ignore_index=True)
    test = pd.concat(tests, ignore_index=True)
    summary = train.async_summary(curve, test)
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    if args.smoke:
        print("smoke run: nothing written to data/")
        return 0
    prov = provenance()
    for table in (curve, timeline, test):
        for key in ("date", "git_sha", "hardware", "torch", "transformers", "python"):
            table[key] = prov[key]
    front = ["config", "seed"]
    curve = curve[front + [c for c in curve.columns if c not in front]]
    timeline = timeline[front + [c for c in timeline.columns if c not in front]]
    curve.to_csv(data_dir() / "async_curves.csv", index=False)
    timeline.to_csv(data_dir() / "async_timeline.csv", index=False)
    test.to_csv(data_dir() / "async_curves_test.csv", index=False)
    print(f"wrote {data_dir() / 'async_curves.csv'}, async_timeline.csv, async_curves_test.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
