"""benchmarks/bench_logprobs.py: the arguments it refuses before measuring, and its CSV."""

from __future__ import annotations

import csv
import subprocess

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("bench_logprobs")


@pytest.mark.parametrize("argv", [["--repeat", "0"], ["--chunk", "0"], ["--threads", "-1"]])
def test_bad_arguments_are_refused_before_any_case_runs(script, argv, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a case was run"))
    monkeypatch.setattr("sys.argv", ["bench_logprobs.py", *argv])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_the_csv_goes_into_a_folder_that_does_not_exist_yet(script, tmp_path, monkeypatch):
    out = tmp_path / "new" / "logprobs.csv"
    monkeypatch.setattr("sys.argv", ["bench_logprobs.py", "--length", "32", "--hidden", "16", "--vocab", "64",
                                     "--chunk", "8", "--threads", "1", "--setting", "frozen", "--csv", str(out)])
    script.main()
    rows = list(csv.DictReader(out.open()))
    assert [(r["setting"], r["path"]) for r in rows] == [("frozen", "naive"), ("frozen", "chunked")]
    assert all(r["git_sha"] and r["vocab"] == "64" for r in rows)
