"""Checkpoints that survive a crash at any moment: written to a temporary folder, fsynced, listed in a
manifest with sizes and SHA-256, renamed, and only then made ``latest``; plus the RNG states that make
a resumed run draw what the uninterrupted one would have."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .distributed import Dist

_CKPT_PREFIX = "step_"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | os.PathLike, step: int, payload: dict[str, Any], rank_payload: dict | None = None,
                    dist: Dist | None = None, keep: int = 2) -> Path:
    """Write ``payload`` (name -> object, saved with torch.save as ``name.pt``) as checkpoint ``step``.

    Crash safety: everything goes to ``.tmp-step_N`` first; files and folder are fsynced, a manifest
    with sizes and SHA-256 is written last, then the folder is renamed to ``step_N`` and the
    ``latest`` pointer is replaced atomically. Older checkpoints are removed only after that, so a
    process killed at any moment leaves the previous checkpoint intact and loadable.
    ``rank_payload`` is saved by every rank as ``rank{r}.pt`` (RNG states)."""
    dist = dist or Dist()
    root = Path(root)
    name = f"{_CKPT_PREFIX}{step:08d}"
    tmp = root / f".tmp-{name}"
    if dist.main:
        root.mkdir(parents=True, exist_ok=True)
        # Leftovers of a save that was killed: never complete, never loaded, safe to drop.
        for stale in root.iterdir():
            if stale.is_dir() and stale.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    files: list[Path] = []
    if rank_payload is not None:
        path = tmp / f"rank{dist.rank}.pt"
        torch.save(rank_payload, path)
        files.append(path)
    if dist.main:
        for key, obj in payload.items():
            path = tmp / f"{key}.pt"
            torch.save(obj, path)
            files.append(path)
    for path in files:
        _fsync_path(path)
    dist.barrier()
    final = root / name
    if dist.main:
        manifest = {"step": step, "world_size": dist.world,
                    "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "files": {p.name: {"bytes": p.stat().st_size, "sha256": file_digest(p)}
                              for p in sorted(tmp.iterdir())}}
        mpath = tmp / "manifest.json"
        mpath.write_text(json.dumps(manifest, indent=1))
        _fsync_path(mpath)
        _fsync_path(tmp)
        if final.exists():  # re-saving a step (after a resume): move the old copy aside first
            aside = root / f".old-{name}-{os.getpid()}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
        pointer = root / ".latest.tmp"
        pointer.write_text(name + "\n")
        _fsync_path(pointer)
        os.replace(pointer, root / "latest")
        _fsync_path(root)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (temporary folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_CKPT_PREFIX))


def verify_checkpoint(path: Path, check_hashes: bool = True) -> bool:
    """True when the folder has a manifest and every file it lists with the right size (and hash)."""
    mpath = path / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
        for fname, meta in manifest["files"].items():
            f = path / fname
            if not f.is_file() or f.stat().st_size != meta["bytes"]:
                return False
            if check_hashes and file_digest(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError):
        return False
    return True


def latest_checkpoint(root: str | os.PathLike, check_hashes: bool = True) -> Path | None:
    """The newest verified checkpoint: the ``latest`` pointer if valid, else the newest valid folder."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if cand.is_dir() and verify_checkpoint(cand, check_hashes):
            return cand
    for cand in reversed(list_checkpoints(root)):
        if verify_checkpoint(cand, check_hashes):
            return cand
    return None


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict[str, Any], dict | None]:
    """The payload objects (``name.pt`` -> name) and this rank's ``rank{r}.pt`` (None if absent)."""
    payload = {}
    for f in sorted(path.glob("*.pt")):
        if not f.stem.startswith("rank"):
            payload[f.stem] = torch.load(f, map_location="cpu", weights_only=False)
    rank_file = path / f"rank{rank}.pt"
    rank_payload = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.exists() else None
    return payload, rank_payload

