"""Where the project's folders are: found from the working directory, so that notebooks (run from
``notebooks/``), tests and the command line all read and write the same ``data/`` and ``figures/``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The environment variable that puts the notebooks in smoke mode (the test suite sets it).
SMOKE_ENV = "SINKFLEX_SMOKE"


def _is_root(folder: Path) -> bool:
    return (folder / "pyproject.toml").is_file() and (folder / "notebooks").is_dir()


def repo_root(start: str | os.PathLike | None = None) -> Path:
    """``SINKFLEX_ROOT`` if set; else the nearest folder at or above ``start`` (default: the working
    directory) holding both ``pyproject.toml`` and ``notebooks/``; else the checkout this package was
    installed from (``pip install -e``), so that the shipped start and ``data/`` are found from any
    folder; else the working directory itself."""
    env = os.environ.get("SINKFLEX_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        if _is_root(folder):
            return folder
    installed_from = Path(__file__).resolve().parents[1]
    return installed_from if _is_root(installed_from) else here


def data_dir() -> Path:
    """``data/``: small inputs and measured results (CSV with provenance)."""
    path = repo_root() / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def figures_dir() -> Path:
    """``figures/``: PNGs regenerated from ``data/`` by the notebooks.

    In smoke mode (``SINKFLEX_SMOKE=1``, as the test suite runs the notebooks) this is a scratch copy,
    ``build/smoke/figures/``, seeded with the tracked figures: a smoke run reads and redraws figures
    there and never rewrites the repository's."""
    tracked = repo_root() / "figures"
    if not smoke_env():
        tracked.mkdir(parents=True, exist_ok=True)
        return tracked
    scratch = build_dir() / "smoke" / "figures"
    if not scratch.is_dir():
        scratch.parent.mkdir(parents=True, exist_ok=True)
        if tracked.is_dir():
            shutil.copytree(tracked, scratch, dirs_exist_ok=True)
        else:
            scratch.mkdir()
    return scratch


def smoke_env() -> bool:
    """Whether ``SINKFLEX_SMOKE`` asks for smoke mode (seconds per notebook, nothing tracked written)."""
    return os.environ.get(SMOKE_ENV, "0").strip().lower() in {"1", "true", "yes"}


def build_dir() -> Path:
    """``build/``: executed notebooks, caches and other outputs that git ignores."""
    path = repo_root() / "build"
    path.mkdir(parents=True, exist_ok=True)
    return path


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"
