"""Wall-clock per GRPO step, synchronous against asynchronous rollouts (train.async_rollouts).

Runs a few steps of the same small run four ways and prints, per configuration, the median and mean
wall-clock of a step without evaluations (the first step is left out: it includes the worker's
start), the learner's wait
for rollouts, its update time, and the worker's own rollout time:

- ``sync``: the single-process trainer, ``threads`` torch threads (one core with the default 1);
- ``sync-2t``: the same with twice the threads, i.e. the cores the asynchronous runs use;
- ``async-k1``, ``async-k2``: learner and rollout worker in two processes of ``threads`` threads each,
  groups at most 1 (2) updates old.

The policy is ``--model`` (a saved policy folder, e.g. an SFT start) or by default a random tiny Qwen2
(hidden 128, 4 layers): a random policy never emits its end token, so each episode is one turn of
``--max-new-tokens`` tokens. Its groups all score 0, so ``drop_uniform_groups`` is off here, else no
update would run. The load average of the machine is printed beside every figure: on a machine shared
with other jobs, overlap gains shrink or vanish, so rerun on idle cores before drawing conclusions.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_async.py`` (``--steps``, ``--configs``,
``--json FILE`` to keep the figures).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file

CONFIGS = {
    "sync": dict(async_rollouts=False, thread_factor=1),
    "sync-2t": dict(async_rollouts=False, thread_factor=2),
    "async-k1": dict(async_rollouts=True, max_staleness=1, thread_factor=1),
    "async-k2": dict(async_rollouts=True, max_staleness=2, thread_factor=1),
}


def run_one(name: str, args, out_root: str) -> dict:
    from sinkflex_core.train import Trainer, resolve_config

    spec = dict(CONFIGS[name])
    factor = spec.pop("thread_factor")
    overrides = dict(model=args.model, steps=args.steps, tasks_per_step=args.tasks_per_step,
                     group_size=args.group_size, max_new_tokens_per_turn=args.max_new_tokens,
                     max_total_tokens=args.max_total_tokens, drop_uniform_groups=False, eval_every=0, eval_tasks=1,
                     eval_samples=2, save_every=0, max_minutes=0.0, progress=False, tensorboard=False, resume=False,
                     threads=args.threads * factor, out_dir=os.path.join(out_root, name), **spec)
    cfg = resolve_config("tiny-cpu", overrides)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows = Trainer(cfg).run()
    wall = time.perf_counter() - t0
    steps = [r for r in rows if r["step"] >= 2]  # step 1 includes the worker's start
    for r in rows:  # the last step also evaluates: that is not the step's time
        if r.get("step_s") is not None:
            r["step_s"] -= r.get("eval_s") or 0.0
    res = {"config": name, "threads_per_process": cfg.threads, "steps_timed": len(steps), "run_s": wall,
           "load_before": load_before, "load_after": os.getloadavg()}
    for key in ("step_s", "rollout_s", "update_s", "rollout_worker_s", "staleness_mean"):
        vals = [r[key] for r in steps if r.get(key) is not None]
        if vals:
            res[key + "_median"] = statistics.median(vals)
            res[key + "_mean"] = statistics.fmean(vals)
    res["first_step_s"] = next(r["step_s"] for r in rows if r["step"] == 1)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help='"tiny" (random, hidden 128, 4 layers) or a policy folder')
    p.add_argument("--steps", type=int, default=5, help="steps per configuration (the first is not timed)")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over the configurations (interleaved, so a change of load hits them all)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    if args.steps < 2:  # step 1 is left out of the figures: no step would be left to time
        p.error("--steps must be at least 2 (the first step is not timed)")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    print(f"cpus: {os.cpu_count()} (usable: {len(os.sched_getaffinity(0))}); OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average at start {os.getloadavg()}")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as out_root:
        for rnd, name in [(r, n) for r in range(args.repeat) for n in names]:
            res = run_one(name, args, os.path.join(out_root, f"round{rnd}"))
            res["round"] = rnd
            results.append(res)
            print(f"{name:9s} step {res['step_s_median']:6.2f} s median ({res['step_s_mean']:.2f} mean, "
                  f"{res['steps_timed']} steps) | learner waits {res['rollout_s_median']:.2f} s, updates "
                  f"{res['update_s_median']:.2f} s | worker rollout {res.get('rollout_worker_s_median', float('nan')):.2f} s"
                  f" | staleness {res.get('staleness_mean_mean', float('nan')):.2f} | first step "
                  f"{res['first_step_s']:.1f} s | load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}")
    for rnd in range(args.repeat):
        base = next((r for r in results if r["config"] == "sync" and r["round"] == rnd), None)
        for r in results:
            if base is not None and r["round"] == rnd:
                print(f"round {rnd} {r['config']:9s} speed-up over sync (median step): "
                      f"{base['step_s_median'] / r['step_s_median']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
