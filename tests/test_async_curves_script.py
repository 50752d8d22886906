"""benchmarks/async_curves.py: where its runs go, and the arguments it refuses before training anything
(the trainer and the held-out measurements are stand-ins here)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture()
def curves(monkeypatch):
    """The script with a trainer that only writes what a finished run leaves (metrics.csv, policy/)."""
    script = load_benchmark("async_curves")
    trained: list[Path] = []

    class FinishedAtOnce:
        def __init__(self, cfg):
            self.cfg = cfg

        def run(self):
            out = Path(self.cfg.out_dir)
            (out / "policy").mkdir(parents=True, exist_ok=True)
            pd.DataFrame({"step": range(self.cfg.steps + 1)}).to_csv(out / "metrics.csv", index=False)
            trained.append(out)
            return []

    monkeypatch.setattr(script.train, "Trainer", FinishedAtOnce)
    monkeypatch.setattr(script, "measure_run", lambda *args: None)
    monkeypatch.setattr(script, "record", lambda *args: 0)
    script.trained = trained
    return script


def test_smoke_runs_are_not_taken_for_the_full_runs(curves, tmp_path):
    """A smoke run in the full run's folder was reused by a full run of as many steps (and recorded in
    data/ as one), or refused on resume by a longer one (another config): it has a folder of its own."""
    common = ["--configs", "sync", "--seeds", "0", "--out-root", str(tmp_path)]
    assert curves.main(["--smoke", *common]) == 0
    assert curves.trained == [tmp_path / "smoke" / "sync" / "seed0"]
    assert curves.main(["--steps", "3", *common]) == 0
    assert curves.trained[1:] == [tmp_path / "sync" / "seed0"]  # trained, not the smoke run reused


@pytest.mark.parametrize("argv,says", [
    (["--test-tasks", "121"], "--test-tasks in 1..120"),
    (["--test-samples", "0"], "--test-samples must be >= 1"),
    (["--record-only"], "--record-only: no finished run"),
])
def test_bad_arguments_are_refused_before_any_run(curves, tmp_path, argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        curves.main(["--configs", "sync", "--seeds", "0", "--out-root", str(tmp_path), *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err
    assert curves.trained == []


def test_the_shipped_start_is_read_in_a_copy(curves, tmp_path):
    """Measured in place, a start in data/ whose cached rows no longer fit would have its recorded
    test_rewards.csv rewritten."""
    from sinkflex_core.paths import data_dir

    shipped = data_dir() / "retail-tiny-start" / "test_rewards.csv"
    before = shipped.read_bytes()
    rates = curves.start_rates(data_dir() / "retail-tiny-start", 5, tmp_path / "start_measured")
    assert (tmp_path / "start_measured" / "retail-tiny-start" / "test_rewards.csv").is_file()
    assert len(rates) == 5 and rates.between(0, 1).all() and shipped.read_bytes() == before
