"""The paper's retail learning curve at small scale: GRPO with 3 seeds from the shipped start policy
(``data/retail-tiny-start``, :mod:`sinkflex_core.start`), or from a start trained here.

    python benchmarks/reproduce_curve.py                    # from the shipped start, with its screen of
                                                            # the training tasks, seeds 0 1 2
    python benchmarks/reproduce_curve.py --train-start      # SFT here first (cached in runs/curve/sft and
                                                            # runs/curve/sft_identity), then its screen
                                                            # (cached in runs/curve/train_screen.csv)
    python benchmarks/reproduce_curve.py --parallel 3       # the seeds side by side, one thread each
    python benchmarks/reproduce_curve.py --smoke            # a minute: tiny settings, nothing written to data/
    python benchmarks/reproduce_curve.py --record-only      # rewrite data/ from the finished runs

GRPO trains only on the training tasks that the SFT start solved sometimes but not always in
``--screen-samples`` episodes each (:func:`sinkflex_core.train.screen_or_reuse`, about 20 minutes for
600 tasks x 4 on 2 cores, once per start; ``--screen-samples 0``: on all of them): of the others,
every group has equal rewards and teaches nothing.

Writes ``data/reward_curve.csv`` (the test-reward curve of every seed, long format, with provenance)
and ``data/reward_curve_seed{N}.csv`` (every per-step metric of that seed's run), then prints the
reward at the start and end of each seed, the gain, and mean and spread over seeds. The paper's
figure: 0.25 -> 0.44 (+0.19).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from sinkflex_core import sft, start, train
from sinkflex_core.paths import data_dir, repo_root

PAPER_START, PAPER_END = train.PAPER_REWARD_START, train.PAPER_REWARD_END


def run_sft(out_root: Path, smoke: bool, threads: int, progress: bool = True) -> Path:
    """The shared SFT start, in two stages, each trained once and reused while its config is unchanged:
    ``OUT_ROOT/sft`` (the SFT defaults), then ``OUT_ROOT/sft_identity`` (:func:`sinkflex_core.sft.identity_stage`).
    Returns the second."""
    cfg = sft.SFTConfig(out_dir=str(out_root / "sft"), threads=threads, progress=progress)
    small = {"progress": progress}
    if smoke:
        cfg.hidden_size, cfg.num_layers, cfg.max_steps, cfg.eval_every = 64, 2, 4, 2
        cfg.train_tasks, cfg.val_tasks, cfg.batch_tokens, cfg.stop_at_reward = 12, 4, 4096, 0.0
        cfg.copy_warmup_steps, cfg.copy_warmup_length = 4, 64
        small.update(identity_warmup_steps=2, identity_rows=2, max_steps=2, eval_every=2)
    base = sft.train_or_reuse(cfg)
    return sft.train_or_reuse(sft.identity_stage(base, out_root / "sft_identity", **small))


def sft_stages(sft_dir: Path) -> list[Path]:
    """The SFT runs behind ``sft_dir``, first to last: ``sft_dir`` and, while a run was initialised
    from another SFT run folder (``init_from`` with an ``sft_history.csv``), that one before it."""
    chain = [sft_dir]
    while True:
        prev = sft.saved_config(chain[0]).get("init_from") or ""
        if not prev or not (Path(prev) / "sft_history.csv").is_file() or Path(prev) in chain:
            return chain
        chain.insert(0, Path(prev))


def chosen_row(hist: pd.DataFrame) -> pd.Series:
    """The evaluation whose weights a stage saved: its last best one (the last one without a ``best`` column)."""
    return hist[hist["best"]].iloc[-1] if "best" in hist and hist["best"].any() else hist.iloc[-1]


def stage_histories(stages: list[Path]) -> list[tuple[Path, pd.DataFrame]]:
    """Each stage's folder and ``sft_history.csv`` (stages without evaluations left out), the history
    with ``run`` (the folder's name) and ``total_step``: the stage's steps counted on from the step
    whose weights the stage before it saved (its best evaluation; each stage starts from those weights)."""
    parts, offset = [], 0
    for folder in stages:
        hist = pd.read_csv(folder / "sft_history.csv")
        if len(hist):
            parts.append((folder, hist.assign(run=folder.name, total_step=hist["step"] + offset)))
            offset += int(chosen_row(hist)["step"])
    return parts


def write_sft_table(parts: list[tuple[Path, pd.DataFrame]]) -> pd.DataFrame:
    """``data/reward_curve_sft.csv``: every evaluation of each SFT stage (``parts``, from
    :func:`stage_histories`; ``step`` counts within the stage), with its settings and provenance.
    Returns the table."""
    from transformers import AutoModelForCausalLM

    from sinkflex_core.provenance import provenance

    tables = []
    for folder, hist in parts:
        cfg = {**dataclasses.asdict(sft.SFTConfig()), **sft.saved_config(folder)}  # fields added since: defaults
        model = AutoModelForCausalLM.from_pretrained(folder)
        mcfg, n_params = model.config, sum(p.numel() for p in model.parameters())
        tables.append(hist.assign(
            seed=cfg["seed"], peak_lr=cfg["lr"],
            hidden_size=mcfg.hidden_size, num_layers=mcfg.num_hidden_layers, num_heads=mcfg.num_attention_heads,
            parameters=n_params, expert_split=cfg["expert_split"], expert_tasks=cfg["train_tasks"] or "all",
            batch_tokens=cfg["batch_tokens"], context_loss_weight=cfg["context_loss_weight"],
            val_tasks=cfg["val_tasks"], eval_temperature=cfg["eval_temperature"], threads=cfg["threads"],
            init_from=Path(cfg["init_from"]).name if cfg["init_from"] else "",
            value_loss_weight=cfg["value_loss_weight"], recall_warmup_steps=cfg["recall_warmup_steps"],
            recall_fraction=cfg["recall_fraction"], recall_fact_fillers=cfg["recall_fact_fillers"],
            identity_warmup_steps=cfg["identity_warmup_steps"], identity_rows=cfg["identity_rows"]))
    table = pd.concat(tables, ignore_index=True)
    for k, v in provenance().items():
        table[k] = v
    front = ["run", "seed", "step", "total_step", "epoch", "loss", "lr", "val_reward", "val_success", "val_turns",
             "elapsed_s", "best"]
    table = table[[c for c in front if c in table] + [c for c in table.columns if c not in front]]
    table.to_csv(data_dir() / "reward_curve_sft.csv", index=False)
    return table


def sft_summary(parts: list[tuple[Path, pd.DataFrame]]) -> dict:
    """The columns every GRPO row carries about its start (``parts`` from :func:`stage_histories`): the
    saved step of the last stage in ``total_step``, its validation reward, and the minutes of all stages."""
    if not parts:
        return {}
    chosen = chosen_row(parts[-1][1])
    return {"sft_steps": int(chosen["total_step"]), "sft_val_reward": float(chosen["val_reward"]),
            "sft_minutes": round(sum(float(h["elapsed_s"].iloc[-1]) for _, h in parts) / 60, 2)}


def grpo_config(sft_dir: Path, seed: int, out_dir: Path, smoke: bool, threads: int, overrides: dict):
    values = {"model": str(sft_dir), "seed": seed, "out_dir": str(out_dir), "threads": threads, **overrides}
    if smoke:
        values.update(steps=2, tasks_per_step=2, group_size=2, eval_tasks=4, eval_samples=2, eval_every=1,
                      max_total_tokens=512, max_turns=4, max_new_tokens_per_turn=32, micro_batch_size=4,
                      drop_uniform_groups=False)  # the smoke policy solves nothing: update on every group
    return train.resolve_config("tiny-cpu", values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out-root", default="runs/curve", help="SFT and GRPO run folders")
    p.add_argument("--sft-dir", default=None,
                   help="the start policy folder (default: the shipped start, data/retail-tiny-start)")
    p.add_argument("--train-start", action="store_true",
                   help="train the start here instead: OUT_ROOT/sft continued into OUT_ROOT/sft_identity")
    p.add_argument("--parallel", type=int, default=1, help="seeds run at once (each with 2/N threads)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override")
    p.add_argument("--screen-samples", type=int, default=4,
                   help="episodes per training task in the screen of the SFT start (0: no screen, GRPO on all "
                        "tasks; ignored with --set task_screen=FILE)")
    p.add_argument("--smoke", action="store_true", help="tiny settings; prints, writes nothing to data/")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--record-only", action="store_true",
                   help="train nothing: write data/ from the finished runs in OUT_ROOT (pass the --sft-dir, "
                        "--seeds and --parallel they ran with)")
    args = p.parse_args(argv)

    root = repo_root()
    out_root = Path(args.out_root) if Path(args.out_root).is_absolute() else root / args.out_root
    if args.smoke:
        out_root = out_root / "smoke"
    threads = max(1, (os.cpu_count() or 2) // max(1, args.parallel))
    if args.record_only:
        sft_dir = Path(args.sft_dir) if args.sft_dir else out_root / "sft_identity"
        missing = [str(d) for d in [sft_dir] + [out_root / f"grpo_seed{s}" for s in args.seeds]
                   if not d.is_dir()]
        if missing:
            p.error(f"--record-only: no finished run in {', '.join(missing)}")
        return record(out_root, sft_dir, args.seeds, args.parallel, args.smoke)
    if args.sft_dir:
        sft_dir = Path(args.sft_dir)
    elif args.train_start or args.smoke or not (start.start_dir() / "model.safetensors").is_file():
        sft_dir = run_sft(out_root, args.smoke, threads, not args.no_progress)
    else:
        sft_dir = start.start_dir()
    overrides = dict(kv.split("=", 1) for kv in args.set)
    if args.screen_samples < 0:
        p.error("--screen-samples must be >= 0")
    if args.screen_samples and "task_screen" not in overrides:
        if args.smoke:  # the smoke policy solves nothing: a screen would leave no task
            print("smoke: no screen of the training tasks", flush=True)
        elif (sft_dir / "train_screen.csv").is_file() and args.screen_samples == 4:  # the start's own screen
            screen = sft_dir / "train_screen.csv"
        else:
            screen = train.screen_or_reuse(sft_dir, out_root / "train_screen.csv", samples=args.screen_samples,
                                           progress=not args.no_progress)
            overrides["task_screen"] = os.path.relpath(screen, root)
    if args.no_progress:
        overrides["progress"] = "false"

    # Each seed is its own process (clean state; several at once with --parallel).
    pending, running, t0 = list(args.seeds), {}, time.perf_counter()
    while pending or running:
        while pending and len(running) < args.parallel:
            seed = pending.pop(0)
            run_dir = out_root / f"grpo_seed{seed}"
            cfg = grpo_config(sft_dir, seed, run_dir, args.smoke, threads, overrides)
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg_path = run_dir / "requested_config.json"
            cfg_path.write_text(json.dumps(cfg.to_dict(), indent=1))
            log = open(run_dir / "train.log", "a")
            cmd = [sys.executable, "-m", "sinkflex_core.train", "--config", str(cfg_path)]
            print(f"seed {seed}: {' '.join(cmd[1:])} (log {run_dir / 'train.log'})", flush=True)
            running[seed] = (subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT), log, run_dir,
                             time.perf_counter())
        time.sleep(2)
        for seed, (proc, log, run_dir, started) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[seed]
                now = time.perf_counter()
                print(f"seed {seed}: exit {proc.returncode} after {(now - started) / 60:.1f} min "
                      f"({(now - t0) / 60:.1f} min since the first seed started)", flush=True)
                if proc.returncode != 0:
                    print((run_dir / "train.log").read_text()[-3000:], file=sys.stderr)
                    return proc.returncode

    return record(out_root, sft_dir, args.seeds, args.parallel, args.smoke)


def record(out_root: Path, sft_dir: Path, seeds: list[int], parallel: int, smoke: bool) -> int:
    """Write the data/ tables from the finished runs (nothing when ``smoke``) and print the summary."""
    stages = [p for p in sft_stages(sft_dir) if (p / "sft_history.csv").is_file()]
    parts = stage_histories(stages)
    sft_extra = sft_summary(parts)
    if parts and not smoke:
        write_sft_table(parts)
    tables = []
    for seed in seeds:
        run_dir = out_root / f"grpo_seed{seed}"
        screen = json.loads((run_dir / "config.json").read_text()).get("task_screen", "")
        df = train.curve_table(run_dir, seed, parallel_runs=parallel, task_screen=Path(screen).name if screen else "",
                               **sft_extra)
        tables.append(df)
        if not smoke:
            df.to_csv(data_dir() / f"reward_curve_seed{seed}.csv", index=False)
    full = pd.concat(tables, ignore_index=True)
    # each seed's evaluations; data/paper_claims.csv matches the paper's end on each seed's last one
    curve = train.evaluations(full)
    keep = train.CURVE_COLUMNS + [c for c in full.columns if c not in train.METRIC_COLUMNS and c != "seed"] + \
        ["last_eval"]
    if not smoke:
        curve[keep].to_csv(data_dir() / "reward_curve.csv", index=False)
    summary = train.summarize_curves(full)
    pd.set_option("display.width", 160)
    print("\nmean test reward (held-out tasks), first and last evaluation of each seed:")
    print(summary.round(3).to_string(index=False))
    per_seed = summary[~summary["seed"].isin(["mean", "std"])]
    gain = per_seed["gain"]
    print(f"\ngain over {len(gain)} seed(s): mean {gain.mean():+.3f}, min {gain.min():+.3f}, max {gain.max():+.3f} "
          f"(paper: {PAPER_START:.2f} -> {PAPER_END:.2f}, {PAPER_END - PAPER_START:+.2f}); start mean "
          f"{per_seed['start'].mean():.3f}, end mean {per_seed['end'].mean():.3f}")
    if not smoke:
        print(f"written: {data_dir() / 'reward_curve.csv'} and reward_curve_seed*.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
