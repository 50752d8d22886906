"""The per-step metrics: their columns, and the log they go to (``metrics.csv``, pandas-readable,
and TensorBoard if installed)."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

METRIC_COLUMNS = [
    "step", "epoch", "tasks", "trajectories", "trajectories_updated", "reward_mean", "reward_std", "success_rate",
    "frac_groups_all_equal", "tokens_policy", "tokens_total", "turns_mean", "loss", "pg_loss", "kl",
    "entropy", "clip_frac", "ratio_mean", "ratio_max", "logp_gap_rollout", "grad_norm", "lr",
    "eval_reward", "eval_pass1", "eval_passk", "eval_k",
    "rollout_s", "update_s", "eval_s", "step_s", "elapsed_s",
]
TIMING_COLUMNS = ("rollout_s", "update_s", "eval_s", "step_s", "elapsed_s")
# async_rollouts and tis_cap (train.async_rollouts); empty in runs without them
METRIC_COLUMNS += ["staleness_mean", "staleness_max", "groups_dropped", "tis_clip_frac", "tis_weight_mean",
                   "rollout_worker_s"]
TIMING_COLUMNS += ("rollout_worker_s",)


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
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_COLUMNS)
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.path)

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


