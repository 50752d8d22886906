"""Find, describe and run the tutorial notebooks headless (papermill).

Notebooks are ``notebooks/NN_name.ipynb``; they run in name order. Each has a cell tagged
``parameters`` with a ``smoke`` flag; the test suite sets ``SINKFLEX_SMOKE=1`` so that every notebook
takes seconds. Executed copies go to ``build/notebooks/`` (git ignores it); a notebook whose source,
library code and parameters have not changed since its last successful run is skipped.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import SMOKE_ENV, build_dir, notebooks_dir, repo_root, smoke_env

KERNEL_NAME = "sinkflex"
_NOTEBOOK_RE = re.compile(r"^\d\d_[\w-]+\.ipynb$")


def resolve_smoke(smoke: bool = False) -> bool:
    """A notebook's effective smoke flag: its ``smoke`` parameter, or ``SINKFLEX_SMOKE=1`` in the
    environment (how the test suite, which cannot pass parameters, makes notebooks fast). A true
    ``smoke`` is written to the environment too: :func:`~sinkflex_core.paths.figures_dir` reads only
    that, and a notebook run with ``-p smoke=True`` would otherwise redraw the tracked figures."""
    if smoke:
        os.environ[SMOKE_ENV] = "1"
    return bool(smoke) or smoke_env()


@dataclass(frozen=True)
class NotebookInfo:
    path: Path
    title: str
    summary: str
    parameters: dict

    @property
    def name(self) -> str:
        return self.path.name


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def parameters_of(nb: dict) -> dict:
    """The names and literal defaults assigned in the cell tagged ``parameters`` (``{}`` if none)."""
    import ast

    for cell in nb.get("cells", []):
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            params = {}
            for node in ast.parse(_source(cell)).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    try:
                        params[node.targets[0].id] = ast.literal_eval(node.value)
                    except ValueError:
                        params[node.targets[0].id] = ast.unparse(node.value)
            return params
    return {}


def describe(path: Path) -> NotebookInfo:
    """Title (first markdown heading) and summary (first paragraph after it) of a notebook."""
    nb = _read(path)
    title, summary = path.stem, ""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            lines = _source(cell).strip().splitlines()
            if lines and lines[0].startswith("#"):
                title = lines[0].lstrip("#").strip()
                paragraph = []
                for line in lines[1:]:
                    if not line.strip():
                        if paragraph:
                            break
                        continue
                    paragraph.append(line.strip())
                summary = " ".join(paragraph)
            break
    return NotebookInfo(path=path, title=title, summary=summary, parameters=parameters_of(nb))


def list_notebooks(folder: Path | None = None) -> list[NotebookInfo]:
    """Every ``NN_name.ipynb`` in ``notebooks/``, in run order."""
    folder = folder or notebooks_dir()
    return [describe(p) for p in sorted(folder.iterdir()) if _NOTEBOOK_RE.match(p.name)]


def _matches(name: str, ident: str) -> bool:
    """A notebook id: digits name the notebook of that number (``5`` and ``05`` are
    ``05_grpo_training.ipynb``, ``0`` is ``00_setup.ipynb``, not every notebook); anything else is a
    prefix of the file name (``05_grpo``)."""
    ident = ident.strip()
    if ident.isdecimal() and ident.isascii():  # "²" is a digit to isdigit(), not a number to int()
        return name[:2].isdigit() and int(name[:2]) == int(ident)
    return bool(ident) and name.startswith(ident)


def select(only: list[str] | None, notebooks: list[NotebookInfo] | None = None) -> list[NotebookInfo]:
    """The notebooks ``only`` names (all when it is empty), in run order. Raises ``ValueError`` naming
    every id that matches no notebook, so that a typo never silently skips a lesson."""
    notebooks = list_notebooks() if notebooks is None else notebooks
    if not only:
        return notebooks
    unknown = [o for o in only if not any(_matches(nb.name, o) for nb in notebooks)]
    if unknown:
        raise ValueError(f"no notebook matches {', '.join(map(repr, unknown))}; the notebooks are "
                         f"{', '.join(nb.name for nb in notebooks)} (`sinkflex notebooks list`)")
    return [nb for nb in notebooks if any(_matches(nb.name, o) for o in only)]


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean (True or False)"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction"
    if isinstance(value, (list, tuple)):
        return "a list"
    return "a string" if isinstance(value, str) else type(value).__name__


def _fits(default, value) -> bool:
    """Whether ``value`` can stand for a parameter whose default is ``default``."""
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            return False
        kinds = {type(d) for d in default}
        return len(kinds) != 1 or all(_fits(default[0], v) for v in value)
    return isinstance(value, type(default))


def check_parameters(notebooks: list[NotebookInfo], parameters: dict) -> None:
    """Refuse (``ValueError``) a parameter that none of ``notebooks`` declares, or whose value is not of
    the kind of a declaring notebook's default (``train_start='false'``, a string, where a boolean is
    declared), before anything runs: papermill would pass either on silently."""
    problems = []
    for name, value in parameters.items():
        declaring = [nb for nb in notebooks if name in nb.parameters]
        if not declaring:
            known = sorted({k for nb in notebooks for k in nb.parameters})
            problems.append(f"{name!r} is a parameter of none of the notebooks run "
                            f"({', '.join(nb.name for nb in notebooks)}); theirs: {', '.join(known)}")
            continue
        for nb in declaring:
            default = nb.parameters[name]
            if not _fits(default, value):
                hint = (" (write a list as a Python literal, e.g. -p \"name=['a', 'b']\")"
                        if isinstance(default, (list, tuple)) else "")
                problems.append(f"{name}={value!r} is {_kind(value)}, but {nb.name} declares "
                                f"{name} = {default!r}, {_kind(default)}{hint}")
                break
    if problems:
        raise ValueError("; ".join(problems))


def _library_digest() -> str:
    from .paths import files_digest

    return files_digest(Path(__file__).resolve().parent, {".py", ".json", ".md", ".jinja"})


def _kernel_name() -> str:
    """Our kernel, registered inside the venv by `make setup`; else the running interpreter."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        if KERNEL_NAME in KernelSpecManager().find_kernel_specs():
            return KERNEL_NAME
    except Exception:  # jupyter_client missing or broken: papermill will say so
        pass
    return "python3"


def _kernel_manager_class():
    """On POSIX, a kernel manager that talks to the kernel over Unix sockets in the temporary folder
    instead of TCP on localhost: no open port, and none of the kernel's warning that TCP traffic is not
    encrypted on every run. None elsewhere (papermill's default)."""
    if os.name != "posix":
        return None
    import tempfile
    import uuid

    from jupyter_client.manager import AsyncKernelManager
    from traitlets import Unicode, default

    class _UnixSocketKernelManager(AsyncKernelManager):
        transport = Unicode("ipc")

        @default("ip")
        def _ip_default(self):  # the path prefix of the kernel's sockets
            return os.path.join(tempfile.gettempdir(), f"sinkflex-kernel-{uuid.uuid4().hex[:12]}")

    return _UnixSocketKernelManager


class NotebookFailed(RuntimeError):
    """A notebook raised: names the notebook, the cell and where the executed copy is."""


def run_notebook(path: Path, parameters: dict | None = None, out_dir: Path | None = None,
                 smoke: bool | None = None, timeout: int | None = None, progress: bool = True) -> Path:
    """Execute one notebook with papermill; return the executed copy's path.

    Raises :class:`NotebookFailed` naming the failing cell."""
    import papermill as pm

    out_dir = out_dir or build_dir() / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    env_before = os.environ.get(SMOKE_ENV)
    if smoke is not None:
        os.environ[SMOKE_ENV] = "1" if smoke else "0"
    # No MPLBACKEND here: with none set, the kernel draws with matplotlib's inline backend, which needs
    # no display and keeps every figure in the executed copy (Agg would drop them from it).
    try:
        manager = _kernel_manager_class()
        pm.execute_notebook(str(path), str(out), parameters=parameters or {}, kernel_name=_kernel_name(),
                            cwd=str(path.parent), progress_bar=progress, execution_timeout=timeout,
                            log_output=False, **({"kernel_manager_class": manager} if manager else {}))
    except pm.PapermillExecutionError as err:
        first = (err.source or "").strip().splitlines()[:1]
        # papermill counts cells of the executed copy, which holds an injected parameters cell;
        # name the cell by its position in the notebook the user edits (0-based, like papermill).
        sources = [_source(c) for c in _read(path).get("cells", [])]
        index = sources.index(err.source) if err.source in sources else err.cell_index
        raise NotebookFailed(
            f"{path.name} failed in cell {index} (execution count {err.exec_count}): "
            f"{err.ename}: {err.evalue}\n"
            f"  cell starts: {first[0] if first else ''}\n"
            f"  executed copy with the full traceback: {os.path.relpath(out)}"
        ) from None
    finally:
        if smoke is not None:
            if env_before is None:
                os.environ.pop(SMOKE_ENV, None)
            else:
                os.environ[SMOKE_ENV] = env_before
    return out


def _fingerprint(path: Path, parameters: dict, smoke: bool) -> str:
    h = hashlib.sha256(path.read_bytes())
    h.update(_library_digest().encode())
    h.update(json.dumps({"params": parameters, "smoke": smoke}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def reproduce(only: list[str] | None = None, parameters: dict | None = None, smoke: bool = False,
              force: bool = False, out_dir: Path | None = None, stream=sys.stdout) -> int:
    """Run the notebooks in order (all, or those ``only`` names: numbers or name prefixes, :func:`select`).

    Prints which notebook runs and how long it took; stops at the first failure with a message
    naming the notebook and cell. Returns a process exit code."""
    parameters = parameters or {}
    try:
        notebooks = select(only)
        check_parameters(notebooks, parameters)
    except ValueError as err:
        print(f"sinkflex reproduce: {err}", file=sys.stderr)
        return 2
    smoke = smoke or parameters.get("smoke") is True  # `-p smoke=True` is --smoke
    # smoke copies apart from a full run's, so that a smoke run never makes the next full run start over
    out_dir = out_dir or build_dir() / ("smoke/notebooks" if smoke else "notebooks")
    t_all = time.perf_counter()
    ran = 0
    for i, nb in enumerate(notebooks, 1):
        params = {k: v for k, v in parameters.items() if k in nb.parameters}
        stamp = out_dir / (nb.path.stem + ".done")
        fp = _fingerprint(nb.path, params, smoke)
        if not force and stamp.exists() and stamp.read_text() == fp and (out_dir / nb.name).exists():
            print(f"[{i}/{len(notebooks)}] {nb.name}: unchanged since its last run, skipped", file=stream)
            continue
        print(f"[{i}/{len(notebooks)}] {nb.name}: {nb.title}", file=stream, flush=True)
        t0 = time.perf_counter()
        try:
            out = run_notebook(nb.path, params, out_dir, smoke=smoke, progress=stream.isatty())
        except NotebookFailed as err:
            print(f"FAILED after {time.perf_counter() - t0:.1f} s: {err}", file=stream, flush=True)
            stamp.unlink(missing_ok=True)
            return 1
        stamp.write_text(fp)
        ran += 1
        print(f"    done in {time.perf_counter() - t0:.1f} s -> {os.path.relpath(out, repo_root())}",
              file=stream, flush=True)
    skipped = len(notebooks) - ran
    where = ("figures in build/smoke/figures/ (smoke mode writes nothing tracked)" if smoke
             else "figures in figures/, results in data/")
    print(f"{ran} of {len(notebooks)} notebooks ran in {time.perf_counter() - t_all:.1f} s"
          f"{f' ({skipped} unchanged, skipped)' if skipped else ''}; executed copies in "
          f"{os.path.relpath(out_dir, repo_root())}/, {where}", file=stream)
    return 0


def store_outputs(path: Path) -> None:
    """Execute a notebook in smoke mode and write it back in place with its outputs, so that nbval
    has stored outputs to compare the cells marked ``nbval-check-output`` against."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = run_notebook(path, {}, Path(tmp), smoke=True, progress=False)
        nb = _read(out)
    path.write_text(json.dumps(scrub(nb), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def scrub(nb: dict) -> dict:
    """Make an executed notebook fit to commit: drop papermill's per-cell timings and stderr output
    (warnings name this machine's paths and are never compared), join a cell's consecutive stdout
    pieces into one output (the kernel sends a stream in as many pieces as it flushed), and write the
    repository root in any remaining output as ``.``."""
    # the root as a whole path only, not the start of a sibling (`repo-old/`, `repo.bak/`) or the end of
    # another path; a full stop after it ends a sentence
    root = re.compile(r"(?<![\w.-])" + re.escape(str(repo_root())) + r"(?![\w-]|\.\w)")
    nb.get("metadata", {}).pop("papermill", None)
    nb.setdefault("metadata", {})["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                                   "name": "python3"}
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("papermill", None)
        cell.get("metadata", {}).pop("execution", None)
        if cell.get("metadata", {}).get("tags") == []:  # papermill's, on every cell
            del cell["metadata"]["tags"]
        if cell.get("cell_type") != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                continue
            out = json.loads(root.sub(".", json.dumps(out)))
            if out.get("output_type") == "stream" and outputs and outputs[-1].get("output_type") == "stream":
                joined = "".join(outputs[-1]["text"]) + "".join(out["text"])
                outputs[-1]["text"] = joined.splitlines(keepends=True)
                continue
            outputs.append(out)
        cell["outputs"] = outputs
    return nb


def render_html(out_dir: Path | None = None, only: list[str] | None = None) -> list[Path]:
    """Render the stored lessons (with the outputs of their recorded run) to standalone HTML pages,
    plus an ``index.html`` linking them, so they can be shared without a Jupyter server. A lesson's
    solutions script (``notebooks/solutions/NN_name.py``) becomes ``solutions/NN_name.html``.

    Nothing is executed: the pages show what the repository's notebooks carry."""
    from nbconvert import HTMLExporter

    out_dir = out_dir or build_dir() / "docs"
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder for the pages")
    out_dir.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter()
    pages, links = [], []
    for info in select(only):
        body, _ = exporter.from_filename(str(info.path))
        solutions = info.path.parent / "solutions" / (info.path.stem + ".py")
        if solutions.is_file():  # the lesson links its script; the pages link the script's page
            body = body.replace(f'href="solutions/{solutions.name}"', f'href="solutions/{solutions.stem}.html"')
        page = out_dir / (info.path.stem + ".html")
        page.write_text(body, encoding="utf-8")
        pages.append(page)
        link = f'<li><a href="{page.name}">{html.escape(info.title)}</a>: {html.escape(info.summary)}'
        if solutions.is_file():
            pages.append(_solutions_page(solutions, exporter, out_dir / "solutions"))
            link += f' (<a href="solutions/{pages[-1].name}">solutions to its exercises</a>)'
        links.append(link + "</li>")
    index = out_dir / "index.html"
    index.write_text("<!doctype html>\n<meta charset=\"utf-8\">\n<title>sinkflex lessons</title>\n"
                     "<h1>sinkflex lessons</h1>\n<ol>\n" + "\n".join(links) + "\n</ol>\n", encoding="utf-8")
    return [index, *pages]


def _solutions_page(script: Path, exporter, out_dir: Path) -> Path:
    """A solutions script (jupytext percent format) as an HTML page, converted, not executed: its cells
    print the answers when a student runs them, and the page shows the code and what to conclude."""
    import jupytext

    out_dir.mkdir(parents=True, exist_ok=True)
    body, _ = exporter.from_notebook_node(jupytext.read(script, fmt="py:percent"))
    page = out_dir / (script.stem + ".html")
    page.write_text(body, encoding="utf-8")
    return page
