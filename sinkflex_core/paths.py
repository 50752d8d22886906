"""Where the project's folders are: found from the working directory, so that notebooks (run from
``notebooks/``), tests and the command line all read and write the same ``data/`` and ``figures/``."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file name beside ``path`` to write to; when the block ends without an error the file
    is moved onto ``path`` in one step (``os.replace``), else removed. A reader sees the old file or the
    whole new one, never a half-written one (a run cut off mid-write, a rank resuming while another
    writes). The name is new on every call, so two writers of one path (two processes, or two workers of
    a test run) never write into the same temporary file: the last to finish wins, whole.

        with atomic_path(out / "table.csv") as tmp:
            frame.to_csv(tmp, index=False)
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def files_digest(folder: str | os.PathLike, suffixes: set[str]) -> str:
    """A sha256 hex digest of the files under ``folder`` whose suffix is in ``suffixes``: each one's path
    relative to ``folder`` and its bytes, in sorted order."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix in suffixes:
            h.update(str(path.relative_to(folder)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()
