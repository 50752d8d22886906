"""The project's scaffolding: notebook discovery and conventions, the runner, the CLI, packaging."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from sinkflex_core.notebooks import list_notebooks, parameters_of, resolve_smoke

ROOT = Path(__file__).resolve().parents[1]


def _nb(cells: list[tuple[str, str, list[str]]]) -> dict:
    out = []
    for kind, src, tags in cells:
        cell = {"cell_type": kind, "metadata": {"tags": tags} if tags else {}, "source": src}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        out.append(cell)
    return {"cells": out, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def test_notebooks_found_in_order_and_follow_conventions():
    notebooks = list_notebooks(ROOT / "notebooks")
    names = [nb.name for nb in notebooks]
    assert names and names[0] == "00_setup.ipynb"
    assert names == sorted(names)
    for nb in notebooks:
        number = nb.name[:2]
        assert nb.title.startswith(number), f"{nb.name}: first heading should start with {number}"
        assert nb.summary, f"{nb.name}: needs a summary paragraph under its title"
        assert "smoke" in nb.parameters, f"{nb.name}: its `parameters` cell must define smoke"
        assert nb.parameters["smoke"] is False, f"{nb.name}: smoke must default to False"
        raw = json.loads(nb.path.read_text())
        sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in raw["cells"]]
        assert any("resolve_smoke(smoke)" in s for s in sources), f"{nb.name}: must call resolve_smoke(smoke)"


def test_parameters_of_reads_literals_only_from_tagged_cell():
    nb = _nb([("code", "smoke = True", []), ("code", "smoke = False\nseed = 3\npreset = 'tiny-cpu'", ["parameters"])])
    assert parameters_of(nb) == {"smoke": False, "seed": 3, "preset": "tiny-cpu"}
    assert parameters_of(_nb([("code", "x = 1", [])])) == {}


def test_resolve_smoke_reads_environment(monkeypatch):
    monkeypatch.setenv("SINKFLEX_SMOKE", "0")
    assert resolve_smoke(False) is False
    assert resolve_smoke(True) is True
    monkeypatch.setenv("SINKFLEX_SMOKE", "1")
    assert resolve_smoke(False) is True


def test_smoke_parameter_keeps_figures_off_the_tracked_ones(tmp_path, monkeypatch):
    """A notebook run with its smoke parameter set (`sinkflex reproduce -p smoke=True`, papermill's
    `-p smoke True`) and no SINKFLEX_SMOKE draws its figures in the scratch copy, as --smoke does."""
    from sinkflex_core.paths import figures_dir

    root = _fake_project(tmp_path, {})
    monkeypatch.setenv("SINKFLEX_ROOT", str(root))
    monkeypatch.delenv("SINKFLEX_SMOKE", raising=False)
    assert figures_dir() == root / "figures"
    assert resolve_smoke(True) is True
    assert figures_dir() == root / "build" / "smoke" / "figures"
    # and `sinkflex reproduce -p smoke=True` runs as --smoke: executed copies apart from a full run's
    import io

    from sinkflex_core import notebooks

    (tmp_path / "p").mkdir()
    _fake_project(tmp_path / "p", {"00_a.ipynb": [("code", "smoke = False", ["parameters"])]})
    monkeypatch.setenv("SINKFLEX_ROOT", str(tmp_path / "p"))
    ran = []

    def run_notebook(path, params, out_dir, smoke, progress):
        ran.append((out_dir, smoke))
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir / path.name

    monkeypatch.setattr(notebooks, "run_notebook", run_notebook)
    out = io.StringIO()
    assert notebooks.reproduce(parameters={"smoke": True}, stream=out) == 0
    assert ran == [(tmp_path / "p" / "build" / "smoke" / "notebooks", True)]
    assert "smoke mode writes nothing tracked" in out.getvalue()


def _fake_project(tmp_path: Path, cells_by_name: dict[str, list]) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\n")
    (tmp_path / "notebooks").mkdir()
    for name, cells in cells_by_name.items():
        (tmp_path / "notebooks" / name).write_text(json.dumps(_nb(cells)))
    return tmp_path


def _sinkflex(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SINKFLEX_ROOT=str(cwd))
    return subprocess.run([sys.executable, "-m", "sinkflex_core", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_reproduce_runs_in_order_skips_unchanged_and_names_failing_cell(tmp_path):
    title = ("markdown", "# {n} · Title\n\nWhat it does.", [])
    params = ("code", "smoke = False\nvalue = 1", ["parameters"])
    root = _fake_project(tmp_path, {
        "00_ok.ipynb": [title, params, ("code", "open('../made.txt', 'w').write(str(value))", [])],
        "01_bad.ipynb": [title, params, ("code", "x = 1", []), ("code", "raise ValueError('broken on purpose')", [])],
        "02_never.ipynb": [title, params, ("code", "open('../never.txt', 'w').write('ran')", [])],
    })
    first = _sinkflex(["reproduce", "-p", "value=7"], root)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "[1/3] 00_ok.ipynb" in first.stdout
    assert "01_bad.ipynb failed in cell 3" in first.stdout
    assert "ValueError: broken on purpose" in first.stdout
    assert (root / "made.txt").read_text() == "7"          # the parameter reached the notebook
    assert not (root / "never.txt").exists()               # stopped at the first failure
    assert (root / "build" / "notebooks" / "01_bad.ipynb").exists()

    second = _sinkflex(["reproduce", "--only", "00", "-p", "value=7"], root)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "unchanged since its last run, skipped" in second.stdout
    assert "0 of 1 notebooks ran" in second.stdout and "(1 unchanged, skipped)" in second.stdout
    # a smoke run keeps its executed copies apart: the full run's copy and stamp stay as they were
    smoke = _sinkflex(["reproduce", "--only", "00", "--smoke"], root)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert (root / "build" / "smoke" / "notebooks" / "00_ok.ipynb").exists()
    assert "1 of 1 notebooks ran" in smoke.stdout and "smoke mode writes nothing tracked" in smoke.stdout
    third = _sinkflex(["reproduce", "--only", "00", "-p", "value=7"], root)
    assert "unchanged since its last run, skipped" in third.stdout, third.stdout


@pytest.mark.slow
def test_reproduce_keeps_a_notebooks_figures_in_its_executed_copy(tmp_path):
    """Headless and with no MPLBACKEND set, the kernel draws with matplotlib's inline backend: a figure
    that a notebook shows is stored in the executed copy (a forced Agg backend would drop it)."""
    root = _fake_project(tmp_path, {"00_plot.ipynb": [
        ("markdown", "# 00 · A figure\n\nOne line, plotted.", []),
        ("code", "smoke = False", ["parameters"]),
        ("code", "import matplotlib.pyplot as plt\n\nplt.plot([0, 1], [1, 0])\nplt.show()", []),
    ]})
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DISPLAY", "WAYLAND_DISPLAY")}
    run = subprocess.run([sys.executable, "-m", "sinkflex_core", "reproduce"], cwd=root,
                         env=dict(env, SINKFLEX_ROOT=str(root)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    if os.name == "posix":  # the kernel is reached over Unix sockets: no open port, no warning about one
        assert "without encryption" not in run.stdout + run.stderr
    executed = json.loads((root / "build" / "notebooks" / "00_plot.ipynb").read_text())
    shown = [out for cell in executed["cells"] if cell["cell_type"] == "code" for out in cell["outputs"]]
    assert any("image/png" in out.get("data", {}) for out in shown), shown


def test_cli_lists_notebooks():
    out = subprocess.run([sys.executable, "-m", "sinkflex_core", "notebooks", "list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for nb in list_notebooks(ROOT / "notebooks"):
        assert nb.name in out.stdout


def test_cli_rejects_unknown_notebook_prefix(tmp_path):
    root = _fake_project(tmp_path, {"00_a.ipynb": [("code", "smoke = False", ["parameters"])]})
    out = _sinkflex(["reproduce", "--only", "99"], root)
    assert out.returncode == 2
    assert "no notebook matches" in out.stderr


def test_reproduce_refuses_unknown_ids_and_parameters_before_running_anything(tmp_path):
    made = "open('../ran_' + __import__('os').path.basename(__import__('os').getcwd()), 'a').write('x')"
    root = _fake_project(tmp_path, {
        "00_a.ipynb": [("code", "smoke = False\nflag = False", ["parameters"]), ("code", made, [])],
        "01_b.ipynb": [("code", "smoke = False\nsizes = [1, 2]\nrate = 0.5", ["parameters"])],
        "10_c.ipynb": [("code", "smoke = False", ["parameters"])],
    })
    refused = {
        ("--only", "00", "7"): "'7'",  # one id of two matches nothing: refused, not half run
        ("--only", "²"): "no notebook matches '²'",  # a digit to str.isdigit, not a number
        ("--only", "01", "-p", "flag=True"): "'flag' is a parameter of none",  # declared by 00 only
        ("-p", "flga=True"): "'flga' is a parameter of none",
        ("-p", "flag=yes"): "flag='yes' is a string, but 00_a.ipynb declares flag = False",
        ("--only", "01", "-p", "sizes=[1.5]"): "sizes=[1.5] is a list, but 01_b.ipynb declares sizes = [1, 2]",
        ("-p", "sizes=a,b"): "write a list as a Python literal",
        ("-p", "sizes=['a']"): "sizes=['a'] is a list, but 01_b.ipynb",
        ("-p", "rate=fast"): "rate='fast' is a string",
    }
    for args, message in refused.items():
        out = _sinkflex(["reproduce", *args], root)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
    assert not list(root.glob("ran_*")) and not (root / "build" / "notebooks").exists()


def test_docs_refuses_an_out_that_is_a_file(tmp_path):
    taken = tmp_path / "README.md"
    taken.write_text("kept\n")
    out = _sinkflex(["docs", "--out", str(taken)], tmp_path)
    assert out.returncode == 2 and "is a file" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert taken.read_text() == "kept\n"


def test_notebook_ids_are_numbers_or_name_prefixes_and_parameters_read_shell_words(tmp_path):
    from sinkflex_core.cli import _parse_param
    from sinkflex_core.notebooks import check_parameters, select

    root = _fake_project(tmp_path, {name: [("code", "smoke = False\nrate = 0.5", ["parameters"])]
                                    for name in ("00_a.ipynb", "01_b.ipynb", "10_c.ipynb")})
    found = list_notebooks(root / "notebooks")
    names = lambda only: [nb.name for nb in select(only, found)]  # noqa: E731
    assert names(["0"]) == names(["00"]) == ["00_a.ipynb"]  # not every notebook whose name starts with 0
    assert names(["1", "10"]) == ["01_b.ipynb", "10_c.ipynb"]
    assert names(["01_b"]) == ["01_b.ipynb"] and len(names(None)) == 3
    with pytest.raises(ValueError, match="'2'"):
        select(["2"], found)
    assert _parse_param("train_start=false") == ("train_start", False)
    assert _parse_param("x=None") == ("x", None) and _parse_param("x=TRUE") == ("x", True)
    assert _parse_param("tokens=[512, 1024]") == ("tokens", [512, 1024])
    assert _parse_param("preset=tiny-cpu") == ("preset", "tiny-cpu")
    check_parameters(found, {"rate": 1, "smoke": True})  # an int where a float is declared is fine
    with pytest.raises(ValueError, match="a boolean"):
        check_parameters(found, {"rate": True})


def test_cli_test_hands_pytest_options_to_pytest(monkeypatch):
    from sinkflex_core import cli

    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    monkeypatch.setattr(cli, "_changed_files", lambda root: {})
    for argv, extra in ((["--no-notebooks", "-k", "resume", "-x"], ["-k", "resume", "-x"]),
                        (["-x", "tests/test_grpo.py"], ["-x", "tests/test_grpo.py"]),
                        (["--", "-k", "resume"], ["-k", "resume"])):
        calls.clear()
        assert cli.main(["test", *argv]) == 0
        ruff, pytest_cmd = calls
        assert pytest_cmd[-len(extra):] == extra, pytest_cmd
        assert ("notebooks" in pytest_cmd) == ("--no-notebooks" not in argv), pytest_cmd


def test_cli_test_fails_when_the_tests_write_a_new_file_into_the_project(tmp_path, monkeypatch, capsys):
    from sinkflex_core import cli, paths

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "kept.txt").write_text("committed\n")
    (tmp_path / ".gitignore").write_text("build/\n")
    git("add", ".")
    git("commit", "-q", "-m", "start")
    (tmp_path / "scratch.txt").write_text("the user's, there before the tests\n")
    monkeypatch.setattr(paths, "repo_root", lambda: tmp_path)
    written = {}

    def fake_call(cmd, **kw):  # ruff does nothing; "pytest" writes the files
        for name, text in written.items() if "pytest" in cmd else ():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        return 0

    monkeypatch.setattr(cli.subprocess, "call", fake_call)
    written.update({"build/out.csv": "ignored\n"})
    assert cli.main(["test", "--no-notebooks"]) == 0  # an ignored folder, and the untouched scratch file
    written.update({"data/new.csv": "a,b\n"})
    assert cli.main(["test", "--no-notebooks"]) == 1
    assert "data/new.csv" in capsys.readouterr().err


def test_scrub_writes_the_root_as_dot_and_leaves_other_paths_alone(tmp_path, monkeypatch):
    from sinkflex_core.notebooks import scrub

    (tmp_path / "repo").mkdir()
    root = _fake_project(tmp_path / "repo", {})
    monkeypatch.setenv("SINKFLEX_ROOT", str(root))
    text = [f"wrote {root}/data/x.csv, ran in {root}.\n", f"kept: {root}-old/data, {root}.bak, /srv{root}\n"]
    nb = _nb([("code", "print()", [])])
    nb["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": text}]
    assert scrub(nb)["cells"][0]["outputs"][0]["text"] == ["wrote ./data/x.csv, ran in ..\n", text[1]]


def test_pyproject_keeps_cpu_machines_on_cpu_torch_and_lists_extras():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(d for d in meta["dependencies"] if d.startswith("torch"))
    assert "<" in torch_req, "torch needs an upper bound so that a newer CUDA wheel is never pulled"
    dev = " ".join(meta["optional-dependencies"]["dev"])
    for pkg in ("pytest", "nbval>=0.11", "papermill", "jupyterlab", "ipykernel", "ruff", "hypothesis"):
        assert pkg in dev
    assert "vllm" in meta["optional-dependencies"]
    assert meta["scripts"]["sinkflex"] == "sinkflex_core.cli:main"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make reproduce" in readme
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_no_absolute_machine_paths_in_tracked_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    files = [name for name in listed.stdout.split("\0") if name]
    assert "pyproject.toml" in files and "sinkflex_core/__init__.py" in files and len(files) > 50, files[:20]
    pattern = re.compile(r"/(work|root|home/\w+)/[\w.-]+")
    offenders = []
    for name in files:
        path = ROOT / name
        if path.suffix in {".png", ".jpg", ".whl"} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if pattern.search(text):
            offenders.append(name)
    assert offenders == []


def test_cli_hands_train_options_to_the_trainer():
    ok = subprocess.run([sys.executable, "-m", "sinkflex_core", "train", "--lr", "3e-4", "--print-config"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert '"lr": 0.0003' in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "sinkflex_core", "train", "--lr", "-5", "--print-config"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "lr must be a positive number" in bad.stderr + bad.stdout


def test_a_run_names_the_commit_it_started_from_not_a_later_one(tmp_path, monkeypatch):
    from sinkflex_core import provenance

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (repo / "f.txt").write_text("a\n")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "first"], check=True)
    monkeypatch.setattr(provenance, "repo_root", lambda: repo)
    monkeypatch.setenv("SINKFLEX_GIT_SHA", "")  # restored after the test
    monkeypatch.delenv("SINKFLEX_GIT_SHA")
    first = provenance.pin_git_sha()
    assert first and first != "unknown" and "+dirty" not in first

    (repo / "f.txt").write_text("b\n")  # a commit made while the run goes on
    subprocess.run(git + ["commit", "-q", "-am", "second"], check=True)
    assert provenance.git_sha() == first
    assert provenance.provenance()["git_sha"] == first
    child = subprocess.run([sys.executable, "-c", "from sinkflex_core.provenance import git_sha; print(git_sha())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == first  # the processes it starts name it too
