"""A Trainer whose training rollouts are real but whose rewards are set by the test: the first
trajectory of the first task on rank 0 scores 1, every other one 0, so that exactly one group has a
reward signal (a random tiny policy never solves a task). Used by tests/test_train_loop.py, in process
and as a script under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scored_trainer.py CONFIG.json
"""

from __future__ import annotations

import json
import sys

import torch

from sinkflex_core import train
from sinkflex_core.rollout import RolloutBatch


class ScoredTrainer(train.Trainer):
    keep_signal_group_only = False  # True: the training batch is that one group, nothing else

    def _collect(self, tasks, split, group_size, temperature, seed_key):
        batches = super()._collect(tasks, split, group_size, temperature, seed_key)
        if seed_key[0] != "train":
            return batches
        trajectories = [t for b in batches for t in b.trajectories]
        first = min(t.group for t in trajectories)
        for t in trajectories:
            t.reward = 0.0
        if self.dist.rank == 0:
            next(t for t in trajectories if t.group == first).reward = 1.0
            if self.keep_signal_group_only:
                trajectories = [t for t in trajectories if t.group == first]
        return [RolloutBatch.from_trajectories(trajectories, pad_token_id=batches[0].pad_token_id)]


if __name__ == "__main__":
    cfg = train.TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
    dist = train.init_distributed()
    try:
        ScoredTrainer(cfg, dist).run()
    finally:
        if dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
