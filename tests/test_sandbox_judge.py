"""Reward channels: the rule-based formatting judge, a tiny local HF model as judge, and how the
environment mixes either with its verifier."""

from __future__ import annotations

import math

import gymnasium as gym
import pytest
import torch

import sinkflex_core  # noqa: F401
from sinkflex_core.envs import format_tool_call
from sinkflex_core.envs.bash_env import TOOL_SCHEMAS, BashExpert
from sinkflex_core.envs.judge import DEFAULT_JUDGE_WEIGHT, FormatJudge, HFJudge
from sinkflex_core.envs.oracle import run_episode
from sinkflex_core.envs.sandbox import jail_available

JAIL_OK, JAIL_WHY = jail_available()
jailed = pytest.mark.skipif(not JAIL_OK, reason=f"no namespace jail here: {JAIL_WHY}")


def _assistant(*texts: str) -> list[dict]:
    return [{"role": "user", "content": "task"}] + [{"role": "assistant", "content": t} for t in texts]


@pytest.mark.parametrize("text, score", [
    (format_tool_call("run", {"command": "ls"}), 1.0),
    (format_tool_call("submit", {}), 1.0),
    ("Let me look.\n" + format_tool_call("run", {"command": "ls"}), 0.5),
    ('{"name": "run", "arguments": {"command": "ls"}}', 0.5),
    ('<tool_call>{"name": "run", "arguments": {"command": "ls"}}', 0.5),
    (format_tool_call("rm_everything", {}), 0.0),
    (format_tool_call("run", {}), 0.0),
    (format_tool_call("run", {"command": "ls", "extra": 1}), 0.0),
    ("<tool_call>{broken</tool_call>", 0.0),
    ("All done.", 1.0),
    ("", 0.0),
    ("x" * 3000, 0.0),
    ("I will call </tool_call> now", 0.0),
])
def test_format_judge_turns(text, score):
    assert FormatJudge()(_assistant(text), TOOL_SCHEMAS) == score


def test_format_judge_averages_turns_and_needs_one():
    turns = [format_tool_call("run", {"command": "ls"}), "<tool_call>{broken</tool_call>"]
    assert FormatJudge()(_assistant(*turns), TOOL_SCHEMAS) == 0.5
    assert FormatJudge()(_assistant(), TOOL_SCHEMAS) == 0.0


@jailed
def test_env_mixes_verifier_and_judge_with_the_documented_weight():
    seen = []

    def judge(messages, tools):
        seen.append((messages, tools))
        return 0.25

    env = gym.make("sinkflex/Bash-v0", split="test", judge=judge, judge_weight=0.4)
    _, reward, info = run_episode(env, BashExpert(), 0)
    details = info["reward_info"]
    assert details["verifier"] == 1.0 and details["judge"] == 0.25 and details["judge_weight"] == 0.4
    assert reward == pytest.approx(0.6 * 1.0 + 0.4 * 0.25)
    messages, tools = seen[-1]
    assert [m["role"] for m in messages][:2] == ["user", "assistant"] and messages[1]["content"].startswith("<tool_call>")
    assert {t["function"]["name"] for t in tools} == {"run", "submit"}
    env.close()

    default = gym.make("sinkflex/Bash-v0", split="test")
    _, reward, info = run_episode(default, BashExpert(), 0)
    assert info["reward_info"]["judge_weight"] == DEFAULT_JUDGE_WEIGHT and reward == 1.0
    default.reset(options={"task_index": 0})
    *_, reward, _, _, info = default.step("<tool_call>{bad</tool_call>")
    for _ in range(20):
        _, reward, terminated, truncated, info = default.step(format_tool_call("submit", {"answer": "wrong"}))
        if terminated or truncated:
            break
    assert info["reward_info"]["verifier"] == 0.0 and reward == pytest.approx(DEFAULT_JUDGE_WEIGHT * 0.5)
    default.close()

    plain = gym.make("sinkflex/Bash-v0", split="test", judge=None)
    plain.reset(options={"task_index": 0})
    *_, reward, _, _, info = plain.step("<tool_call>{bad</tool_call>")
    _, reward, _, _, info = plain.step(format_tool_call("submit", {"answer": "wrong"}))
    assert reward == 0.0 and info["reward_info"]["judge"] is None
    plain.close()


@jailed
@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "0.5", None])
def test_a_judge_out_of_range_is_an_error(bad):
    env = gym.make("sinkflex/Bash-v0", split="test", judge=lambda m, t: bad)
    env.reset(options={"task_index": 0})
    with pytest.raises(ValueError, match="judge returned"):
        env.step(format_tool_call("submit", {"answer": "x"}))
    env.close()


def test_bad_judge_arguments_are_refused():
    with pytest.raises(ValueError, match="judge must be"):
        gym.make("sinkflex/Bash-v0", judge="gpt", allow_unjailed=True)
    with pytest.raises(ValueError, match="judge_weight"):
        gym.make("sinkflex/Bash-v0", judge_weight=True, allow_unjailed=True)


@pytest.fixture(scope="module")
def tiny_judge():
    from sinkflex_core.models import build_model, tiny_qwen2_config, train_tokenizer, wrap_tokenizer

    texts = ["[user] task\n[assistant] <tool_call> run ls </tool_call>\nAnswer: yes no yes no"] * 20
    tok = wrap_tokenizer(train_tokenizer(texts, vocab_size=400))
    model = build_model(tiny_qwen2_config(vocab_size=400, hidden_size=64, num_layers=2, tokenizer=tok), seed=0)
    return HFJudge(model, tok, max_tokens=160), model, tok


def test_hf_judge_is_the_yes_share_of_the_models_probabilities(tiny_judge):
    judge, model, tok = tiny_judge
    messages = _assistant(format_tool_call("run", {"command": "ls"}))
    score = judge(messages, TOOL_SCHEMAS)
    prompt = judge.prompt_ids(messages)

    def logp(continuation):  # by hand: full sequence, one forward pass, sum of the continuation's log-probs
        ids = torch.tensor([prompt + continuation])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        return sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(continuation))

    yes, no = logp(tok.encode(" yes", add_special_tokens=False)), logp(tok.encode(" no", add_special_tokens=False))
    assert 0.0 < score < 1.0
    assert score == pytest.approx(math.exp(yes) / (math.exp(yes) + math.exp(no)), rel=1e-5)
    assert judge(messages, TOOL_SCHEMAS) == score  # deterministic
    assert judge(_assistant("something else entirely " * 3), TOOL_SCHEMAS) != score  # it reads the transcript


def test_hf_judge_keeps_the_end_of_long_transcripts(tiny_judge):
    judge, _, tok = tiny_judge
    long = _assistant(*["word " * 50] * 20)
    ids = judge.prompt_ids(long)
    assert len(ids) + max(len(judge.yes_ids), len(judge.no_ids)) <= judge.max_tokens
    assert ids[-len(tok.encode(judge.question, add_special_tokens=False)):] == tok.encode(
        judge.question, add_special_tokens=False)
    with pytest.raises(ValueError, match="different"):
        HFJudge(judge.model, tok, yes=" yes", no=" yes")
    with pytest.raises(ValueError, match="leaves"):
        HFJudge(judge.model, tok, max_tokens=40)


@jailed
def test_hf_judge_plugs_into_the_code_repair_env(tiny_judge):
    judge, _, _ = tiny_judge
    env = gym.make("sinkflex/CodeRepair-v0", split="test", judge=judge, judge_weight=0.5)
    env.reset(options={"task_index": 0})
    _, reward, terminated, _, info = env.step(format_tool_call("submit", {}))
    details = info["reward_info"]
    assert terminated and 0.0 < details["judge"] < 1.0
    assert reward == pytest.approx(0.5 * details["verifier"] + 0.5 * details["judge"])
    env.close()
