"""Every lesson is a pair: ``notebooks/NN_name.ipynb`` (the rendered lesson with its outputs) and
``notebooks/NN_name.py`` (its jupytext percent-format source). The two must hold the same cells, in
the same order, of the same types with the same sources and tags; otherwise an edit was made to one
and not synced (``jupytext --sync notebooks/NN_name.ipynb``)."""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSON = re.compile(r"^\d\d_.+\.(ipynb|py)$")


def _cells(nb) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(c.cell_type, c.source.strip("\n"), tuple(c.metadata.get("tags", []))) for c in nb.cells]


def _lessons(suffix: str) -> set[str]:
    return {p.stem for p in NOTEBOOKS.iterdir() if LESSON.match(p.name) and p.suffix == suffix}


def out_of_sync(ipynb: Path, script: Path) -> str | None:
    """Where the pair differs first (a sentence), or None when it holds the same cells."""
    a = _cells(nbformat.read(ipynb, as_version=4))
    b = _cells(jupytext.read(script, fmt="py:percent"))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            what = "type" if x[0] != y[0] else "tags" if x[2] != y[2] else "source"
            return f"cell {i} differs in its {what}: {ipynb.name} has {x[1][:60]!r}, {script.name} has {y[1][:60]!r}"
    if len(a) != len(b):
        return f"{ipynb.name} has {len(a)} cells, {script.name} has {len(b)}"
    return None


def test_every_notebook_has_its_script_and_every_script_its_notebook():
    assert _lessons(".ipynb"), "no lesson found"
    assert _lessons(".ipynb") == _lessons(".py")


@pytest.mark.parametrize("name", sorted(_lessons(".ipynb")))
def test_pair_holds_the_same_cells(name):
    problem = out_of_sync(NOTEBOOKS / f"{name}.ipynb", NOTEBOOKS / f"{name}.py")
    assert problem is None, f"{problem}; run `jupytext --sync notebooks/{name}.ipynb`"


def test_an_edit_to_one_side_is_caught(tmp_path):
    ipynb = NOTEBOOKS / "02_grpo_loss.ipynb"
    script = tmp_path / "02_grpo_loss.py"
    text = (NOTEBOOKS / "02_grpo_loss.py").read_text()
    script.write_text(text)
    assert out_of_sync(ipynb, script) is None
    script.write_text(text.replace("seed = 0", "seed = 1", 1))
    assert "source" in out_of_sync(ipynb, script)
    script.write_text(text.replace("# %% [markdown]", "# %%", 1))
    assert "type" in out_of_sync(ipynb, script)
    script.write_text(text + "\n# %%\nprint('one more cell')\n")
    assert "cells" in out_of_sync(ipynb, script)
