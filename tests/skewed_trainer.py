"""A Trainer under torchrun whose rank 1 finishes its set-up SKEW seconds after rank 0 (a slower disk or
node), so that the ranks' clocks of the max_minutes budget start that far apart. Used by
tests/test_train_loop.py:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/skewed_trainer.py CONFIG.json SKEW
"""

from __future__ import annotations

import json
import sys
import time

import torch

from sinkflex_core import train

if __name__ == "__main__":
    cfg = train.TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
    dist = train.init_distributed()
    try:
        if dist.rank == 1:
            time.sleep(float(sys.argv[2]))
        train.Trainer(cfg, dist).run()
    finally:
        if dist.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
