"""benchmarks/pass_at_k.py: success counts per task from real rollouts, and its command line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
from sinkflex_core.rollout import AgentBackend


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "pass_at_k_script", Path(__file__).resolve().parents[1] / "benchmarks" / "pass_at_k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer()


def test_counts_follow_the_tasks_the_oracle_solves_or_not(script, tokenizer):
    from sinkflex_core.envs.oracle import DoNothingAgent

    tasks = [0, 1, 2]
    solved = script.success_counts(AgentBackend(tokenizer), tokenizer, "test", tasks, samples=2, tasks_per_call=2,
                                   seed=0, progress=False)
    assert solved == [2, 2, 2]  # one call of 2 tasks, then one of 1: each task's group counted once, in order
    idle = script.success_counts(AgentBackend(tokenizer, DoNothingAgent), tokenizer, "test", tasks, samples=2,
                                 tasks_per_call=2, seed=0, progress=False)
    assert idle == [0, 0, 0]
    assert script.task_kinds("test", [0, 1]) == ["read only", "modify_pending_order_address"]


def test_command_line_prints_pass_at_k_and_writes_the_counts(script, tokenizer, tmp_path, capsys):
    policy = tmp_path / "policy"
    build_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer)).save_pretrained(
        policy)
    tokenizer.save_pretrained(policy)
    out = tmp_path / "counts.csv"
    assert script.main(["--policy", str(policy), "--tasks", "3", "--samples", "2", "--tasks-per-call", "2",
                        "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "pass@k" in printed and "3 test tasks x 2 episodes" in printed
    table = pd.read_csv(out)
    assert list(table["task"]) == [0, 1, 2] and set(table["tries"]) == {2}
    assert table["successes"].between(0, 2).all() and {"git_sha", "policy"} <= set(table.columns)
    with pytest.raises(SystemExit):
        script.main(["--policy", str(tmp_path / "nowhere")])
