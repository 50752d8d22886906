"""The time of one GRPO update of the ``tiny-cpu`` preset on CPU (the reference log-probs, then the
trainer's own :func:`sinkflex_core.train.grpo_update`), for each attention path, on the same batch.

The batch is one step's worth of the retail oracle's episodes (``tasks_per_step`` training tasks x
``group_size``, the lengths of real episodes, no sampling), with rewards 0 and 1 alternating inside each
group so that every group is updated on, and the start policy's own log-probs as the sampling ones.
Each path starts from the same weights and optimizer state. Paths:

- ``sinkflex``: the preset's sink attention (sinks, window, learned sink) as training runs it: PyTorch's
  fused CPU kernel, ``chunk`` queries at a time against only the keys they can see;
- ``sinkflex-one-mask``: the same kernel in one call per layer under the whole ``L x L`` additive mask
  (how the fused path ran before its query blocks);
- ``sinkflex-chunked``: the exact chunked path in plain PyTorch;
- ``sdpa``: stock causal attention (a different attention: the speed to match).

    python benchmarks/bench_update.py --policy data/retail-tiny-start --threads 2
    python benchmarks/bench_update.py --policy data/retail-tiny-start --tasks 2 --group-size 2 --repeats 1  # seconds

Printed: each path's median time over ``--repeats`` updates, then its ratio to ``sinkflex``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import statistics
import tempfile
import time

import torch

print = functools.partial(print, flush=True)  # progress shows when the output goes to a file

PATHS = ("sinkflex", "sinkflex-one-mask", "sinkflex-chunked", "sdpa")


def oracle_batch(trainer) -> dict:
    """One step's rows of the oracle's episodes on the first training tasks, rewards alternating 0/1."""
    from sinkflex_core.rollout import AgentBackend, collect_rollouts
    from sinkflex_core.train import concat_rollouts, rollout_config

    c = trainer.cfg
    rcfg = rollout_config(c, seed=0)
    batch = collect_rollouts(AgentBackend(trainer.tokenizer), trainer.tokenizer, c.env_id,
                             trainer.train_task_ids[:c.tasks_per_step], c.train_split, rcfg)
    rows = concat_rollouts([batch], pad_id=trainer.tokenizer.pad_token_id or 0)
    rows["loss_mask"] = rows["loss_mask"].float()
    rows["rewards"] = (torch.arange(len(rows["rewards"])) % 2).float()
    return rows


def set_kernel(trainer, path: str, chunk: int) -> None:
    from sinkflex_core.attention.hf import _attention_modules

    for module in (trainer.policy, trainer.ref):
        for m in _attention_modules(module.lm):
            m.sinkflex_backend = "chunked" if path == "sinkflex-chunked" else "auto"
            m.sinkflex_chunk_size = 1 << 30 if path == "sinkflex-one-mask" else chunk


def time_updates(trainer, rows: dict, repeats: int) -> tuple[list[float], dict]:
    """Seconds of ``repeats`` updates (reference log-probs + grpo_update), each from the same state, and
    the last update's sums (``grpo_update``'s return: loss, KL, ...)."""
    from sinkflex_core.train import grpo_update

    weights = copy.deepcopy(trainer.policy.state_dict())
    opt = copy.deepcopy(trainer.optimizer.state_dict())
    sched = copy.deepcopy(trainer.scheduler.state_dict())
    rows = dict(rows)
    rows["old_logprobs"] = trainer._frozen_logprobs(rows, "old")
    adv, train_rows = trainer._advantages(rows)

    def restore() -> None:
        trainer.policy.load_state_dict(weights)
        trainer.optimizer.load_state_dict(opt)
        trainer.scheduler.load_state_dict(sched)

    times = []
    for _ in range(repeats):
        restore()
        start = time.perf_counter()
        ref = trainer._frozen_terms(rows, train_rows)
        acc = grpo_update(trainer.policy, trainer.optimizer, trainer.scheduler, rows, adv, train_rows, ref,
                          trainer.cfg, trainer.dist)
        times.append(time.perf_counter() - start)
    restore()  # the next path starts where this one did
    return times, acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="a saved start policy folder (e.g. data/retail-tiny-start)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--tasks", type=int, default=0, help="tasks in the batch (0: the preset's tasks_per_step)")
    p.add_argument("--group-size", type=int, default=0, help="episodes per task (0: the preset's group_size)")
    p.add_argument("--chunk", type=int, default=256, help="queries per block of the fused kernel")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        p.error(f"unknown path(s) {unknown}; choose from {', '.join(PATHS)}")
    if not os.path.isdir(args.policy):
        p.error(f"--policy {args.policy}: no such folder")
    # each failed only after the trainer and the batch were built (a group of one has no reward signal:
    # no row would be updated on, and the time would be that of no update)
    if min(args.repeats, args.threads, args.chunk) < 1 or args.tasks < 0 or args.group_size < 0 or args.group_size == 1:
        p.error("--repeats, --threads and --chunk must be >= 1, --tasks >= 0 and --group-size 0 or >= 2 "
                "(0: the preset's)")
    from sinkflex_core.train import Trainer, resolve_config

    torch.set_num_threads(args.threads)
    results, rows = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for attention in dict.fromkeys("sdpa" if x == "sdpa" else "sinkflex" for x in paths):
            over = {"model": args.policy, "attention": attention, "out_dir": f"{tmp}/{attention}",
                    "threads": args.threads, "progress": False, "resume": False, "tensorboard": False}
            if attention == "sdpa":
                over["layer_sinks"] = ""
            if args.tasks:
                over["tasks_per_step"] = args.tasks
            if args.group_size:
                over["group_size"] = args.group_size
                over["num_minibatches"] = min(2, args.group_size)
            trainer = Trainer(resolve_config("tiny-cpu", over))
            if rows is None:
                rows = oracle_batch(trainer)
                c = trainer.cfg
                lengths = rows["attention_mask"].sum(1).float()
                print(f"one update of the tiny-cpu preset on {len(lengths)} oracle episodes ({c.tasks_per_step} tasks "
                      f"x {c.group_size}; {int(lengths.min())}-{int(lengths.max())} tokens, mean {lengths.mean():.0f}); "
                      f"window {c.window}, {c.num_minibatches} mini-batches of micro-batches of {c.micro_batch_size}; "
                      f"{args.threads} thread(s) on {platform.processor() or platform.machine()}, "
                      f"load average {os.getloadavg()[0]:.2f}")
            for path in paths:
                if ("sdpa" if path == "sdpa" else "sinkflex") != attention:
                    continue
                if attention == "sinkflex":
                    set_kernel(trainer, path, args.chunk)
                times, _ = time_updates(trainer, rows, args.repeats)
                results[path] = statistics.median(times)
                print(f"{path:>18}  {results[path]:7.2f} s  (each: {', '.join(f'{t:.2f}' for t in times)})")
    base = results.get("sinkflex")
    if base:
        print("time / sinkflex (fused kernel in query blocks), same batch, same process:")
        for path, t in results.items():
            print(f"{path:>18}  x{t / base:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
