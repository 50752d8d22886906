"""SFT of the tiny policy on the oracle's trajectories: the data are the expert's conversations in
the rollout's token layout, batching respects its budget, training lowers the loss, and the saved
policy loads into the GRPO trainer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sinkflex_core import sft, train
from sinkflex_core.envs import expert_conversation, format_tool_call
from sinkflex_core.models import get_tokenizer

SMALL = dict(hidden_size=64, num_layers=2, max_total_tokens=768, max_turns=6, max_new_tokens_per_turn=96,
             batch_tokens=2048, eval_every=1000, val_tasks=2, threads=1, progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(2048)


def _masked_spans(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    spans, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_expert_examples_are_the_oracle_conversations_in_rollout_layout(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, [0, 1, 2])
    assert len(examples) == 3
    for task, ex in enumerate(examples):
        messages, reward = expert_conversation(cfg.env_id, "train", task)
        assert reward == 1.0
        expected = []
        for m in messages:
            if m["role"] != "assistant":
                continue
            if m.get("tool_calls"):
                fn = m["tool_calls"][0]["function"]
                expected.append(format_tool_call(fn["name"], fn["arguments"]))
            else:
                expected.append(m["content"])
        spans = _masked_spans(ex["input_ids"], ex["loss_mask"])
        # every trained span is one assistant turn, closed by the end-of-turn token
        assert [s[-1] for s in spans] == [tokenizer.eos_token_id] * len(spans)
        assert [tokenizer.decode(s[:-1]) for s in spans] == expected
        # the prompt opens with the compact system prompt and no tool list
        head = tokenizer.decode(ex["input_ids"][:40])
        assert cfg.system_prompt[:30] in head and "<tools>" not in tokenizer.decode(ex["input_ids"])


def test_expert_examples_are_cut_at_max_total_tokens(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 300})
    examples = sft.expert_examples(tokenizer, cfg, [0, 1])
    assert all(len(e["input_ids"]) <= 300 and len(e["input_ids"]) == len(e["loss_mask"]) for e in examples)


def test_length_batches_cover_every_example_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 900, size=200).tolist()
    batches = sft.length_batches(lengths, 2048, rng)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(200))
    assert all(max(lengths[i] for i in b) * len(b) <= 2048 or len(b) == 1 for b in batches)


def test_bad_sft_config_is_refused():
    with pytest.raises(train.ConfigError, match="lr must be a positive"):
        sft.SFTConfig(lr=0).validate()
    with pytest.raises(train.ConfigError, match="batch_tokens must be a positive integer"):
        sft.SFTConfig(batch_tokens=0).validate()
    assert sft.main(["--max-minutes", "-1"]) == 2


@pytest.mark.slow
def test_sft_lowers_the_loss_and_saves_a_policy_the_trainer_loads(tmp_path):
    cfg = sft.SFTConfig(**{**SMALL, "train_tasks": 6, "max_steps": 30, "eval_every": 15, "lr": 3e-3,
                           "warmup_steps": 5, "stop_at_reward": 0.0, "max_total_tokens": 512, "max_turns": 3,
                           "max_new_tokens_per_turn": 24, "out_dir": str(tmp_path / "sft")})
    result = sft.train_sft(cfg)
    hist = result.history
    assert result.steps == 30 and [h["step"] for h in hist] == [15, 30]
    # 30 steps over 6 conversations: the expert tokens become much more likely than at random init
    assert hist[-1]["loss"] < 0.6 * np.log(2048)
    assert (tmp_path / "sft" / "model.safetensors").is_file() and (tmp_path / "sft" / "sft_history.csv").is_file()
    tcfg = train.TrainConfig.from_dict({"model": str(tmp_path / "sft"), "out_dir": str(tmp_path / "grpo"),
                                        "max_total_tokens": 512, "steps": 1})
    tok = train.load_tokenizer(tcfg)
    model = train.load_model(tcfg, tok, torch.device("cpu"))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), result.model.state_dict().values()))
    assert same and tok.get_vocab() == result.tokenizer.get_vocab()
