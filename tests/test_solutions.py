"""The lessons' exercises and their solutions.

Every lesson ends with an ``## Exercises`` cell that points to a solutions script,
``notebooks/solutions/NN_name.py`` (jupytext percent format, no stored outputs). Every solutions script
must run to its end in smoke mode, from its own folder as JupyterLab would run it, without writing to the
repository's ``data/`` or ``figures/``."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = NOTEBOOKS / "solutions"
# 05 trains for minutes: its exercises work on the recorded runs in data/, so that its solutions run in seconds
WITH_EXERCISES = ("00", "01", "02", "03", "04", "05", "06", "07")
LESSON = re.compile(r"^(\d\d)_.+\.ipynb$")
TIMEOUT_S = 900


def lessons() -> dict[str, Path]:
    """Number -> lesson notebook, for every lesson that must have exercises (a missing one is None)."""
    found = {m.group(1): p for p in NOTEBOOKS.iterdir() if (m := LESSON.match(p.name))}
    return {number: found.get(number) for number in WITH_EXERCISES}


def exercises_cell(path: Path) -> str | None:
    """The source of the lesson's ``## Exercises`` markdown cell, or None."""
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## Exercises"):
            return cell.source
    return None


def tracked_outputs() -> dict[str, str]:
    """Digest of every file under data/ and figures/, what a solution must never write."""
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in ("data", "figures") for p in sorted((ROOT / folder).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("number", WITH_EXERCISES)
def test_lesson_has_exercises_and_its_solutions(number):
    lesson = lessons()[number]
    assert lesson is not None, f"no notebooks/{number}_*.ipynb"
    cell = exercises_cell(lesson)
    assert cell is not None, f"{lesson.name} has no '## Exercises' markdown cell"
    numbered = re.findall(r"^\d\. ", cell, flags=re.MULTILINE)
    assert 2 <= len(numbered) <= 3, f"{lesson.name}: {len(numbered)} numbered exercises, want 2 or 3"
    solutions = SOLUTIONS / f"{lesson.stem}.py"
    assert solutions.is_file(), f"{lesson.name} has no solutions file notebooks/solutions/{solutions.name}"
    assert f"solutions/{solutions.name}" in cell, f"{lesson.name}'s exercises do not point to {solutions.name}"
    assert "## Exercise" in solutions.read_text(encoding="utf-8")


def test_every_solutions_file_belongs_to_a_lesson():
    stems = {p.stem for p in lessons().values() if p is not None}
    orphans = sorted(p.name for p in SOLUTIONS.glob("*.py") if p.stem not in stems)
    assert not orphans, f"solutions without a lesson: {orphans}"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SOLUTIONS.glob("*.py")), ids=lambda p: p.stem)
def test_solutions_run_in_smoke_mode(script):
    env = dict(os.environ, SINKFLEX_SMOKE="1", MPLBACKEND="Agg", JUPYTER_PLATFORM_DIRS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    before = tracked_outputs()
    run = subprocess.run([sys.executable, script.name], cwd=SOLUTIONS, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"{script.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.stdout.strip(), f"{script.name} printed nothing"
    after = tracked_outputs()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{script.name} wrote to tracked outputs: {changed}"


def test_docs_link_each_lesson_to_its_solutions_page(tmp_path):
    from sinkflex_core.notebooks import render_html

    pages = render_html(tmp_path, only=["02"])
    page = tmp_path / "solutions" / "02_grpo_loss.html"
    assert page in pages
    text = page.read_text(encoding="utf-8")
    assert "Exercise 1" in text and "group_advantages" in text
    for linking in ("index.html", "02_grpo_loss.html"):
        assert 'href="solutions/02_grpo_loss.html"' in (tmp_path / linking).read_text(encoding="utf-8"), linking
