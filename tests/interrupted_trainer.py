"""The scored trainer of scored_trainer.py, run as a script that can kill itself with SIGKILL at a
named point of one step, to test that a resumed run is the uninterrupted run (tests/test_train_loop.py):

    python tests/interrupted_trainer.py CONFIG.json [POINT STEP]

(:func:`run_script` runs it so from a test, with one thread.)

POINT is where the process dies while step STEP runs (or is saved):

- ``rollout``: inside the training rollouts, right after the first generate call (the turn sampled,
  the environments not yet stepped);
- ``update``: after the second optimizer step of the step (the weights and Adam moments already moved);
- ``save``: while the checkpoint is written: its model and optimizer files are in the temporary
  folder, the rest (trainer state, manifest) is not.

The hooks wrap public attributes of the trainer and torch.save, so they do not depend on how the
trainer's module is laid out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from scored_trainer import ScoredTrainer

from sinkflex_core.train import TrainConfig

POINTS = ("rollout", "update", "save")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(trainer: ScoredTrainer, point: str, at: int) -> None:
    """Make ``trainer`` kill its process at ``point`` of step ``at`` (1-based, as in metrics.csv)."""
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; one of {POINTS}")
    inside = {"step": False, "optimizer": 0}
    step = trainer.step

    def step_and_watch():
        inside["step"] = trainer.step_idx + 1 == at
        try:
            return step()
        finally:
            inside["step"] = False

    trainer.step = step_and_watch
    if point == "rollout":
        generate = trainer.backend.generate

        def generate_and_die(*args, **kwargs):
            out = generate(*args, **kwargs)
            if inside["step"]:
                _die()
            return out

        trainer.backend.generate = generate_and_die
    elif point == "update":
        def after_optimizer_step(*_):
            if inside["step"]:
                inside["optimizer"] += 1
                if inside["optimizer"] == 2:
                    _die()

        trainer.optimizer.register_step_post_hook(after_optimizer_step)
    else:
        save = torch.save

        def save_and_die(obj, f, *args, **kwargs):
            save(obj, f, *args, **kwargs)
            path = Path(f) if isinstance(f, (str, os.PathLike)) else None
            if path is not None and path.parent.name == f".tmp-step_{at:08d}" and path.name == "optimizer.pt":
                _die()

        torch.save = save_and_die


def run_script(args: list, timeout: int = 300) -> subprocess.CompletedProcess:
    """This script in a child process (from the repository root, one thread), its output captured."""
    return subprocess.run([sys.executable, str(Path(__file__).resolve()), *map(str, args)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def main(argv: list[str]) -> None:
    cfg = TrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
    trainer = ScoredTrainer(cfg)
    if len(argv) > 1:
        arm(trainer, argv[1], int(argv[2]))
    trainer.run()


if __name__ == "__main__":
    main(sys.argv[1:])
