"""`sinkflex docs`: the stored lessons rendered to HTML, with their outputs and an index."""

from __future__ import annotations

import html
import json

from sinkflex_core import cli
from sinkflex_core.notebooks import list_notebooks


def test_docs_renders_the_stored_lessons_with_their_outputs(tmp_path, capsys):
    assert cli.main(["docs", "--out", str(tmp_path), "--only", "02"]) == 0
    assert "1 lessons rendered" in capsys.readouterr().out
    info = next(nb for nb in list_notebooks() if nb.name.startswith("02"))
    page = (tmp_path / (info.path.stem + ".html")).read_text(encoding="utf-8")
    assert info.title in page
    # every stored text output of the notebook is on the page (nothing was re-executed or dropped)
    nb = json.loads(info.path.read_text(encoding="utf-8"))
    texts = [out["text"] if isinstance(out["text"], str) else "".join(out["text"])
             for cell in nb["cells"] if cell["cell_type"] == "code"
             for out in cell.get("outputs", []) if out.get("output_type") == "stream"]
    assert texts, "the stored lesson carries no output to render"
    first_line = texts[0].strip().splitlines()[0]
    assert html.escape(first_line, quote=False) in page or first_line in page
    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert f'href="{info.path.stem}.html"' in index
