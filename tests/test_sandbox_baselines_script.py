"""benchmarks/sandbox_baselines.py: the arguments it refuses before playing, and where it writes."""

from __future__ import annotations

import csv

import pytest
from benchmark_scripts import load_benchmark

from sinkflex_core.envs import oracle
from sinkflex_core.envs.sandbox import jail_available

pytestmark = pytest.mark.skipif(not jail_available()[0], reason="the baselines are recorded in the jail only")


@pytest.fixture(scope="module")
def script():
    return load_benchmark("sandbox_baselines")


@pytest.mark.parametrize("tasks", ["101", "-1"])
def test_a_task_count_the_splits_do_not_have_is_refused_before_any_episode(script, tasks, tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.setattr(oracle, "run_episode", lambda *a, **k: pytest.fail("an episode was played"))
    with pytest.raises(SystemExit) as exc:
        script.main(["--tasks", tasks, "--out", str(tmp_path / "b.csv")])
    assert exc.value.code == 2 and "--tasks must be in 0..100" in capsys.readouterr().err


def test_the_table_is_written_into_a_folder_that_does_not_exist_yet(script, tmp_path):
    out = tmp_path / "new" / "baselines.csv"
    script.main(["--tasks", "1", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["env"], r["agent"]) for r in rows] == [
        (env, agent) for env in ("sinkflex/Bash-v0", "sinkflex/CodeRepair-v0")
        for agent in ("expert", "random", "do_nothing")]
    assert all(r["tasks"] == "1" and r["git_sha"] for r in rows)
