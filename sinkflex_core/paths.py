"""Where the project's folders are: found from the working directory, so that notebooks (run from
``notebooks/``), tests and the command line all read and write the same ``data/`` and ``figures/``."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the working directory) holding both
    ``pyproject.toml`` and ``notebooks/``; the working directory itself if there is none."""
    env = os.environ.get("SINKFLEX_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir():
            return folder
    return here


def data_dir() -> Path:
    """``data/``: small inputs and measured results (CSV with provenance)."""
    path = repo_root() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def figures_dir() -> Path:
    """``figures/``: PNGs regenerated from ``data/`` by the notebooks."""
    path = repo_root() / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_dir() -> Path:
    """``build/``: executed notebooks, caches and other outputs that git ignores."""
    path = repo_root() / "build"
    path.mkdir(parents=True, exist_ok=True)
    return path


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"
