"""The tasks of ``sinkflex/Bash-v0``: a file tree drawn from a seed, a request in English about it,
and how to grade the result.

A task is either a *question* (how many, which file, what sum: graded on the submitted answer) or a
*change* (rename, extract, archive, delete, move, replace, sort, chmod ...: graded on the final file
tree). Every task has its own tree; the same seed always gives the same tree, question and answer.
The expected final tree is computed here, in Python, from the initial one, never by running a shell.

A tree is a dict ``path -> (bytes, executable)`` of regular files (folders are implied by paths).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import random
import re
import stat
import tarfile
from functools import lru_cache
from pathlib import Path

N_TRAIN, N_TEST = 500, 100
_TEST_SEED0 = 1_000_000

FOLDERS = {"docs": ["txt", "md"], "logs": ["log"], "photos": ["jpeg", "png"], "src": ["py", "c", "h"],
           "data": ["csv", "json"], "notes": ["txt", "tmp"], "scripts": ["sh"], "music": ["mp3"],
           "reports": ["md", "csv"], "backup": ["bak", "tmp"]}
WORDS = ["alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "island", "jasper",
         "kernel", "lumen", "maple", "nectar", "orbit", "pixel", "quartz", "raven", "sierra", "tango",
         "umber", "vortex", "willow", "xenon", "yonder", "zephyr"]
CITIES = ["Austin", "Denver", "Seattle", "Boston", "Phoenix", "Chicago"]
LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"]
BINARY = {"jpeg", "png", "mp3"}

Tree = dict[str, tuple[bytes, bool]]


# ---- trees -----------------------------------------------------------------------------------------

def _content(rng: random.Random, ext: str) -> tuple[bytes, bool]:
    if rng.random() < 0.08 and ext not in ("csv", "sh"):
        return b"", False
    if ext in BINARY:
        return rng.randbytes(rng.randint(200, 4000)), False
    if ext == "log":
        lines = [f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
                 f"{rng.randint(0, 59):02d} {rng.choice(LEVELS)} {rng.choice(WORDS)} {rng.choice(WORDS)}"
                 for _ in range(rng.randint(5, 40))]
    elif ext == "csv":
        lines = ["name,city,amount"] + [f"{rng.choice(WORDS)},{rng.choice(CITIES)},{rng.randint(1, 999)}"
                                        for _ in range(rng.randint(3, 25))]
    elif ext == "sh":
        return f"#!/bin/sh\necho {rng.choice(WORDS)}\n".encode(), rng.random() < 0.3
    elif ext == "json":
        lines = ["{" + ", ".join(f'"{rng.choice(WORDS)}": {rng.randint(0, 99)}' for _ in range(3)) + "}"]
    else:
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(rng.randint(2, 30))]
    return ("\n".join(lines) + "\n").encode(), False


def make_tree(seed: int) -> Tree:
    """The initial file tree of a task seed: 3-5 folders (some with a sub-folder), 3-8 files each."""
    rng = random.Random(f"bash-tree-{seed}")
    tree: Tree = {}
    for folder in sorted(rng.sample(sorted(FOLDERS), rng.randint(3, 5))):
        places = [folder] + ([f"{folder}/{rng.choice(WORDS)}"] if rng.random() < 0.4 else [])
        for _ in range(rng.randint(3, 8)):
            ext = rng.choice(FOLDERS[folder])
            name = f"{rng.choice(places)}/{rng.choice(WORDS)}_{rng.randint(1, 99)}.{ext}"
            if name not in tree:
                tree[name] = _content(rng, ext)
    if rng.random() < 0.5:
        tree[f"readme_{rng.randint(1, 9)}.txt"] = _content(rng, "txt")
    return tree


def tar_bytes(files: Tree) -> bytes:
    """A reproducible ``.tar.gz`` of ``files`` (fixed times, owners and modes)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):
            data, exe = files[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o755 if exe else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def write_tree(tree: Tree, root: Path) -> None:
    for name, (data, exe) in tree.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(0o755 if exe else 0o644)


def read_tree(root: Path, max_entries: int = 5_000, max_file_bytes: int = 1 << 22) -> dict[str, tuple]:
    """The final state of a folder an untrusted command may have changed, without following links:
    ``path -> ("f", sha256, executable)`` for regular files, ``("l", target)`` for symlinks,
    ``("o",)`` for anything else. Folders are implied. Files past ``max_file_bytes`` hash their size only."""
    out: dict[str, tuple] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(root / rel if rel else root))
        except OSError:
            continue
        for entry in entries:
            if len(out) >= max_entries:
                return out
            name = f"{rel}/{entry.name}" if rel else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(name)
            elif stat.S_ISLNK(st.st_mode):
                out[name] = ("l", os.readlink(entry.path))
            elif stat.S_ISREG(st.st_mode):
                out[name] = ("f", _hash_file(entry.path, st.st_size, max_file_bytes), bool(st.st_mode & 0o100))
            else:
                out[name] = ("o",)
    return out


def _hash_file(path: str, size: int, cap: int) -> str:
    if size > cap:
        return f"size:{size}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "unreadable"
    with os.fdopen(fd, "rb") as f:
        return hashlib.sha256(f.read(cap)).hexdigest()


def tree_state(tree: Tree) -> dict[str, tuple]:
    """What :func:`read_tree` returns for a folder holding exactly ``tree``."""
    return {name: ("f", hashlib.sha256(data).hexdigest(), exe) for name, (data, exe) in tree.items()}


# ---- task families ---------------------------------------------------------------------------------
# Each family draws its parameters from a tree (or returns None when the tree does not suit it) and
# gives (question, answer) for questions or (question, expected_tree) for changes.

def _files(tree: Tree, folder: str | None = None, ext: str | None = None, direct: bool = False) -> list[str]:
    out = []
    for name in sorted(tree):
        head, _, base = name.rpartition("/")
        if folder is not None and not (head == folder if direct else name.startswith(folder + "/")):
            continue
        if ext is not None and not base.endswith("." + ext):
            continue
        out.append(name)
    return out


def _top(tree: Tree) -> list[str]:
    return sorted({n.split("/")[0] for n in tree if "/" in n})


def _exts(tree: Tree) -> list[str]:
    return sorted({n.rsplit(".", 1)[1] for n in tree})


def _lines(data: bytes) -> list[str]:
    return data.decode().splitlines()


def _count_ext(rng, tree):
    ext = rng.choice(_exts(tree))
    return f"How many files with the extension .{ext} are there in the sandbox, in all folders?", \
        str(len(_files(tree, ext=ext)))


def _grep_file(rng, tree):
    texts = [n for n in sorted(tree) if tree[n][0] and n.rsplit(".", 1)[1] not in BINARY]
    if not texts:
        return None
    target = rng.choice(texts)
    word = f"token{rng.randint(10_000, 99_999)}"
    data, exe = tree[target]
    lines = _lines(data)
    lines.insert(rng.randint(0, len(lines)), f"see {word} here")
    tree[target] = (("\n".join(lines) + "\n").encode(), exe)
    return f"Which file contains the word {word}? Answer with its path relative to the sandbox.", target


def _count_match(rng, tree):
    logs = [n for n in _files(tree, ext="log") if tree[n][0]]
    if not logs:
        return None
    path, level = rng.choice(logs), rng.choice(["ERROR", "WARN", "INFO"])
    n = sum(level in line for line in _lines(tree[path][0]))
    return f"How many lines of {path} contain {level}?", str(n)


def _largest(rng, tree):
    folder = rng.choice(_top(tree))
    sizes = sorted((len(tree[n][0]), n) for n in _files(tree, folder))
    if len(sizes) < 2 or sizes[-1][0] == sizes[-2][0]:
        return None
    return f"Which file under {folder}/ is the largest? Answer with its path relative to the sandbox.", sizes[-1][1]


def _sum_column(rng, tree):
    csvs = _files(tree, ext="csv")
    if not csvs:
        return None
    path = rng.choice(csvs)
    total = sum(int(line.split(",")[2]) for line in _lines(tree[path][0])[1:])
    return f"What is the sum of the amount column of {path}?", str(total)


def _line_count(rng, tree):
    texts = [n for n in sorted(tree) if n.rsplit(".", 1)[1] not in BINARY]
    path = rng.choice(texts)
    return f"How many lines does {path} have?", str(tree[path][0].count(b"\n"))


def _distinct_cities(rng, tree):
    csvs = _files(tree, ext="csv")
    if not csvs:
        return None
    path = rng.choice(csvs)
    n = len({line.split(",")[1] for line in _lines(tree[path][0])[1:]})
    return f"How many distinct values does the city column of {path} have?", str(n)


def _rename_ext(rng, tree):
    pairs = [(f, e) for f in _top(tree) for e in FOLDERS[f] if _files(tree, f, e, direct=True)]
    if not pairs:
        return None
    folder, ext = rng.choice(pairs)
    new = rng.choice([x for x in ("txt", "old", "dat", "jpg", "bak2") if x != ext])
    out = {(n[: -len(ext)] + new if n in _files(tree, folder, ext, direct=True) else n): v for n, v in tree.items()}
    return f"Rename every .{ext} file directly in {folder}/ so that its extension is .{new} instead.", out


def _extract(rng, tree):
    folder = rng.choice(_top(tree))
    members = {n[len(folder) + 1:]: tree[n] for n in _files(tree, folder)}
    archive, dest = f"{folder}_{rng.randint(1, 99)}.tar.gz", f"restore_{rng.choice(WORDS)}"
    tree[archive] = (tar_bytes(members), False)
    out = dict(tree)
    out.update({f"{dest}/{n}": v for n, v in members.items()})
    return f"Extract the archive {archive} into a new folder named {dest}.", out


def _archive(rng, tree):
    folder = rng.choice(_top(tree))
    name = f"{folder}_backup.tar.gz"
    return (f"Create a gzip-compressed tar archive {name} in the sandbox holding the folder {folder} "
            f"(member paths starting with {folder}/).", {"archive": name, "folder": folder})


def _delete_ext(rng, tree):
    ext = rng.choice(_exts(tree))
    return f"Delete every file whose name ends in .{ext}, in all folders.", \
        {n: v for n, v in tree.items() if not n.endswith("." + ext)}


def _move_match(rng, tree):
    folder = rng.choice(_top(tree))
    direct = _files(tree, folder, direct=True)
    word = rng.choice(sorted({n.rsplit("/", 1)[1].split("_")[0] for n in direct}))
    dest = f"{folder}_{word}"
    out = {(f"{dest}/{n.rsplit('/', 1)[1]}" if n in direct and word in n.rsplit("/", 1)[1] else n): v
           for n, v in tree.items()}
    return f"Move every file directly in {folder}/ whose name contains {word} into a new folder {dest}.", out


def _replace(rng, tree):
    texts = [n for n in sorted(tree) if n.endswith((".txt", ".md", ".log")) and tree[n][0]]
    if not texts:
        return None
    ext = rng.choice(sorted({n.rsplit(".", 1)[1] for n in texts}))
    old = rng.choice(sorted({w for n in texts if n.endswith(ext) for w in re.findall(r"[a-z]+", tree[n][0].decode())
                             if w in WORDS}))
    new = old.upper()
    out = {n: ((d.replace(old.encode(), new.encode()), e) if n.endswith("." + ext) else (d, e))
           for n, (d, e) in tree.items()}
    return f"In every .{ext} file, in all folders, replace each occurrence of {old} with {new}.", out


def _sort_unique(rng, tree):
    texts = [n for n in _files(tree, ext="txt") if tree[n][0]]
    if not texts:
        return None
    path = rng.choice(texts)
    out_name = f"sorted_{rng.randint(1, 99)}.txt"
    lines = sorted(set(_lines(tree[path][0])))
    return f"Write the distinct lines of {path}, sorted, into a file {out_name} in the sandbox.", \
        {**tree, out_name: (("\n".join(lines) + "\n").encode(), False)}


def _chmod(rng, tree):
    scripts = _files(tree, "scripts", "sh", direct=True)
    if not scripts:
        return None
    return "Make every .sh file directly in scripts/ executable.", \
        {n: ((d, True) if n in scripts else (d, e)) for n, (d, e) in tree.items()}


def _head(rng, tree):
    texts = [n for n in sorted(tree) if n.endswith((".log", ".txt")) and tree[n][0].count(b"\n") > 3]
    if not texts:
        return None
    path, k = rng.choice(texts), rng.randint(2, 5)
    out_name = f"first_{k}.txt"
    lines = _lines(tree[path][0])[:k]
    return f"Write the first {k} lines of {path} into a file {out_name} in the sandbox.", \
        {**tree, out_name: (("\n".join(lines) + "\n").encode(), False)}


def _delete_empty(rng, tree):
    if not any(not d for d, _ in tree.values()):
        return None
    return "Delete every empty file, in all folders.", {n: v for n, v in tree.items() if v[0]}


QUESTIONS = [_count_ext, _grep_file, _count_match, _largest, _sum_column, _line_count, _distinct_cities]
CHANGES = [_rename_ext, _extract, _archive, _delete_ext, _move_match, _replace, _sort_unique, _chmod, _head,
           _delete_empty]


def make_task(seed: int) -> dict:
    """The task of a seed: ``tree`` (initial), ``question``, ``kind`` and either ``answer`` or
    ``expected`` (a :func:`read_tree` state; for archives the archive's name and folder)."""
    rng = random.Random(f"bash-task-{seed}")
    while True:
        tree = make_tree(seed)
        family = rng.choice(QUESTIONS + CHANGES)
        made = family(rng, tree)
        if made is None:
            seed += 7_919  # another tree for this family-less draw; still a function of the seed
            continue
        question, target = made
        task = {"seed": seed, "family": family.__name__.strip("_"), "question": question, "tree": tree}
        if family in QUESTIONS:
            task.update(kind="question", answer=target)
        elif family is _archive:
            task.update(kind="archive", expected=target)
        else:
            task.update(kind="change", expected=tree_state(target))
        return task


@lru_cache(maxsize=2)
def bash_tasks(split: str) -> tuple:
    """The split's tasks (train and test draw from disjoint seed ranges)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    seeds = range(N_TRAIN) if split == "train" else range(_TEST_SEED0, _TEST_SEED0 + N_TEST)
    return tuple(make_task(s) for s in seeds)


# ---- grading ---------------------------------------------------------------------------------------

def normalise_answer(text: str) -> str:
    text = text.strip().strip("'\"").strip()
    while text.startswith("./"):
        text = text[2:]
    text = text.rstrip("/")
    try:
        value = float(text)
        return str(int(value)) if value.is_integer() else str(value)
    except ValueError:
        return text


def check_archive(root: Path, name: str, folder: str, initial: Tree, max_bytes: int = 16 << 20) -> tuple[bool, str]:
    """Whether ``root/name`` is a gzip tar holding exactly the files of ``folder`` of ``initial``
    (read with caps: never follows links, stops past ``max_bytes``)."""
    path = root / name
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return False, "no archive of that name (or not a regular file)"
        want = {n: d for n, (d, _) in initial.items() if n.startswith(folder + "/")}
        got: dict[str, bytes] = {}
        total = 0
        with tarfile.open(fileobj=io.BytesIO(path.read_bytes()), mode="r:gz") as tar:
            for member in tar:
                if len(got) > len(want) + 50:
                    return False, "too many members"
                if member.isfile():
                    total += member.size
                    if total > max_bytes:
                        return False, "members too large"
                    got[member.name.removeprefix("./")] = tar.extractfile(member).read()
        return got == want, "ok" if got == want else "the archive's files differ from the folder"
    except (OSError, tarfile.TarError, EOFError, ValueError, gzip.BadGzipFile) as err:
        return False, f"not a readable .tar.gz ({type(err).__name__})"
