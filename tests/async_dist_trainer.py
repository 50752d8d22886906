"""Asynchronous rollouts under torchrun, with a resume in the middle, for tests/test_async_rollouts.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/async_dist_trainer.py CONFIG.json

The first trainer trains ``FIRST`` steps and stops (its worker stopped with it, whatever it had sampled
ahead thrown away); a second trainer in the same processes resumes from the checkpoint and trains to the
end with a fresh worker. Every rank writes ``rank_R.json`` into ``out_dir``: per trained step, which of
the two trainers trained it, how many groups this rank trained on and their tasks; and a digest of its
whole weights at the end (the unsharded copy, refreshed from the FSDP shards after every update).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from sinkflex_core import train

FIRST = 1


def record(trainer: train.Trainer, run: int, out: list) -> None:
    """Note what ``next_rows`` hands this rank at every step (wraps the method of this one trainer)."""
    ar = trainer.async_rollouts
    next_rows = ar.next_rows

    def noted(step: int) -> dict:
        rows = next_rows(step)
        out.append({"step": step, "run": run, "groups": len(torch.unique(rows["group_ids"])),
                    "tasks": sorted({s["task_index"] for s in rows["stats"]})})
        return rows

    ar.next_rows = noted


if __name__ == "__main__":
    cfg = train.TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
    dist = train.init_distributed()
    try:
        steps: list = []
        first = train.Trainer(cfg, dist)
        record(first, 1, steps)
        first.run(max_steps=FIRST)
        resumed = train.Trainer(cfg, dist)
        record(resumed, 2, steps)
        resumed.run()
        digest = hashlib.sha256()
        for name, p in sorted(resumed.rollout_lm.named_parameters()):
            digest.update(name.encode() + p.detach().float().numpy().tobytes())
        Path(cfg.out_dir, f"rank_{dist.rank}.json").write_text(json.dumps(
            {"steps": steps, "weights": digest.hexdigest()}))
    finally:
        if dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
