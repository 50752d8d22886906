"""The paper's retail learning curve at small scale: GRPO from the shipped start policy
(``data/retail-tiny-start``, :mod:`sinkflex_core.start`), 3 seeds with the tiny-cpu preset's sink
attention and 3 with stock causal attention, then each final policy and the start on every held-out
test task x 8 episodes.

    python benchmarks/reproduce_curve.py                    # 3 seeds x {sinkflex, sdpa}, two runs at a
                                                            # time (one thread each), then the tests
    python benchmarks/reproduce_curve.py --attentions sinkflex --seeds 0
    python benchmarks/reproduce_curve.py --train-start      # the shipped start's recipe here first (into
                                                            # runs/curve/start; hours, each stage reused)
    python benchmarks/reproduce_curve.py --screen-samples 4 # train only on the training tasks the start
                                                            # solved sometimes in 4 tries each
    python benchmarks/reproduce_curve.py --smoke            # a few minutes: tiny settings, nothing written to data/
    python benchmarks/reproduce_curve.py --record-only      # rewrite data/ from the finished runs

Each run trains for the preset's budget (``max_minutes``, 10 minutes), on all 600 training tasks unless
``--screen-samples`` is given. The start is measured once per attention (cached in its
``test_rewards.csv``); each final policy plays the same tasks with the same sampling seeds, so the
per-task difference is paired.

Writes ``data/reward_curve.csv`` (every step of every run: the training reward, the update's metrics,
the evaluations logged while training, with provenance) and ``data/reward_curve_test.csv`` (the start's
and each final policy's successes per held-out task), then prints the training reward at the first and
last step of each run and the held-out gain of each run and of each attention over its seeds, with a
paired bootstrap 95 % interval over tasks (``train.paired_gains``), and the difference between the two
attentions' gains (``train.gain_difference``). The paper's figure: 0.25 -> 0.44 (+0.19).
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
from sinkflex_core.attention import attention_settings
from sinkflex_core.paths import data_dir, repo_root

PAPER_START, PAPER_END = train.PAPER_REWARD_START, train.PAPER_REWARD_END


def run_sft(out_root: Path, smoke: bool, threads: int, progress: bool = True) -> Path:
    """The smoke run's start, in two stages, each trained once and reused while its config is unchanged:
    ``OUT_ROOT/sft`` (the SFT defaults, shrunk with ``smoke``), then ``OUT_ROOT/sft_identity``
    (:func:`sinkflex_core.sft.identity_stage`). Returns the second."""
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


def stage_histories(stages: list[Path]) -> list[tuple[Path, pd.DataFrame, dict]]:
    """Each stage's folder, ``sft_history.csv`` and saved config (stages without evaluations left out),
    the history with ``run`` (the folder's name) and ``total_step``: the stage's steps counted on from the
    step whose weights the stage before it saved (its best evaluation; each stage starts from those weights)."""
    return _count_on([(folder, folder.name, pd.read_csv(folder / "sft_history.csv"), sft.saved_config(folder))
                      for folder in stages])


def recipe_histories(sft_dir: Path) -> list[tuple[Path, pd.DataFrame, dict]]:
    """As :func:`stage_histories`, from the ``recipe/`` folder a shipped start carries
    (:func:`sinkflex_core.start.recipe_stages`): the stages' own run folders need not exist. The folder of every part is
    ``sft_dir`` (the stages share the model's shape). Empty when ``sft_dir`` has no recipe."""
    return _count_on([(sft_dir, label.partition("_")[2], hist, cfg)
                      for label, cfg, hist in start.recipe_stages(sft_dir)])


def start_histories(sft_dir: Path) -> list[tuple[Path, pd.DataFrame, dict]]:
    """The SFT stages behind the start in ``sft_dir``: its ``recipe/`` when it ships one, else the run
    folders its ``init_from`` chain names (:func:`sft_stages`)."""
    return recipe_histories(sft_dir) or stage_histories(
        [p for p in sft_stages(sft_dir) if (p / "sft_history.csv").is_file()])


def _count_on(stages: list[tuple[Path, str, pd.DataFrame, dict]]) -> list[tuple[Path, pd.DataFrame, dict]]:
    parts, offset = [], 0
    for folder, name, hist, cfg in stages:
        if len(hist):
            parts.append((folder, hist.assign(run=name, total_step=hist["step"] + offset), cfg))
            offset += int(chosen_row(hist)["step"])
    return parts


def write_sft_table(parts: list[tuple[Path, pd.DataFrame, dict]]) -> pd.DataFrame:
    """``data/reward_curve_sft.csv``: every evaluation of each SFT stage (``parts``, from
    :func:`start_histories`; ``step`` counts within the stage), with its settings and provenance.
    Returns the table. A file that already holds the same stages is left as it is: its provenance says
    where they were recorded (a shipped start's recipe carries none of its own)."""
    import io

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sinkflex_core.models import count_parameters
    from sinkflex_core.provenance import provenance

    tables = []
    for folder, hist, saved in parts:
        cfg = {**dataclasses.asdict(sft.SFTConfig()), **saved}  # fields added since: defaults
        # the shape and the parameter count of the stock model (a sink policy's learned sink logits are
        # not counted), from the config alone: no weights read, no loading report
        mcfg = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            n_params = count_parameters(AutoModelForCausalLM.from_config(mcfg))
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
    stamp = provenance()
    for k, v in stamp.items():
        table[k] = v
    front = ["run", "seed", "step", "total_step", "epoch", "loss", "lr", "val_reward", "val_success", "val_turns",
             "elapsed_s", "best"]
    table = table[[c for c in front if c in table] + [c for c in table.columns if c not in front]]
    path = data_dir() / "reward_curve_sft.csv"
    if path.is_file():
        old, new = pd.read_csv(path), pd.read_csv(io.StringIO(table.to_csv(index=False)))
        content = [c for c in new.columns if c not in stamp]
        if list(old.columns) == list(new.columns) and old[content].equals(new[content]):
            return old
    table.to_csv(path, index=False)
    return table


def sft_summary(parts: list[tuple[Path, pd.DataFrame, dict]]) -> dict:
    """The columns every GRPO row carries about its start (``parts`` from :func:`start_histories`): the
    saved step of the last stage in ``total_step``, its validation reward, and the minutes of all stages."""
    if not parts:
        return {}
    chosen = chosen_row(parts[-1][1])
    return {"sft_steps": int(chosen["total_step"]), "sft_val_reward": float(chosen["val_reward"]),
            "sft_minutes": round(sum(float(h["elapsed_s"].iloc[-1]) for _, h, _ in parts) / 60, 2)}


def grpo_config(sft_dir: Path, seed: int, out_dir: Path, smoke: bool, threads: int, overrides: dict):
    values = {"model": str(sft_dir), "seed": seed, "out_dir": str(out_dir), "threads": threads}
    if smoke:
        values.update(steps=2, tasks_per_step=2, group_size=2, eval_tasks=4, eval_samples=2, eval_every=1,
                      max_total_tokens=512, max_turns=4, max_new_tokens_per_turn=32, micro_batch_size=4,
                      drop_uniform_groups=False)  # the smoke policy solves nothing: update on every group
    values.update(overrides)  # what --set asks for wins over the smoke sizes too
    return train.resolve_config("tiny-cpu", values)


#: The attentions a recording compares: the tiny-cpu preset's (sink tokens + window + learned sink,
#: per-layer counts) and stock causal attention, the same start and everything else equal.
ATTENTIONS = ("sinkflex", "sdpa")


def run_overrides(sft_dir: Path, attention: str, overrides: dict) -> dict:
    """The GRPO config overrides of the ``attention`` runs from the start in ``sft_dir``: ``overrides``
    with that attention, and for ``sdpa`` from a start trained with sink attention its weights with full
    attention (``saved_attention=false``: the trainer refuses to drop a start's learned sinks unasked)."""
    over = {**overrides, "attention": attention}
    if attention == "sdpa" and attention_settings(sft_dir) is not None:
        over["saved_attention"] = "false"
    return over


def run_dir_of(out_root: Path, attention: str, seed: int) -> Path:
    return out_root / attention / f"grpo_seed{seed}"


def measured_copy(sft_dir: Path, scratch: Path) -> Path:
    """A start that lives in data/ (the shipped one) is measured in a copy, ``scratch/<its name>``: its
    ``test_rewards.csv`` is the recorded measurement its model card states, which a measurement of other
    settings (``--test-samples``, ``--smoke``) would replace. The copy starts with the recorded rows and
    its own earlier ones (:func:`sinkflex_core.start.measure` reuses whichever fit). Other folders are
    measured in place."""
    if not sft_dir.resolve().is_relative_to(data_dir().resolve()):
        return sft_dir
    import shutil

    copy = scratch / sft_dir.name
    copy.mkdir(parents=True, exist_ok=True)
    for name in start.POLICY_FILES:
        if (sft_dir / name).is_file():
            shutil.copy2(sft_dir / name, copy / name)
    known = [pd.read_csv(f, dtype={"policy_digest": str, "git_sha": str})
             for f in (sft_dir / "test_rewards.csv", copy / "test_rewards.csv") if f.is_file()]
    if known:
        pd.concat(known, ignore_index=True).drop_duplicates().to_csv(copy / "test_rewards.csv", index=False)
    return copy


def start_test_rows(sft_dir: Path, attention: str, samples: int, tasks: int,
                    scratch: Path | None = None) -> pd.DataFrame:
    """The start's held-out successes as the ``attention`` run starts it: full attention for ``sdpa``,
    the preset's sink attention for ``sinkflex`` (a start trained with sink attention: its own, and its
    weights with full attention for ``sdpa``), measured once per start and cached in its
    ``test_rewards.csv`` by :func:`sinkflex_core.start.measure` (a start in data/: in a copy under
    ``scratch``, :func:`measured_copy`)."""
    from sinkflex_core.train.evaluate import attention_label

    if scratch is not None:
        sft_dir = measured_copy(sft_dir, scratch)
    if attention_settings(sft_dir) is None and not (sft_dir / "sinkflex_sinks.json").is_file():
        start.estimate_sinks(sft_dir)  # a start trained here: its per-layer sink counts, as the runs estimate them
    start.measure(sft_dir, test_samples=samples, screen_samples=0, test_tasks=tasks, progress=False)
    table = pd.read_csv(sft_dir / "test_rewards.csv", dtype={"policy_digest": str})
    sinks = start.preset_sinks(sft_dir)  # None: a start trained with sink attention, played with its own
    if attention == "sinkflex":
        label = attention_label(sinks)
    else:  # a sink-trained start's full-attention runs start from its weights with full attention
        label = "saved" if sinks is not None else "full"
    rows = table[(table["attention"] == label) & (table["tries"] == samples)]
    if rows["task"].nunique() != tasks:
        raise RuntimeError(f"{sft_dir / 'test_rewards.csv'} has no {tasks} x {samples} rows for {label}")
    return rows


def measure_run(run_dir: Path, samples: int, tasks: int) -> Path:
    """The final policy of a finished run (``RUN_DIR/policy``, with the attention it trained with) on the
    first ``tasks`` test tasks x ``samples``, sampling seed 0 as the start's measurement: ``test_rewards.csv``."""
    path = run_dir / "test_rewards.csv"
    digest = train.policy_digest(run_dir / "policy")
    if path.is_file():
        old = pd.read_csv(path, dtype={"policy_digest": str})
        if old["policy_digest"].eq(digest).all() and len(old) == tasks and (old["tries"] == samples).all():
            return path
    t0 = time.perf_counter()
    table = train.success_table(run_dir / "policy", "test", list(range(tasks)), samples, progress=False)
    table["minutes"] = round((time.perf_counter() - t0) / 60, 2)
    table.to_csv(path, index=False)
    return path


def main(argv: list[str] | None = None) -> int:
    from sinkflex_core.provenance import pin_git_sha
    pin_git_sha()  # the commit that runs, named in every result this run writes
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS,
                   help="the runs' attention: the preset's sink attention and/or stock causal attention")
    p.add_argument("--out-root", default="runs/curve", help="SFT and GRPO run folders (OUT_ROOT/ATTENTION/grpo_seedN)")
    p.add_argument("--sft-dir", default=None,
                   help="the start policy folder (default: the shipped start, data/retail-tiny-start)")
    p.add_argument("--train-start", action="store_true",
                   help="train the start here instead, with the shipped start's recipe (python -m sinkflex_core.start "
                        "--lookup-stage --zip-stage --sink-stage --address-stage --payment-stage): into OUT_ROOT/start, its stages in "
                        "OUT_ROOT/start_work (about seven and a half hours on 2 cores)")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once (each with 2/N threads; the recording ran 1: each run alone on 2 cores, "
                        "as fast as 10 minutes allow; 2 gave each run 3-4 steps instead of 20-23)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override")
    p.add_argument("--screen-samples", type=int, default=0,
                   help="episodes per training task in a screen of the start, GRPO then training on the tasks "
                        "it solved sometimes (0: no screen, GRPO on all training tasks; ignored with "
                        "--set task_screen=FILE)")
    p.add_argument("--test-samples", type=int, default=8,
                   help="episodes per held-out test task for the start and each final policy (0: none)")
    p.add_argument("--smoke", action="store_true", help="tiny settings; prints, writes nothing to data/")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--record-only", action="store_true",
                   help="train nothing: write data/ from the finished runs in OUT_ROOT (pass the --sft-dir, "
                        "--seeds, --attentions and --parallel they ran with)")
    p.add_argument("--measure", default=None, metavar="RUN_DIR", help=argparse.SUPPRESS)  # one run's final test
    args = p.parse_args(argv)
    # every argument checked before any work (the start's SFT stages, hours with --train-start)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.screen_samples < 0 or args.test_samples < 0:
        p.error("--screen-samples and --test-samples must be >= 0")
    bad = [kv for kv in args.set if "=" not in kv]
    if bad:
        p.error(f"--set takes KEY=VALUE, got {' '.join(bad)}")
    overrides = dict(kv.split("=", 1) for kv in args.set)
    if "attention" in overrides:
        p.error("choose the attention with --attentions, not --set attention=...")
    known = {f.name for f in dataclasses.fields(train.TrainConfig)}
    unknown = sorted(k for k in overrides if k.replace("-", "_") not in known)
    if unknown:
        p.error(f"--set: unknown GRPO config key(s) {unknown}")
    # the values too (a typo such as lr=2e-4x, a seed < 0): each run's config, as the loop below builds it,
    # with a stand-in for the start that is trained later (the smoke start has full attention)
    stand_in = Path(args.sft_dir) if args.sft_dir else Path(args.out_root, "smoke") if args.smoke else start.start_dir()
    for attention in args.attentions:
        for seed in args.seeds:
            try:
                grpo_config(stand_in, seed, Path(args.out_root), args.smoke, 1,
                            run_overrides(stand_in, attention, overrides))
            except train.ConfigError as err:
                p.error(f"GRPO config ({attention}, seed {seed}): {err}")

    root = repo_root()
    out_root = Path(args.out_root) if Path(args.out_root).is_absolute() else root / args.out_root
    if args.smoke:
        out_root = out_root / "smoke"
    threads = max(1, (os.cpu_count() or 2) // max(1, args.parallel))
    n_test = 4 if args.smoke else train.count_tasks("sinkflex/Retail-v0", "test")
    test_samples = min(args.test_samples, 2) if args.smoke else args.test_samples
    if args.measure:
        import torch

        torch.set_num_threads(threads)
        measure_run(Path(args.measure), test_samples, n_test)
        return 0
    if args.record_only:
        sft_dir = Path(args.sft_dir) if args.sft_dir else start.start_dir()
        missing = [str(d) for d in [sft_dir] + [run_dir_of(out_root, a, s) for a in args.attentions for s in args.seeds]
                   if not d.is_dir()]
        if missing:
            p.error(f"--record-only: no finished run in {', '.join(missing)}")
        return record(out_root, sft_dir, args.attentions, args.seeds, args.parallel, args.smoke, test_samples, n_test)
    if args.sft_dir:
        sft_dir = Path(args.sft_dir)
    elif args.smoke:  # a tiny two-stage SFT of a few steps: the pipeline, not a start
        sft_dir = run_sft(out_root, True, threads, not args.no_progress)
    elif args.train_start:
        sft_dir = start.build(out_root / "start", out_root / "start_work", threads, test_samples=test_samples,
                              screen_samples=args.screen_samples, progress=not args.no_progress,
                              lookup_stage=True, zip_stage=True, sink_stage=True, address_stage=True, payment_stage=True)
    elif not (start.start_dir() / "model.safetensors").is_file():
        p.error(f"{start.start_dir()} has no model.safetensors: restore it (git checkout -- data/retail-tiny-start) "
                "or train one with --train-start")
    else:
        sft_dir = start.start_dir()
    if args.screen_samples and "task_screen" not in overrides:
        if args.smoke:  # the smoke policy solves nothing: a screen would leave no task
            print("smoke: no screen of the training tasks", flush=True)
        else:
            screen = train.screen_or_reuse(sft_dir, out_root / "train_screen.csv", samples=args.screen_samples,
                                           progress=not args.no_progress)
            overrides["task_screen"] = os.path.relpath(screen, root)
    if args.no_progress:
        overrides["progress"] = "false"

    # Each run and each final test is its own process (clean state; --parallel at once), the two
    # attentions of a seed side by side, so that they share the machine alike.
    jobs = [("train", a, s) for s in args.seeds for a in args.attentions]
    if test_samples:
        jobs += [("test", a, s) for s in args.seeds for a in args.attentions]
    running, t0 = {}, time.perf_counter()
    while jobs or running:
        while jobs and len(running) < args.parallel:
            kind, attention, seed = jobs[0]
            run_dir = run_dir_of(out_root, attention, seed)
            if kind == "test" and any(k == "train" for k, _, _ in running):
                break  # a final test waits for every run to finish training
            jobs.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / f"{kind}.log", "a")
            if kind == "train":
                cfg = grpo_config(sft_dir, seed, run_dir, args.smoke, threads, run_overrides(sft_dir, attention, overrides))
                cfg_path = run_dir / "requested_config.json"
                cfg_path.write_text(json.dumps(cfg.to_dict(), indent=1))
                cmd = [sys.executable, "-m", "sinkflex_core.train", "--config", str(cfg_path)]
            else:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", str(run_dir),
                       "--parallel", str(args.parallel), "--test-samples", str(args.test_samples)] + \
                    (["--smoke"] if args.smoke else [])
            print(f"{attention} seed {seed}: {kind} (log {run_dir / f'{kind}.log'})", flush=True)
            running[(kind, attention, seed)] = (subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT),
                                                log, run_dir, time.perf_counter())
        time.sleep(2)
        for key, (proc, log, run_dir, started) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[key]
                now = time.perf_counter()
                print(f"{key[1]} seed {key[2]}: {key[0]} exit {proc.returncode} after {(now - started) / 60:.1f} min "
                      f"({(now - t0) / 60:.1f} min since the first run started)", flush=True)
                if proc.returncode != 0:
                    print((run_dir / f"{key[0]}.log").read_text()[-3000:], file=sys.stderr)
                    return proc.returncode

    return record(out_root, sft_dir, args.attentions, args.seeds, args.parallel, args.smoke, test_samples, n_test)


def paired_by_task(begin: pd.DataFrame, end: pd.DataFrame, run: str) -> pd.DataFrame:
    """The start's and a final policy's rows of the same held-out tasks side by side, sorted by task
    (the start's columns suffixed ``_start``). Refuses tables that do not hold one row per task of the
    same tasks: a pairing by position would then compare different tasks."""
    for name, table in (("the start's", begin), (f"{run}'s", end)):
        doubled = sorted(table.loc[table["task"].duplicated(), "task"].unique().tolist())
        if doubled:
            raise SystemExit(f"{name} test table has more than one row for tasks {doubled[:10]}")
    if set(begin["task"]) != set(end["task"]):
        only = sorted(set(begin["task"]) ^ set(end["task"]))
        raise SystemExit(f"the start's and {run}'s test tables hold different tasks (in one only: {only[:10]})")
    return end.merge(begin, on="task", suffixes=("", "_start"), validate="one_to_one").sort_values("task")


def record(out_root: Path, sft_dir: Path, attentions: list[str], seeds: list[int], parallel: int, smoke: bool,
           test_samples: int, n_test: int) -> int:
    """Write the data/ tables from the finished runs (nothing when ``smoke``) and print the summary:
    ``reward_curve.csv`` (every step of every run: training reward, update metrics, the evaluations
    logged while training) and ``reward_curve_test.csv`` (each run's start and final policy on the
    held-out tasks, one row per task)."""
    parts = start_histories(sft_dir)
    sft_extra = sft_summary(parts)
    if parts and not smoke:
        write_sft_table(parts)
    tables, tests = [], []
    for attention in attentions:
        begin = (start_test_rows(sft_dir, attention, test_samples, n_test, scratch=out_root / "start_measured")
                 if test_samples else None)
        for seed in seeds:
            run_dir = run_dir_of(out_root, attention, seed)
            screen = json.loads((run_dir / "config.json").read_text()).get("task_screen", "")
            tables.append(train.curve_table(run_dir, seed, attention=attention, parallel_runs=parallel,
                                            task_screen=Path(screen).name if screen else "", **sft_extra))
            if test_samples:
                end = pd.read_csv(run_dir / "test_rewards.csv", dtype={"policy_digest": str})
                both = paired_by_task(begin, end, f"{attention} seed {seed}")
                tests.append(pd.DataFrame({
                    "attention": attention, "seed": seed, "task": both["task"].to_numpy(),
                    "kind": both["kind"].to_numpy(),
                    "start_successes": both["successes_start"].to_numpy(),
                    "end_successes": both["successes"].to_numpy(), "tries": both["tries"].to_numpy(),
                    "start_rate": both["successes_start"].to_numpy() / both["tries_start"].to_numpy(),
                    "end_rate": both["successes"].to_numpy() / both["tries"].to_numpy(),
                    "start_policy": both["policy_digest_start"].to_numpy(),
                    "end_policy": both["policy_digest"].to_numpy(),
                    "start_attention": both["attention_start"].to_numpy(), "steps": int(tables[-1]["step"].max()),
                    **{k: end[k].iloc[0] for k in ("reward_version", "date", "git_sha", "hardware", "torch",
                                                   "transformers", "python") if k in end}}))
    full = pd.concat(tables, ignore_index=True)
    front = ["attention", "seed", "step"]
    full = full[front + [c for c in full.columns if c not in front]]
    if not smoke:
        full.to_csv(data_dir() / "reward_curve.csv", index=False)
    pd.set_option("display.width", 160)
    print("\ntraining reward (mean of the step's episodes), first and last step of each run:")
    for (attention, seed), g in full.groupby(["attention", "seed"], sort=False):
        g = g.dropna(subset=["reward_mean"]).sort_values("step")  # the row of step 0 is the first evaluation
        print(f"  {attention:8s} seed {seed}: {g['reward_mean'].iloc[0]:.3f} -> {g['reward_mean'].iloc[-1]:.3f} "
              f"({int(g['step'].max())} steps, {g['elapsed_s'].max() / 60:.1f} min)")
    if tests:
        test = pd.concat(tests, ignore_index=True)
        if not smoke:
            test.to_csv(data_dir() / "reward_curve_test.csv", index=False)
        gains = train.paired_gains(test)
        print(f"\nheld-out test reward, {n_test} tasks x {test_samples}, start -> end (paired bootstrap 95 % "
              f"interval of the gain over tasks):")
        print(gains.round(3).to_string(index=False))
        if set(ATTENTIONS) <= set(test["attention"]):
            d = train.gain_difference(test, "sinkflex", "sdpa")
            print(f"\nsinkflex gain - sdpa gain: {d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] "
                  f"(paper: {PAPER_START:.2f} -> {PAPER_END:.2f}, {PAPER_END - PAPER_START:+.2f})")
    if not smoke:
        print(f"written: {data_dir() / 'reward_curve.csv'}" + (" and reward_curve_test.csv" if tests else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
