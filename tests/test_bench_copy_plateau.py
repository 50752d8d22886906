"""benchmarks/bench_copy_plateau.py: the arguments it refuses before training, and its CSV."""

from __future__ import annotations

import csv

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("bench_copy_plateau")


@pytest.mark.parametrize("argv", [["--every", "0"], ["--steps", "0", "--csv", "x.csv"], ["--alphabet", "3070"],
                                  ["--length", "8"]])
def test_bad_arguments_are_refused_before_any_training(script, argv, monkeypatch, capsys):
    monkeypatch.setattr(script, "run_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert exc.value.code == 2 and "--steps, --every and --rows must be >= 1" in capsys.readouterr().err


def test_the_csv_goes_into_a_folder_that_does_not_exist_yet(script, tmp_path):
    out = tmp_path / "new" / "plateau.csv"
    script.main(["--steps", "2", "--every", "1", "--rows", "2", "--length", "32", "--arms", "random",
                 "--hidden", "32", "--layers", "1", "--threads", "1", "--csv", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["arm"], r["step"]) for r in rows] == [("random_init", "1"), ("random_init", "2")]
    assert all(r["git_sha"] and r["alphabet"] == "3000" for r in rows)
