"""benchmarks/pass_at_k.py: success counts per task from real rollouts, and its command line."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from benchmark_scripts import load_benchmark

from sinkflex_core import train
from sinkflex_core.envs.retail import REWARD_VERSION
from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
from sinkflex_core.rollout import AgentBackend


@pytest.fixture(scope="module")
def script():
    return load_benchmark("pass_at_k")


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer()


def test_counts_follow_the_tasks_the_oracle_solves_or_not(tokenizer):
    from sinkflex_core.envs.oracle import DoNothingAgent

    tasks = [0, 1, 2]
    solved = train.success_counts(AgentBackend(tokenizer), tokenizer, "test", tasks, samples=2, tasks_per_call=2,
                                   seed=0, progress=False)
    assert solved == [2, 2, 2]  # one call of 2 tasks, then one of 1: each task's group counted once, in order
    idle = train.success_counts(AgentBackend(tokenizer, DoNothingAgent), tokenizer, "test", tasks, samples=2,
                                 tasks_per_call=2, seed=0, progress=False)
    assert idle == [0, 0, 0]
    assert train.task_kinds("test", [0, 1]) == ["read only", "modify_pending_order_address"]


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
    # a random 1-layer policy solves nothing: 0 successes out of 2 tries, not the tries copied over
    assert (table["successes"] == 0).all() and (table["tries"] == 2).all(), table
    assert {"git_sha", "policy"} <= set(table.columns)
    with pytest.raises(SystemExit):
        script.main(["--policy", str(tmp_path / "nowhere")])


def test_screen_is_written_once_per_policy_weights(tokenizer, tmp_path, capsys):
    policy = tmp_path / "policy"
    config = tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer)
    build_model(config).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    path = tmp_path / "screen.csv"
    assert train.screen_or_reuse(policy, path, samples=2, tasks=3, progress=False) == path
    first = pd.read_csv(path)
    assert list(first["task"]) == [0, 1, 2] and set(first["tries"]) == {2} and set(first["split"]) == {"train"}
    assert (first["successes"] == 0).all() and (first["tries"] == 2).all(), first  # random: solves nothing
    assert first["policy_digest"].nunique() == 1
    stamp = path.stat().st_mtime_ns
    train.screen_or_reuse(policy, path, samples=2, tasks=3, progress=False)
    assert path.stat().st_mtime_ns == stamp and "reusing" in capsys.readouterr().err
    # Other weights, or another number of samples, screen again.
    other = build_model(config)
    with torch.no_grad():
        next(other.parameters()).add_(0.5)  # other weights
    other.save_pretrained(policy)
    train.screen_or_reuse(policy, path, samples=2, tasks=3, progress=False)
    again = pd.read_csv(path)
    assert again["policy_digest"].iloc[0] != first["policy_digest"].iloc[0]
    train.screen_or_reuse(policy, path, samples=3, tasks=3, progress=False)
    assert set(pd.read_csv(path)["tries"]) == {3}
    # A screen made under an earlier reward (no reward_version column: version 1) is made again,
    # and handed to the trainer as it is, it is used with a warning.
    old = pd.read_csv(path).drop(columns=["reward_version"])
    old.to_csv(path, index=False)
    with pytest.warns(UserWarning, match="reward version"):
        train.screened_tasks(path, "train", 600)
    train.screen_or_reuse(policy, path, samples=3, tasks=3, progress=False)
    assert set(pd.read_csv(path)["reward_version"]) == {REWARD_VERSION}


def test_a_split_that_does_not_exist_or_too_many_tasks_are_refused_before_any_rollout(script, tmp_path,
                                                                                     monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("the policy was played before the arguments were checked")

    monkeypatch.setattr(train, "success_table", no_work)
    policy = str(tmp_path / "policy")  # not read: the arguments are refused first
    n = train.count_tasks("sinkflex/Retail-v0", "test")
    for argv, says in ((["--split", "valid"], "split 'valid'"), (["--tasks", str(n + 1)], f"has {n} tasks"),
                       (["--threads", "-1"], "--threads must be >= 0"),
                       # its tasks have no write actions to name, nor a reward version
                       (["--env-id", "sinkflex/Bash-v0"], "no task world is registered for 'sinkflex/Bash-v0'")):
        with pytest.raises(SystemExit) as exc:
            script.main(["--policy", policy, *argv])
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_screen_is_not_reused_for_another_sampling_seed(tokenizer, tmp_path, capsys):
    policy = tmp_path / "policy"
    build_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer)).save_pretrained(
        policy)
    tokenizer.save_pretrained(policy)
    path = tmp_path / "screen.csv"
    train.screen_or_reuse(policy, path, samples=1, tasks=2, seed=0, progress=False)
    capsys.readouterr()
    train.screen_or_reuse(policy, path, samples=1, tasks=2, seed=1, progress=False)
    assert "reusing" not in capsys.readouterr().err and set(pd.read_csv(path)["seed"]) == {1}
    train.screen_or_reuse(policy, path, samples=1, tasks=2, seed=1, progress=False)
    assert "reusing" in capsys.readouterr().err
