"""Provenance columns for every measured result written to ``data/``: when, from which commit, on
what hardware, with which library versions and seed, so that a number in a figure can be traced."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess

from .paths import repo_root


def git_sha(short: bool = True) -> str:
    """The commit of the working tree (``+dirty`` when it has uncommitted changes); ``SINKFLEX_GIT_SHA``
    when set (a copied tree without ``.git``, e.g. on a GPU machine); ``unknown`` otherwise."""
    if os.environ.get("SINKFLEX_GIT_SHA"):
        return os.environ["SINKFLEX_GIT_SHA"]
    try:
        root = repo_root()
        cmd = ["git", "rev-parse", "--short", "HEAD"] if short else ["git", "rev-parse", "HEAD"]
        sha = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if sha and dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pin_git_sha() -> str:
    """Read the commit once, when a run starts, and name it in every result the run writes, and in
    the processes it starts (through ``SINKFLEX_GIT_SHA``). Read later, at write time, the column would
    name a commit made while a long run went on, not the code that ran. Kept when already set."""
    sha = git_sha()
    os.environ["SINKFLEX_GIT_SHA"] = sha
    return sha


def cpu_model() -> str:
    """The processor's name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def hardware(device: str | None = None) -> str:
    """``cuda:<name>`` for the first GPU, else ``cpu:<processor> x<threads>``; ``device="cpu"``: the
    CPU even when a GPU is present."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return f"cpu:{cpu_model()} x{torch.get_num_threads()}"


def provenance(seed: int | None = None, **extra) -> dict:
    """A dict of provenance columns to add to every row of a results table."""
    import torch
    import transformers

    row = {
        "date": _dt.date.today().isoformat(),
        "git_sha": git_sha(),
        "hardware": hardware(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        row["cuda"] = torch.version.cuda
    if seed is not None:
        row["seed"] = seed
    row.update(extra)
    return row
