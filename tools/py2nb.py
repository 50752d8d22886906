"""Author a notebook as a percent-format script and convert it to .ipynb (no outputs).

    python tools/py2nb.py notebooks/src.py notebooks/03_sink_flex_attention.ipynb

Cells start with ``# %%`` (code) or ``# %% [markdown]`` (markdown; each line's leading ``# `` is
removed). Tags go after the marker: ``# %% tags=["parameters"]``. Then store smoke-mode outputs with
``sinkflex notebooks store 03``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_MARK = re.compile(r"^# %%(?P<md> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")


def convert(text: str) -> dict:
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", ln) for ln in body.splitlines())
            cell = {"cell_type": "markdown", "metadata": {}, "source": body}
        else:
            cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": body}
        if tags:
            cell["metadata"]["tags"] = tags
        cells.append(cell)

    for line in text.splitlines():
        m = _MARK.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            tags = json.loads(m.group("tags")) if m.group("tags") else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


if __name__ == "__main__":
    src, dst = map(Path, sys.argv[1:3])
    nb = convert(src.read_text(encoding="utf-8"))
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"cell-{i:02d}"
    dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {dst} ({len(nb['cells'])} cells)")
