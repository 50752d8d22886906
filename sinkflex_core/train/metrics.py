"""The per-step metrics: their columns, and the log they go to (``metrics.csv``, pandas-readable,
and TensorBoard if installed)."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from ..paths import atomic_path

METRIC_COLUMNS = [
    "step", "epoch", "tasks", "trajectories", "trajectories_updated", "reward_mean", "reward_std", "success_rate",
    "frac_groups_all_equal", "tokens_policy", "tokens_total", "turns_mean", "loss", "pg_loss", "kl",
    "entropy", "clip_frac", "ratio_mean", "ratio_max", "logp_gap_rollout", "rollout_clip_frac",
    "grad_norm", "lr",
    "eval_reward", "eval_pass1", "eval_passk", "eval_k",
    "rollout_s", "update_s", "eval_s", "step_s", "elapsed_s",
]
# What each column means (the metric list; ``sinkflex train --help`` lists the config keys instead).
METRIC_HELP = {
    "step": "GRPO step (0: the evaluation before training)",
    "epoch": "passes over the training tasks so far",
    "tasks": "tasks sampled this step",
    "trajectories": "episodes rolled out this step",
    "trajectories_updated": "episodes the update ran on (drop_uniform_groups leaves out groups of equal rewards)",
    "reward_mean": "mean training reward of the step's episodes",
    "reward_std": "their standard deviation",
    "success_rate": "share of episodes with reward 1",
    "frac_groups_all_equal": "share of groups whose rewards are all equal (advantage 0: no signal)",
    "tokens_policy": "tokens the policy generated (the ones the loss covers)",
    "tokens_total": "all tokens of the step's episodes",
    "turns_mean": "assistant turns per episode",
    "loss": "total loss, mean over optimizer steps",
    "pg_loss": "clipped policy-gradient loss, mean over optimizer steps",
    "kl": "KL to the reference policy (kl_kind), mean over optimizer steps",
    "entropy": "mean entropy of the policy's token distributions",
    "clip_frac": "share of policy tokens whose clipped branch of the PPO loss is active, over all updates",
    "ratio_mean": "mean ratio pi / pi_old over all updates",
    "ratio_max": "largest ratio pi / pi_old",
    "logp_gap_rollout": "sampler/trainer mismatch: mean |logp_sampler - logp_trainer| over the policy tokens "
                        "the trainer scores before its first optimizer step of the step (same weights: any gap "
                        "is the sampler computing a different distribution, e.g. another attention, cache or "
                        "summation order)",
    "rollout_clip_frac": "at the same tokens, the share whose ratio exp(logp_trainer - logp_sampler) is outside "
                         "the clip band [1 - clip_low, 1 + clip_high]: tokens the first update already clips "
                         "before learning anything",
    "grad_norm": "gradient norm before clipping, mean over optimizer steps",
    "lr": "learning rate after the step",
    "eval_reward": "mean reward on the held-out tasks (evaluation steps only)",
    "eval_pass1": "pass^1 on the held-out tasks",
    "eval_passk": "pass^k, k = eval_k",
    "eval_k": "samples per held-out task",
    "rollout_s": "seconds of the step's rollouts",
    "update_s": "seconds of its update (reference log-probs included)",
    "eval_s": "seconds of the evaluation",
    "step_s": "seconds of the whole step",
    "elapsed_s": "seconds since the run started (over resumes)",
    # async_rollouts and tis_cap (train.async_rollouts, docs/async_rollouts.md); empty in runs without them
    "staleness_mean": "updates between the weights a group was sampled with and those it was trained at, mean",
    "staleness_max": "the same, largest over the step's groups",
    "groups_dropped": "groups found older than max_staleness and sampled again",
    "tis_clip_frac": "share of the policy tokens whose behaviour weight was truncated at tis_cap",
    "tis_weight_mean": "mean behaviour weight over the policy tokens, after truncation",
    "rollout_worker_s": "the worker's own rollout time for the step's groups (rollout_s is the learner's wait for them)",
    "step_start_s": "elapsed_s when the step began: its rollouts (or the wait for them) then its update follow "
                    "(train.step_timeline)",
}
TIMING_COLUMNS = ("rollout_s", "update_s", "eval_s", "step_s", "elapsed_s")
# async_rollouts and tis_cap (train.async_rollouts); empty in runs without them
METRIC_COLUMNS += ["staleness_mean", "staleness_max", "groups_dropped", "tis_clip_frac", "tis_weight_mean",
                   "rollout_worker_s"]
TIMING_COLUMNS += ("rollout_worker_s",)
# the step's place on the elapsed_s clock: with rollout_s and update_s, the learner's timeline
METRIC_COLUMNS += ["step_start_s"]
TIMING_COLUMNS += ("step_start_s",)


class MetricsLog:
    """``metrics.csv`` in the run folder; on resume rows after the checkpoint's step are dropped so
    that the file reads as if the run had never stopped."""

    def __init__(self, path: Path, enabled: bool = True, tensorboard_dir: Path | None = None):
        self.path, self.enabled = Path(path), enabled
        self.tb = None
        if enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except Exception:  # tensorboard not installed: the CSV is the log
                self.tb = None

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        with open(self.path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        with atomic_path(self.path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
            w.writeheader()
            w.writerows(rows)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow({k: _fmt(row.get(k)) for k in METRIC_COLUMNS})
            f.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return str(v)


def step_timeline(run_dir: str | os.PathLike):
    """What the learner and the rollout worker of a run did when, from its ``metrics.csv`` (and, for a run
    with ``async_rollouts``, ``rollout_groups.jsonl``): one row per span, with ``lane`` ("learner" or
    "worker"), ``activity`` ("rollout", "wait" for the worker's rollouts, "update", "evaluation"),
    ``step`` and ``start`` / ``end`` in seconds on the run's ``elapsed_s`` clock. Steps logged without
    ``step_start_s`` (runs from before it was recorded) are left out."""
    import json

    import pandas as pd

    run_dir = Path(run_dir)
    metrics = pd.read_csv(run_dir / "metrics.csv")
    groups = run_dir / "rollout_groups.jsonl"
    spans = {}
    if groups.is_file():
        for line in groups.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                spans[entry["step"]] = entry.get("worker_spans") or []
    learner_rollout = "wait" if groups.is_file() else "rollout"
    rows = []
    for r in metrics.itertuples(index=False):
        eval_s = r.eval_s if pd.notna(r.eval_s) else 0.0
        if r.step == 0:
            if eval_s:
                rows.append(("learner", "evaluation", 0, r.elapsed_s - eval_s, r.elapsed_s))
            continue
        if "step_start_s" not in metrics or pd.isna(r.step_start_s):
            continue
        t = r.step_start_s
        rows.append(("learner", learner_rollout, r.step, t, t + r.rollout_s))
        rows.append(("learner", "update", r.step, t + r.rollout_s, t + r.rollout_s + r.update_s))
        if eval_s:
            end = t + r.rollout_s + r.update_s
            rows.append(("learner", "evaluation", r.step, end, end + eval_s))
        rows += [("worker", "rollout", r.step, a, b) for a, b in spans.get(r.step, [])]
    return pd.DataFrame(rows, columns=["lane", "activity", "step", "start", "end"])
