"""SFT of the tiny policy on the oracle's trajectories: the data are the expert's conversations in
the rollout's token layout, batching respects its budget, training lowers the loss, and the saved
policy loads into the GRPO trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sinkflex_core import sft, train
from sinkflex_core.envs import expert_conversation, format_tool_call
from sinkflex_core.models import DEFAULT_VOCAB_SIZE, build_model, get_tokenizer, tiny_qwen2_config

SMALL = dict(hidden_size=64, num_layers=2, max_total_tokens=768, max_turns=6, max_new_tokens_per_turn=96,
             batch_tokens=2048, eval_every=1000, val_tasks=2, threads=1, progress=False,
             copy_warmup_steps=3, copy_warmup_length=64, copy_fraction=0.0)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer()


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


def test_the_expert_cache_is_keyed_by_the_worlds_code(tokenizer, tmp_path, monkeypatch):
    import shutil

    from sinkflex_core import sft_data

    cfg = sft.SFTConfig(**SMALL)
    first = sft.expert_examples(tokenizer, cfg, [0], cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").iterdir()
    again = sft.expert_examples(tokenizer, cfg, [0], cache_dir=tmp_path / "cache")
    assert [torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again)] == [True]
    # an edit to any file of the worlds' code gives another digest ...
    envs = Path(sft_data.__file__).parent / "envs"
    shutil.copytree(envs, tmp_path / "envs", ignore=shutil.ignore_patterns("__pycache__"))
    assert sft_data.worlds_digest(tmp_path / "envs") == sft_data.worlds_digest()
    oracle = tmp_path / "envs" / "oracle.py"
    oracle.write_text(oracle.read_text() + "\n# one more line\n")
    assert sft_data.worlds_digest(tmp_path / "envs") != sft_data.worlds_digest()
    # ... and another digest is another cache file: the old episodes are not served
    monkeypatch.setattr(sft_data, "worlds_digest", lambda folder=None: "another world")
    sft.expert_examples(tokenizer, cfg, [0], cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 2 and cached.is_file()


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
    with pytest.raises(train.ConfigError, match="seed must be an integer >= 0"):
        sft.SFTConfig(seed=-1).validate()
    with pytest.raises(train.ConfigError, match="seed must be below 2"):
        sft.SFTConfig(seed=10**30).validate()
    for field, value in [("grad_clip", 0.0), ("grad_clip", float("nan")), ("weight_decay", -0.1),
                         ("weight_decay", float("inf")), ("eval_temperature", float("nan")),
                         ("max_minutes", float("nan"))]:
        with pytest.raises(train.ConfigError, match=field):
            sft.SFTConfig(**{field: value}).validate()


def test_the_bool_fields_and_the_device_are_checked_before_any_work():
    for field in ("bf16", "keep_best", "learn_sinks", "action_messages"):  # "yes" is truthy: it trained as True
        with pytest.raises(train.ConfigError, match=f"{field} must be true or false"):
            sft.SFTConfig(**{field: "yes"}).validate()
    for bad in ("tpu", "gpu", "cuda:x", "", 0, None):
        with pytest.raises(train.ConfigError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            sft.SFTConfig(device=bad).validate()
    assert sft.SFTConfig(device="cpu").torch_device() == torch.device("cpu")
    if torch.cuda.is_available():
        assert sft.SFTConfig().torch_device() == torch.device("cuda", 0)
        with pytest.raises(train.ConfigError, match="CUDA GPU"):
            sft.SFTConfig(device=f"cuda:{torch.cuda.device_count()}").validate()
    else:
        assert sft.SFTConfig().torch_device() == torch.device("cpu")  # auto
        with pytest.raises(train.ConfigError, match="torch sees no CUDA GPU"):
            sft.SFTConfig(device="cuda").validate()
    assert sft.main(["--device", "tpu", "--max-steps", "1"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sft_on_a_gpu_follows_the_cpu_run(tmp_path):
    # the same seed and data on both devices: the same first losses (to float32's rounding on two devices),
    # the model trained on the GPU, its weights saved and read back, the teacher-forced measure there too
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = sft.SFTConfig(**{**SMALL, "train_tasks": 8, "max_steps": 3, "eval_every": 3, "device": device,
                               "out_dir": str(tmp_path / device)})
        runs[device] = sft.train_sft(cfg)
    assert next(runs["cuda"].model.parameters()).is_cuda
    assert runs["cuda"].steps == runs["cpu"].steps == 3
    assert runs["cuda"].history[-1]["loss"] == pytest.approx(runs["cpu"].history[-1]["loss"], rel=5e-3)
    from sinkflex_core.models import load_policy

    saved = load_policy(tmp_path / "cuda")
    for a, b in zip(saved.parameters(), runs["cuda"].model.parameters()):
        torch.testing.assert_close(a, b.cpu())
    examples = sft.expert_examples(runs["cpu"].tokenizer, sft.SFTConfig(**SMALL), [0, 1], split="test")
    gpu = sft.expert_token_accuracy(runs["cuda"].model, runs["cuda"].tokenizer, examples)
    cpu = sft.expert_token_accuracy(saved, runs["cuda"].tokenizer, examples)
    assert gpu["n_other"] == cpu["n_other"] > 0
    assert gpu["acc_other"] == pytest.approx(cpu["acc_other"], abs=0.02)


def test_an_out_dir_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    monkeypatch.setattr(sft, "_task_split", lambda cfg: pytest.fail("training started"))
    with pytest.raises(train.ConfigError, match="cannot write there"):
        sft.train_sft(sft.SFTConfig(out_dir=str(taken / "policy")))
    assert taken.read_text() == "not a folder"


def test_context_loss_weighs_expert_tokens_one_and_other_real_tokens_w(tokenizer):
    torch.manual_seed(0)
    model = build_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1, tokenizer=tokenizer))
    policy = train.TokenLogprobs(model)
    examples = [{"input_ids": torch.randint(3, 500, (n,)), "loss_mask": (torch.rand(n) < 0.4).long()}
                for n in (9, 14)]
    for e in examples:
        e["loss_mask"][0] = 0  # the first token of an episode is the prompt's
    batch = sft.collate(examples, pad_id=0)
    with torch.no_grad():
        logp, _ = policy(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        mask, real = batch["loss_mask"], batch["attention_mask"].float()
        classic, n = sft.sft_loss(policy, batch, 0.0)
        assert n == int(mask.sum())
        torch.testing.assert_close(classic, -(logp * mask).sum() / mask.sum())
        w = 0.3
        weights = mask + w * (1 - mask) * real
        weights[:, 0] = 0  # a row's first token has no prefix to be predicted from
        mixed, _ = sft.sft_loss(policy, batch, w)
        torch.testing.assert_close(mixed, -(logp * weights).sum() / weights.sum())
        assert not torch.isclose(mixed, classic)
        # padding weighs nothing: changing padded ids changes neither loss
        batch2 = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7))
        torch.testing.assert_close(sft.sft_loss(policy, batch2, w)[0], mixed)
    with pytest.raises(train.ConfigError, match="context_loss_weight"):
        sft.SFTConfig(context_loss_weight=-1).validate()
    with pytest.raises(train.ConfigError, match="init_from"):
        sft.SFTConfig(init_from="no/such/folder").validate()


def test_value_start_mask_marks_the_first_token_of_each_tool_call_argument_and_weighs_it(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    (ex,) = sft.expert_examples(tokenizer, cfg, [1])  # identity by e-mail or name and zip, then a lookup by id
    tables = sft.value_start_tokens(tokenizer)
    mask = sft.value_start_mask(ex["input_ids"], ex["loss_mask"], *tables)
    messages, _ = expert_conversation(cfg.env_id, "train", 1)
    # expected: the first token of every argument value and of every tool name the expert writes
    expected = []
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            expected.append(fn["name"])
            for value in fn["arguments"].values():
                value = value[0] if isinstance(value, list) else value
                expected.append(value[2:] if value.startswith("#W") else value)
    ids = ex["input_ids"].tolist()
    marked = mask.nonzero().flatten().tolist()
    assert len(marked) == len(expected) and all(ex["loss_mask"][p] for p in marked)
    for p, value in zip(marked, expected):  # each marked token starts its value's text, in order
        assert str(value).startswith(tokenizer.decode([ids[p]])), (tokenizer.decode(ids[p - 3:p + 3]), value)

    # the loss weighs marked expert tokens value_weight and the others as before
    torch.manual_seed(0)
    model = build_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=1, tokenizer=tokenizer))
    policy = train.TokenLogprobs(model)
    batch = sft.collate([ex], pad_id=0)
    batch["value_mask"] = sft.value_start_mask(batch["input_ids"], batch["loss_mask"], *tables)
    with torch.no_grad():
        logp, _ = policy(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        weights = batch["loss_mask"] + 0.5 * (1 - batch["loss_mask"])
        weights[batch["value_mask"]] *= 8.0
        weights[:, 0] = 0
        got, _ = sft.sft_loss(policy, batch, 0.5, 8.0)
        torch.testing.assert_close(got, -(logp * weights).sum() / weights.sum())
        torch.testing.assert_close(sft.sft_loss(policy, batch, 0.5, 1.0)[0], sft.sft_loss(
            policy, {k: v for k, v in batch.items() if k != "value_mask"}, 0.5)[0])
        # a row marked as a copy row is weighed by its loss mask alone: no context or value weight
        copy = {**batch, "copy_rows": torch.ones(1, dtype=torch.bool)}
        plain = batch["loss_mask"].clone()
        plain[:, 0] = 0
        torch.testing.assert_close(sft.sft_loss(policy, copy, 0.5, 8.0)[0], -(logp * plain).sum() / plain.sum())
    with pytest.raises(train.ConfigError, match="value_loss_weight"):
        sft.SFTConfig(value_loss_weight=float("nan")).validate()


@pytest.mark.slow
def test_sft_lowers_the_loss_and_saves_a_policy_the_trainer_loads(tmp_path, capsys):
    cfg = sft.SFTConfig(**{**SMALL, "train_tasks": 6, "max_steps": 30, "eval_every": 15, "lr": 3e-3,
                           "warmup_steps": 5, "stop_at_reward": 0.0, "max_total_tokens": 512, "max_turns": 3,
                           "max_new_tokens_per_turn": 24, "out_dir": str(tmp_path / "sft"),
                           "save_snapshots": True, "value_loss_weight": 1.0, "swap_numbers": 0.0})
    result = sft.train_sft(cfg)
    hist = result.history
    assert result.steps == 30 and [h["step"] for h in hist] == [15, 30]
    logged = capsys.readouterr().err  # no progress bar: the evaluations are printed
    assert f"sft step 15: loss {hist[0]['loss']:.4f}, validation reward {hist[0]['val_reward']:.3f}" in logged
    # 30 steps over 6 conversations: the expert tokens become much more likely than at random init
    assert hist[-1]["loss"] < 0.6 * np.log(DEFAULT_VOCAB_SIZE)
    assert (tmp_path / "sft" / "model.safetensors").is_file() and (tmp_path / "sft" / "sft_history.csv").is_file()
    # keep_best: the saved policy is the snapshot of the best evaluation (ties: the later one)
    best = max(range(len(hist)), key=lambda i: (hist[i]["val_reward"], i))
    assert [h["best"] for h in hist][best] and sum(h["best"] for h in hist[best + 1:]) == 0
    from transformers import AutoModelForCausalLM

    snap = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "snapshots" / f"step_{hist[best]['step']:06d}")
    assert all(torch.equal(a, b) for a, b in zip(snap.state_dict().values(), result.model.state_dict().values()))
    tcfg = train.TrainConfig.from_dict({"model": str(tmp_path / "sft"), "out_dir": str(tmp_path / "grpo"),
                                        "max_total_tokens": 512, "steps": 1})
    tok = train.load_tokenizer(tcfg)
    model = train.load_model(tcfg, tok, torch.device("cpu"))
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), result.model.state_dict().values()))
    assert same and tok.get_vocab() == result.tokenizer.get_vocab()
    # init_from continues from the saved policy: its first evaluation starts from the trained loss
    more = sft.train_sft(sft.SFTConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "sft"), "max_steps": 2,
                                          "eval_every": 2, "hidden_size": 32, "out_dir": str(tmp_path / "sft2")}))
    assert more.model.config.hidden_size == 64 and more.history[0]["loss"] < 0.6 * np.log(DEFAULT_VOCAB_SIZE)
    # the options (weighted values, renumbered episodes, repeated openings, recall drills) train too
    extra = sft.train_sft(sft.SFTConfig(**{**cfg.__dict__, "init_from": str(tmp_path / "sft"), "max_steps": 2,
                                           "eval_every": 2, "out_dir": str(tmp_path / "sft3"), "opening_copies": 2,
                                           "value_loss_weight": 10.0, "swap_numbers": 1.0, "recall_warmup_steps": 2,
                                           "recall_fraction": 0.2, "identity_warmup_steps": 2, "identity_rows": 2,
                                           "identity_values": "whole", "swap_digit_pairs": True, "action_rows": 2,
                                           "short_action_rows": 2, "short_warmup_steps": 2,
                                           "recall_fact_fillers": 0}))
    assert extra.steps == 2 and np.isfinite(extra.history[-1]["loss"])
    err = capsys.readouterr().err
    assert np.isfinite(extra.history[-1]["identity_loss"]) and "identity warm-up 2 steps" in err
    assert "short-row warm-up 2 steps" in err
    # the two-stage start: the identity stage continues a saved run; a finished run with the same config is reused
    stage = sft.identity_stage(tmp_path / "sft", tmp_path / "sft4", max_steps=3, threads=2)
    assert (stage.init_from, stage.out_dir, stage.hidden_size, stage.max_total_tokens) == \
        (str(tmp_path / "sft"), str(tmp_path / "sft4"), 64, 512)
    assert (stage.identity_warmup_steps, stage.identity_rows, stage.max_steps) == \
        (sft.IDENTITY_STAGE["identity_warmup_steps"], sft.IDENTITY_STAGE["identity_rows"], 3)
    lookup = sft.lookup_stage(tmp_path / "sft", tmp_path / "sft5", max_steps=3)
    assert (lookup.init_from, lookup.out_dir, lookup.hidden_size, lookup.max_steps) == \
        (str(tmp_path / "sft"), str(tmp_path / "sft5"), 64, 3)
    assert all(getattr(lookup, k) == v for k, v in sft.LOOKUP_STAGE.items() if k != "max_steps")
    stamp = (tmp_path / "sft" / "model.safetensors").stat().st_mtime_ns
    # how a run runs (threads, device, progress) is not what it learns: the finished run is reused
    assert sft.train_or_reuse(sft.SFTConfig(**{**cfg.__dict__, "threads": 2, "progress": True,
                                               "device": "cpu"})) == tmp_path / "sft"
    assert "reusing" in capsys.readouterr().err and (tmp_path / "sft" / "model.safetensors").stat().st_mtime_ns == stamp
    # the benchmark's SFT table follows init_from back through the stages, steps counted on from stage to stage
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "reproduce_curve", Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce_curve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stages = bench.sft_stages(tmp_path / "sft2")
    assert stages == [tmp_path / "sft", tmp_path / "sft2"]
    bench.data_dir = lambda: tmp_path
    # as if the first stage had saved the weights of its first evaluation: the second starts from step 15
    import pandas as pd

    first = pd.read_csv(tmp_path / "sft" / "sft_history.csv").assign(best=[True, False])
    first.to_csv(tmp_path / "sft" / "sft_history.csv", index=False)
    parts = bench.stage_histories(stages)
    table = bench.write_sft_table(parts)
    assert list(table["run"]) == ["sft", "sft", "sft2"] and list(table["total_step"]) == [15, 30, 17]
    assert list(table["init_from"].fillna("")) == ["", "", "sft"] and (tmp_path / "reward_curve_sft.csv").is_file()
    # the shape and the parameter count come from the config alone: the count of the loaded model
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert set(table["parameters"]) == {sum(p.numel() for p in loaded.parameters())}
    assert set(table["hidden_size"]) == {loaded.config.hidden_size}
    # the same stages written again keep the provenance of the run that recorded them
    pd.read_csv(tmp_path / "reward_curve_sft.csv").assign(git_sha="recorded-earlier").to_csv(
        tmp_path / "reward_curve_sft.csv", index=False)
    assert set(bench.write_sft_table(parts)["git_sha"]) == {"recorded-earlier"}
    assert set(pd.read_csv(tmp_path / "reward_curve_sft.csv")["git_sha"]) == {"recorded-earlier"}
    summary = bench.sft_summary(parts)
    assert (summary["sft_steps"], summary["sft_val_reward"]) == (17, more.history[-1]["val_reward"])
    # a shipped start keeps its stages in recipe/ (its own folder has no history): the same table from there
    from sinkflex_core import start

    start._export(tmp_path / "sft2", tmp_path / "shipped", stages)
    shipped = bench.start_histories(tmp_path / "shipped")
    assert [list(h["run"]) for _, h, _ in shipped] == [["sft", "sft"], ["sft2"]]
    assert [list(h["total_step"]) for _, h, _ in shipped] == [[15, 30], [17]]
    assert bench.sft_summary(shipped) == summary
    assert list(bench.write_sft_table(shipped)["init_from"].fillna("")) == ["", "", "sft"]
    # other stages: a new table, stamped now
    changed = [(folder, hist.assign(loss=hist["loss"] + 1), cfg) for folder, hist, cfg in shipped]
    assert set(bench.write_sft_table(changed)["git_sha"]) != {"recorded-earlier"}
    assert set(pd.read_csv(tmp_path / "reward_curve_sft.csv")["git_sha"]) != {"recorded-earlier"}


def test_expert_token_accuracy_counts_numbers_and_scores_a_model(tokenizer):
    import re

    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, [0, 1, 2], split="synthetic")
    numbers = digits = 0
    for e in examples:
        for span in _masked_spans(e["input_ids"], e["loss_mask"]):
            text = tokenizer.decode(span)
            numbers += len(re.findall(r"\d+", text))
            digits += sum(-(-len(n) // 3) for n in re.findall(r"\d+", text))  # tokens: groups of up to three
    model = build_model(tiny_qwen2_config(len(tokenizer), hidden_size=64, num_layers=2, tokenizer=tokenizer), seed=0)
    acc = sft.expert_token_accuracy(model, tokenizer, examples)
    assert acc["n_number_start"] == numbers > 0
    assert acc["n_number_rest"] == digits - numbers
    assert acc["n_other"] == sum(int(e["loss_mask"][1:].sum()) for e in examples) - digits
    assert 0 <= acc["acc_other"] < 0.2  # an untrained model
    # the identity call: its tool's name and each of its (string) arguments, one first token each
    calls = [json.loads(tokenizer.decode(o["input_ids"]).split("<tool_call>")[-1].split("</tool_call>")[0])
             for o in sft.episode_openings(examples, tokenizer.convert_tokens_to_ids("<tool_call>"))]
    assert calls and calls[0]["name"].startswith("find_user_id")
    assert acc["n_identity_call"] == sum(1 + len(c["arguments"]) for c in calls)
    # A model that predicts every next token (its logits look one step ahead) scores 1 everywhere.
    class Oracle(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.training = vocab, False
            self.head = torch.nn.Linear(1, vocab)

        def get_output_embeddings(self):
            return self.head

        def forward(self, input_ids, **kw):
            nxt = torch.roll(input_ids, -1, dims=1)
            return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})()

    perfect = sft.expert_token_accuracy(Oracle(len(tokenizer)), tokenizer, examples)
    assert perfect["acc_number_start"] == perfect["acc_number_rest"] == perfect["acc_other"] == 1.0
    assert perfect["acc_identity_call"] == 1.0 and perfect["n_identity_call"] == acc["n_identity_call"]


def test_copy_drills_repeat_a_segment_and_score_only_the_repeats():
    examples = [{"input_ids": torch.arange(3, 3 + n), "loss_mask": (torch.arange(n) % 2).long()} for n in (40, 25)]
    batch = sft.collate(examples, pad_id=0)
    out = sft.add_copy_rows(batch, 0.5, torch.arange(5, 300), np.random.default_rng(0))
    assert out["input_ids"].shape == (4, 40) and out["copy_rows"].tolist() == [False, False, True, True]
    assert torch.equal(out["input_ids"][:2], batch["input_ids"])
    for row in range(2, 4):
        ids, mask = out["input_ids"][row], out["loss_mask"][row]
        m = int((mask == 0).sum())  # the segment: unscored; everything after it repeats it
        assert 8 <= m <= 20 and mask[m:].eq(1).all()
        assert torch.equal(ids[m:], ids[:40 - m]) and ((ids >= 5) & (ids < 300)).all()
    assert out["attention_mask"][2:].eq(1).all() and torch.equal(out["position_ids"][3], torch.arange(40))
    # The loss weighs the drills' repeats only, and the expert-token count is the episodes' alone.
    logp = torch.randn(4, 40)
    policy = lambda ids, att, pos: (logp, None)  # noqa: E731
    loss, n = sft.sft_loss(policy, out, context_weight=1.0)
    assert n == int(batch["loss_mask"].sum())
    w = torch.cat([batch["attention_mask"].float(), out["loss_mask"][2:]])
    w[:, 0] = 0
    torch.testing.assert_close(loss, -(logp * w).sum() / w.sum())
    with pytest.raises(train.ConfigError, match="copy_fraction"):
        sft.SFTConfig(copy_fraction=1.0).validate()


def test_recall_drills_ask_each_key_again_after_other_fillers_and_score_its_value():
    tokens, fillers = torch.arange(10, 300), torch.arange(300, 310)  # disjoint: every position is unambiguous
    ids, mask = sft.recall_drills(6, 160, tokens, fillers, np.random.default_rng(0))
    assert ids.shape == mask.shape == (6, 160) and torch.isin(ids, torch.cat([tokens, fillers])).all()
    is_filler = torch.isin(ids, fillers)
    asked = 0
    for row in range(6):
        scored = mask[row].nonzero().flatten().tolist()
        starts = [p for p in scored if mask[row, p - 1] == 0]
        assert starts, "every row asks at least one key"
        for p in starts:
            end = p
            while end < 160 and mask[row, end] == 1:
                end += 1
            k = p - 1
            while is_filler[row, k]:
                k -= 1
            assert 1 <= p - 1 - k <= 2  # asked after one or two fillers (a call's `": "`)
            key = ids[row, k]
            earlier = (ids[row, :k] == key).nonzero().flatten()
            assert len(earlier) >= 1  # the fact; the most recent occurrence states the value
            v = int(earlier[-1]) + 1
            assert is_filler[row, v] and not is_filler[row, v + 1]  # stated after one filler (`zip 92181`)
            v += 1
            assert torch.equal(ids[row, v:v + end - p], ids[row, p:end]), (row, p)
            asked += 1
        assert mask[row, : starts[0]].sum() == 0
    assert asked >= 12
    # The e-mail's layout: three separators in the fact (`email is lucia`).
    ids, mask = sft.recall_drills(2, 160, tokens, fillers, np.random.default_rng(2), fact_fillers=(3, 3))
    for row in range(2):
        for p in [p for p in mask[row].nonzero().flatten().tolist() if mask[row, p - 1] == 0]:
            k = p - 1
            while torch.isin(ids[row, k], fillers):
                k -= 1
            v = int((ids[row, :k] == ids[row, k]).nonzero().flatten()[-1]) + 1
            assert torch.isin(ids[row, v:v + 3], fillers).all() and not torch.isin(ids[row, v + 3], fillers)
    for bad in (-1, 5):
        with pytest.raises(train.ConfigError, match="recall_fact_fillers"):
            sft.SFTConfig(recall_fact_fillers=bad).validate()
    # In a batch the drill rows are scored like copy drills: their values only.
    examples = [{"input_ids": torch.arange(3, 43), "loss_mask": torch.ones(40, dtype=torch.long)}]
    out = sft.add_drill_rows(sft.collate(examples, pad_id=0), *sft.recall_drills(1, 40, tokens, fillers,
                                                                                 np.random.default_rng(1)))
    assert out["copy_rows"].tolist() == [False, True] and out["loss_mask"][1].sum() > 0
    with pytest.raises(train.ConfigError, match="recall_fraction"):
        sft.SFTConfig(copy_fraction=0.5, recall_fraction=0.5).validate()


def test_previous_token_heads_let_a_tiny_model_leave_the_copy_plateau():
    """The claim behind ``previous_token_heads``: from random weights a tiny model stays on the loss
    plateau of copy drills, while the same model with previous-token heads learns to copy."""
    from sinkflex_core.models import init_previous_token_heads

    cfg = sft.SFTConfig(hidden_size=64, num_layers=2, batch_tokens=1024, copy_warmup_length=64,
                        copy_warmup_steps=300, lr=3e-3, warmup_steps=10, progress=False, max_total_tokens=512)
    final = {}
    for prev in (False, True):
        model = build_model(tiny_qwen2_config(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                              num_kv_heads=2), seed=0)
        model.config._attn_implementation = "sdpa"
        if prev:
            init_previous_token_heads(model, n_pos=64, steps=150)
        losses = sft.copy_warmup(train.TokenLogprobs(model.train()), cfg, torch.arange(3, 503),
                                 np.random.default_rng(0))
        assert len(losses) == 300 and abs(losses[0] - np.log(512)) < 0.5
        final[prev] = float(np.mean(losses[-10:]))
    assert final[False] > 5.0 and final[True] < 3.5, final


def test_copy_warmup_and_previous_token_heads_in_the_sft_config():
    batch = sft.copy_drill_batch(4, 32, torch.arange(10, 20), np.random.default_rng(0))
    assert batch["copy_rows"].all() and batch["input_ids"].shape == (4, 32)
    assert torch.equal(batch["position_ids"][2], torch.arange(32)) and batch["attention_mask"].eq(1).all()
    with pytest.raises(train.ConfigError, match="copy_warmup_length"):
        sft.SFTConfig(copy_warmup_length=8).validate()
    with pytest.raises(train.ConfigError, match="copy_warmup_steps"):
        sft.SFTConfig(copy_warmup_steps=-1).validate()


def test_swap_names_renames_people_and_places_the_same_way_everywhere(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(12)))
    groups = sft.name_swap_groups(tokenizer, examples)
    words = {tokenizer.decode([int(i)]) for g in groups for i in g.flatten()}
    assert {"Anya", "anya", "Walker", "walker", "Oak", "Denver"} <= words
    # a last name that is also a colour, a street, and a two-word city stay as they are
    assert not {"Green", "green", "Hill", "hill", "San", "Diego"} & words
    rng = np.random.default_rng(0)
    changed = 0
    for ex in examples:
        out = sft.swap_names(ex, groups, rng)
        assert torch.equal(out["loss_mask"], ex["loss_mask"]) and out["input_ids"].shape == ex["input_ids"].shape
        before, after = tokenizer.decode(ex["input_ids"]), tokenizer.decode(out["input_ids"])
        changed += before != after
        # one mapping per episode: every occurrence of a word became the same word
        mapping = {}
        for a, b in zip(ex["input_ids"].tolist(), out["input_ids"].tolist()):
            assert mapping.setdefault(a, b) == b
        assert len(set(mapping.values())) == len(mapping)  # a permutation: no two words merged
        # what the customer says, the tool calls and the records still agree after renaming
        user_id = after.split('"user_id": "')[1].split('"')[0]
        first, last = user_id.split("_")[:2]
        assert f'"name":"{first.capitalize()} {last.capitalize()}"' in after
    assert changed >= 10
    with pytest.raises(sft.ConfigError, match="swap_names"):
        sft.SFTConfig(swap_names=1.5).validate()


def test_recall_drills_without_separators_are_plain_induction_from_one_token():
    """``recall_fact_fillers=0``: `key value` stated, then asked again right after a different token
    (the zip code's last digits after its first three)."""
    layout = sft.recall_layout(sft.SFTConfig(recall_fact_fillers=0))
    assert layout == {"fact_fillers": (0, 0), "ask_fillers": (0, 0)}
    assert sft.recall_layout(sft.SFTConfig(recall_fact_fillers=3)) == {"fact_fillers": (1, 3)}
    tokens, fillers = torch.arange(10, 300), torch.arange(300, 310)
    ids, mask = sft.recall_drills(6, 160, tokens, fillers, np.random.default_rng(3), **layout)
    assert not torch.isin(ids[mask.bool()], fillers).any()
    asked = differ = 0
    for row in range(6):
        scored = mask[row].nonzero().flatten().tolist()
        starts = [p for p in scored if mask[row, p - 1] == 0]
        assert starts
        for p in starts:
            end = p
            while end < 160 and mask[row, end] == 1:
                end += 1
            key = ids[row, p - 1]  # the key right before the value: no separator
            assert not torch.isin(key, fillers)
            earlier = (ids[row, :p - 1] == key).nonzero().flatten()
            assert len(earlier) >= 1
            v = int(earlier[-1]) + 1  # the fact: the value right after the key, as asked
            assert torch.equal(ids[row, v:v + end - p], ids[row, p:end]), (row, p)
            differ += int(ids[row, p - 2] != ids[row, v - 2])
            asked += 1
    assert asked >= 12 and differ >= 0.8 * asked  # mostly another token before the key: a one-token match


def test_recall_rows_mix_the_two_layouts_of_a_zip_code():
    """``recall_plain_share``: some rows drill plain induction (no separator before any scored value),
    the others the layout of ``recall_fact_fillers`` (a separator before every scored value)."""
    tokens, fillers = torch.arange(10, 300), torch.arange(300, 310)

    def layouts(cfg, rows=40, seed=0):
        ids, mask = sft.recall_rows(cfg, rows, 96, tokens, fillers, np.random.default_rng(seed))
        assert ids.shape == mask.shape == (rows, 96) and (mask.sum(1) > 0).all()
        before = [torch.isin(ids[r, :-1][mask[r, 1:].bool() & (mask[r, :-1] == 0)], fillers) for r in range(rows)]
        assert all(b.all() or not b.any() for b in before)  # one layout a row
        return sum(int(not b.any()) for b in before)

    assert layouts(sft.SFTConfig(recall_fact_fillers=1)) == 0
    assert layouts(sft.SFTConfig(recall_fact_fillers=1, recall_plain_share=1.0)) == 40
    assert layouts(sft.SFTConfig(recall_fact_fillers=0, recall_plain_share=0.3)) == 40
    plain = layouts(sft.SFTConfig(recall_fact_fillers=1, recall_plain_share=0.5))
    assert 10 <= plain <= 30
    # without the share, the rows are those recall_drills makes from the same generator (recordings unchanged)
    ref = sft.recall_drills(5, 96, tokens, fillers, np.random.default_rng(7), **sft.recall_layout(sft.SFTConfig()))
    got = sft.recall_rows(sft.SFTConfig(), 5, 96, tokens, fillers, np.random.default_rng(7))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    for bad in (-0.1, 1.5):
        with pytest.raises(sft.ConfigError, match="recall_plain_share"):
            sft.SFTConfig(recall_plain_share=bad).validate()


def test_episode_openings_end_with_the_first_tool_call(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(6)))
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    openings = sft.episode_openings(examples, call_id)
    assert len(openings) == len(examples)
    for ex, op in zip(examples, openings):
        n = len(op["input_ids"])
        assert n < len(ex["input_ids"]) and torch.equal(op["input_ids"], ex["input_ids"][:n])
        assert torch.equal(op["loss_mask"], ex["loss_mask"][:n])
        spans = _masked_spans(op["input_ids"], op["loss_mask"])
        # the last expert turn is the first tool call, closed; no earlier turn called a tool
        assert tokenizer.decode(spans[-1]).startswith("<tool_call>") and spans[-1][-1] == tokenizer.eos_token_id
        assert all(call_id not in s for s in spans[:-1])
        assert op["loss_mask"][-1] == 1  # nothing of the tool's reply is kept
    # an episode whose expert never calls a tool has no opening
    no_call = {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])}
    assert sft.episode_openings([no_call], call_id) == []
    with pytest.raises(sft.ConfigError, match="opening_copies"):
        sft.SFTConfig(opening_copies=-1).validate()


def test_identity_batch_scores_the_tool_name_and_the_values_read_from_the_customer(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(12)))
    openings = sft.episode_openings(examples, tokenizer.convert_tokens_to_ids("<tool_call>"))
    groups = sft.name_swap_groups(tokenizer, examples) + [sft.number_swap_group(tokenizer)]  # as train_sft does
    tables = sft.value_start_tokens(tokenizer)
    batch = sft.identity_batch(openings, 16, np.random.default_rng(0), tokenizer.pad_token_id, tables, groups)
    assert batch["input_ids"].shape[0] == 16 and batch["copy_rows"].all()
    texts = sft.token_texts(tokenizer)
    kinds = set()
    for ids, att, mask in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        n = int(att.sum())
        assert att[:n].all() and not att[n:].any() and not mask[n:].any()
        call = tokenizer.decode(ids[:n]).rsplit("<tool_call>", 1)[1]
        scored = mask.nonzero().flatten().tolist()
        assert texts[int(ids[scored[0]])] == "find"  # the tool's name: find_user_id_by_...
        customer = tokenizer.decode(ids[:scored[0]]).rsplit("<|im_start|>user", 1)[1]
        assert len(scored) == (4 if "by_name_zip" in call else 2)
        for p in scored[1:]:  # e-mail / first name, last name, zip: the customer's own words
            kinds.add(texts[int(ids[p - 3])])
            assert texts[int(ids[p])].strip() in customer
            assert mask[p] == 1 and int(ids[p]) in ids[:scored[0]].tolist()
    assert {"email", "name", "zip"} <= kinds
    # without groups the rows are the openings as they are; with them, renamed
    originals = {tuple(op["input_ids"].tolist()) for op in openings}
    plain = sft.identity_batch(openings, 16, np.random.default_rng(0), tokenizer.pad_token_id, tables)
    assert all(tuple(ids[:int(att.sum())].tolist()) in originals
               for ids, att in zip(plain["input_ids"], plain["attention_mask"]))
    assert sum(tuple(ids[:int(att.sum())].tolist()) not in originals
               for ids, att in zip(batch["input_ids"], batch["attention_mask"])) >= 12
    # with the quote table every token of each value is scored: the tool's whole name, the whole
    # e-mail, both names and the whole zip code, exactly the call's arguments
    whole = sft.identity_batch(openings, 16, np.random.default_rng(0), tokenizer.pad_token_id, tables, groups,
                               sft.quote_tokens(tokenizer))
    assert torch.equal(whole["input_ids"], batch["input_ids"])
    assert (whole["loss_mask"] >= batch["loss_mask"]).all() and whole["loss_mask"].sum() > batch["loss_mask"].sum()
    for ids, att, mask in zip(whole["input_ids"], whole["attention_mask"], whole["loss_mask"]):
        n = int(att.sum())
        call = json.loads(tokenizer.decode(ids[:n]).rsplit("<tool_call>", 1)[1].split("</tool_call>")[0])
        scored = mask[:n].nonzero().flatten().tolist()
        spans, current = [], [scored[0]]
        for p in scored[1:]:
            if p == current[-1] + 1:
                current.append(p)
            else:
                spans.append(current)
                current = [p]
        spans.append(current)
        assert [tokenizer.decode(ids[sp]) for sp in spans] == [call["name"], *call["arguments"].values()]
    with pytest.raises(ValueError, match="opening"):
        sft.identity_batch([], 2, np.random.default_rng(0), 0, tables)
    with pytest.raises(sft.ConfigError, match="identity_values"):
        sft.SFTConfig(identity_values="all").validate()
    with pytest.raises(sft.ConfigError, match="identity_rows"):
        sft.SFTConfig(identity_rows=-1).validate()


def test_action_batch_scores_the_values_of_one_later_tool_call(tokenizer):
    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(12)))
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    cuts = sft.action_cuts(examples, call_id)
    calls = sum(int(((e["input_ids"] == call_id) & e["loss_mask"].bool()).sum()) for e in examples)
    assert len(cuts) == calls - len(examples)  # every tool call but each episode's first
    for n, start, end, whole in cuts:
        turn = examples[n]["input_ids"][start:end]
        assert not whole
        assert examples[n]["loss_mask"][start:end].all() and call_id in turn.tolist()
        assert start == 0 or examples[n]["loss_mask"][start - 1] == 0  # the whole turn
    tables, quotes = sft.value_start_tokens(tokenizer), sft.quote_tokens(tokenizer)
    batch = sft.action_batch(examples, cuts, 16, np.random.default_rng(0), tokenizer.pad_token_id, tables,
                             quotes=quotes)
    assert batch["copy_rows"].all() and batch["input_ids"].shape[0] == 16
    names = set()
    for ids, att, mask in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        n = int(att.sum())
        text = tokenizer.decode(ids[:n])
        assert text.endswith("</tool_call><|im_end|>")  # cut right after the call's turn
        call = json.loads(text.rsplit("<tool_call>", 1)[1].split("</tool_call>")[0])
        scored = mask[:n].nonzero().flatten()
        last_turn = int((ids[:n] == tokenizer.convert_tokens_to_ids("<|im_start|>")).nonzero().flatten()[-1])
        assert int(scored.min()) > last_turn  # nothing of the earlier turns, their calls included
        values = [v[0] if isinstance(v, list) else v for v in call["arguments"].values()]
        want = call["name"] + "".join(v.removeprefix("#W") for v in values)  # an order id's W is the same in all
        assert tokenizer.decode(ids[scored]).replace(" ", "") == want.replace(" ", "")
        names.add(call["name"])
    assert len(names) >= 3
    with pytest.raises(ValueError, match="tool call"):
        sft.action_batch(examples, [], 2, np.random.default_rng(0), 0, tables)
    # only the calls of the named tools, and the expert's messages between its first and last call
    texts = sft.token_texts(tokenizer)
    some = sorted(names)[:2]
    kept = sft._action_cuts(sft.SFTConfig(action_rows=1, action_tools=",".join(some), action_messages=True),
                            tokenizer, examples)
    assert [c for c in kept if not c[3]] == [c for c in cuts if sft.call_name(examples[c[0]]["input_ids"][c[1]:c[2]],
                                                                             texts) in some]
    assert {sft.call_name(examples[n]["input_ids"][a:b], texts) for n, a, b, w in kept if not w} == set(some)
    messages = [c for c in kept if c[3]]
    every = sft.action_cuts(examples, call_id, messages=True)
    assert messages and messages == [c for c in every if c[3]]
    # action_confirmations: only the messages whose next call is one of the tools

    def next_call(cut):
        n, _, end, _ = cut
        return sft.call_name(examples[n]["input_ids"][end:], texts)

    confirming = sft._action_cuts(sft.SFTConfig(action_rows=1, action_tools=",".join(some), action_messages=True,
                                                action_confirmations=True), tokenizer, examples)
    assert [c for c in confirming if not c[3]] == [c for c in kept if not c[3]]
    assert [c for c in confirming if c[3]] == [c for c in messages if next_call(c) in some]
    assert 0 < sum(c[3] for c in confirming) < len(messages)
    with pytest.raises(sft.ConfigError, match="action_confirmations"):
        sft.SFTConfig(action_rows=1, action_messages=True, action_confirmations=True).validate()
    for n, start, end, _ in messages:
        ids, mask = examples[n]["input_ids"], examples[n]["loss_mask"].bool()
        assert call_id not in ids[start:end].tolist() and mask[start:end].all() and not mask[end]
        before = ((ids[:start] == call_id) & mask[:start]).any()
        after = ((ids[end:] == call_id) & mask[end:]).any()
        assert before and after  # between the episode's first call and its last
    batch = sft.action_batch(examples, messages, 8, np.random.default_rng(1), tokenizer.pad_token_id, tables,
                             quotes=quotes)
    for ids, att, mask in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        n = int(att.sum())
        last_turn = int((ids[:n] == tokenizer.convert_tokens_to_ids("<|im_start|>")).nonzero().flatten()[-1])
        scored = mask[:n].nonzero().flatten()
        # every token of the message after its header is scored, nothing before it
        assert int(scored.min()) > last_turn and int(scored.max()) == n - 1
        assert len(scored) == n - int(scored.min()) and "<tool_call>" not in tokenizer.decode(ids[scored])
    with pytest.raises(sft.ConfigError, match="never call"):
        sft._action_cuts(sft.SFTConfig(action_rows=1, action_tools="no_such_tool"), tokenizer, examples)
    with pytest.raises(sft.ConfigError, match="action_rows"):
        sft.SFTConfig(action_rows=-1).validate()
    with pytest.raises(sft.ConfigError, match="set action_rows"):
        sft.SFTConfig(action_messages=True).validate()


def test_short_action_rows_keep_the_turns_the_cut_turn_reads(tokenizer):
    import re

    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(16)))
    call_id, turn_id = tokenizer.convert_tokens_to_ids("<tool_call>"), tokenizer.convert_tokens_to_ids("<|im_start|>")
    texts = sft.token_texts(tokenizer)
    cuts = sft.action_cuts(examples, call_id, messages=True)

    def turns(ids):
        at = (ids == turn_id).nonzero().flatten().tolist() + [len(ids)]
        return [tokenizer.decode(ids[a:b]) for a, b in zip(at[:-1], at[1:])]

    shorter = 0
    for n, start, end, whole in cuts:
        ids, mask = examples[n]["input_ids"], examples[n]["loss_mask"]
        row = sft.short_context(examples[n], start, end, texts, turn_id)
        k = len(row["input_ids"]) - (end - start)
        # the cut turn closes the row, scored as in the episode; nothing before it is scored
        assert torch.equal(row["input_ids"][k:], ids[start:end]) and torch.equal(row["loss_mask"][k:], mask[start:end])
        assert not row["loss_mask"][:k].any()
        full, short = turns(ids[:end]), turns(row["input_ids"])
        assert short[-1] == full[-1]
        # whole turns of the episode, in its order
        it = iter(full[:-1])
        assert all(any(t == u for u in it) for t in short[:-1])
        # the call whose values pick the tool outputs: the turn's own, else the next call of the episode
        later = tokenizer.decode(ids[start:]) if whole else full[-1]
        call = later.split("<tool_call>", 1)[1].split("</tool_call>")[0]
        values = [v for v in re.findall(r'"([^"]+)"', call.split('"arguments"', 1)[1]) if re.search(r"\d", v)]
        for t in full[:-1]:
            head = t[:40]
            if "<tool_response>" in head:  # a tool output stays exactly when it holds one of the values
                assert (t in short) == any(v in t for v in values), (t, values)
            elif "assistant" in head and "<tool_call>" in head:
                assert t not in short  # the expert's earlier calls go
            else:
                assert t in short  # the system turn, the customer's sentences, the expert's messages
        shorter += len(row["input_ids"]) < end
    assert shorter > len(cuts) // 2
    # the payment method's record stays for a payment confirmation, the order's for an address call
    kinds = set()
    for n, start, end, whole in cuts:
        turn = tokenizer.decode(examples[n]["input_ids"][start:end])
        text = tokenizer.decode(sft.short_context(examples[n], start, end, texts, turn_id)["input_ids"])
        if whole and "I will pay" in turn:
            assert '"payment_methods"' in text
            kinds.add("payment")
        if "modify_pending_order_address" in turn:
            assert '"order_id"' in text.split("</tool_call>")[0] and "<tool_response>" in text
            kinds.add("address")
    assert kinds
    # action_batch with short: the same cuts drawn, the same tokens scored, shorter rows
    tables, quotes = sft.value_start_tokens(tokenizer), sft.quote_tokens(tokenizer)
    long = sft.action_batch(examples, cuts, 12, np.random.default_rng(3), tokenizer.pad_token_id, tables, quotes=quotes)
    brief = sft.action_batch(examples, cuts, 12, np.random.default_rng(3), tokenizer.pad_token_id, tables,
                             quotes=quotes, short=(texts, turn_id))
    assert brief["copy_rows"].all()
    assert [tokenizer.decode(i[m.bool()]) for i, m in zip(long["input_ids"], long["loss_mask"])] == \
        [tokenizer.decode(i[m.bool()]) for i, m in zip(brief["input_ids"], brief["loss_mask"])]
    assert brief["attention_mask"].sum() < long["attention_mask"].sum()
    with pytest.raises(sft.ConfigError, match="short_action_rows"):
        sft.SFTConfig(short_action_rows=-1).validate()
    with pytest.raises(sft.ConfigError, match="short_warmup_steps"):
        sft.SFTConfig(short_warmup_steps=1.5).validate()
    sft.SFTConfig(short_warmup_steps=3, action_tools="modify_user_address").validate()
    sft.SFTConfig(short_action_rows=2, action_messages=True).validate()


def test_swap_numbers_renumbers_every_id_and_zip_the_same_way_everywhere(tokenizer):
    import re

    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(8)))
    group = sft.number_swap_group(tokenizer)
    assert group.shape == (1000, 1)  # every group of three digits is one token
    rng = np.random.default_rng(0)
    for ex in examples:
        out = sft.swap_names(ex, [group], rng)
        before, after = tokenizer.decode(ex["input_ids"]), tokenizer.decode(out["input_ids"])
        nums_before, nums_after = re.findall(r"\d+", before), re.findall(r"\d+", after)
        # the text is the same but for digits; each number keeps its length, and numbers below 100 stay
        assert re.sub(r"\d", "0", before) == re.sub(r"\d", "0", after)
        assert [n for n in nums_before if len(n) < 3] == [n for n in nums_after if len(n) < 3]
        # one renumbering per episode: equal numbers stay equal, different ones stay different
        mapping = {}
        for a, b in zip(nums_before, nums_after):
            assert mapping.setdefault(a, b) == b
        assert len(set(mapping.values())) == len(mapping)
        assert sum(a != b for a, b in mapping.items()) >= len([n for n in mapping if len(n) >= 3]) // 2
        # the zip or e-mail in the customer's sentence is the one in the call and the record
        zips = re.findall(r'"zip": ?"(\d+)"', after)
        assert len(set(zips)) >= 1 and all(z in after.split("<tool_call>")[0] or '"zip":"' + z in after for z in zips)
    with pytest.raises(sft.ConfigError, match="swap_numbers"):
        sft.SFTConfig(swap_numbers=-0.1).validate()


def test_swap_digit_pairs_renumbers_a_zip_codes_last_digits_the_same_way_everywhere(tokenizer):
    import re

    cfg = sft.SFTConfig(**{**SMALL, "max_total_tokens": 1 << 16})
    examples = sft.expert_examples(tokenizer, cfg, list(range(8)))
    pairs = sft.digit_pair_group(tokenizer)
    assert pairs.shape == (100, 1)  # 00 ... 99, each one token
    groups = [sft.number_swap_group(tokenizer), pairs]
    rng = np.random.default_rng(1)
    changed = kept = 0
    for ex in examples:
        before = tokenizer.decode(ex["input_ids"])
        after = tokenizer.decode(sft.swap_names(ex, groups, rng)["input_ids"])
        assert re.sub(r"\d", "0", before) == re.sub(r"\d", "0", after)  # only digits change, lengths kept
        zips_before = re.findall(r"zip (\d{5})", before) + re.findall(r'"zip": ?"(\d{5})"', before)
        zips_after = re.findall(r"zip (\d{5})", after) + re.findall(r'"zip": ?"(\d{5})"', after)
        mapping = {}
        for a, b in zip(zips_before, zips_after):
            assert mapping.setdefault(a, b) == b  # the customer's zip is the call's and the record's
        changed += sum(a[3:] != b[3:] for a, b in mapping.items())
        kept += len(mapping)
    assert kept >= 2 and changed >= kept // 2  # the last two digits are renumbered too


# -- the attention of the SFT: the start can learn under the sink attention GRPO will use --

SINK_RUN = {**SMALL, "train_tasks": 2, "max_steps": 2, "eval_every": 2, "val_tasks": 1, "max_turns": 2,
            "max_total_tokens": 512, "max_new_tokens_per_turn": 8, "copy_warmup_steps": 2, "lr": 3e-3,
            "warmup_steps": 1, "stop_at_reward": 0.0, "attention": "sinkflex", "n_sink": 2, "window": 16,
            "layer_sinks": [2, 3]}


def test_attention_options_of_the_sft_config_are_checked():
    assert sft.SFTConfig().sink_settings() is None  # the default: full causal attention, as before
    cfg = sft.SFTConfig(attention="sinkflex", n_sink=4, window=256)
    assert cfg.sink_settings() == {"n_sink": 4, "window": 256, "learn_sinks": True, "layer_sinks": None}
    assert sft.SFTConfig(attention="sinkflex", layer_sinks=train.parse_field(sft.SFTConfig, "layer_sinks", "4,8")
                         ).sink_counts() == [4, 8]
    for bad in ({"attention": "flex"}, {"attention": "sinkflex", "window": 0}, {"n_sink": -1},
                {"attention": "sinkflex", "layer_sinks": "auto"},
                {"attention": "sinkflex", "layer_sinks": "no/such/sinks.json"},
                {"attention": "sinkflex", "layer_sinks": [4, -1]}):
        with pytest.raises(train.ConfigError):
            sft.SFTConfig(**bad).validate()


def test_sft_command_line_has_the_attention_options(capsys):
    assert sft.main(["--attention", "sinkflex", "--n-sink", "4", "--window", "0", "--no-progress"]) == 2
    assert "window must be a positive integer" in capsys.readouterr().err
    assert sft.main(["--attention", "sinkflex", "--layer-sinks", "no/such/folder"]) == 2
    assert "layer_sinks" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sink_attention_sft_trains_the_sink_logits_and_saves_the_attention(tmp_path, monkeypatch):
    from sinkflex_core import attention, models

    result = sft.train_sft(sft.SFTConfig(**{**SINK_RUN, "out_dir": str(tmp_path / "sink")}))
    assert result.steps == 2 and np.isfinite(result.history[-1]["loss"])
    want = {"n_sink": 2, "window": 16, "layer_sinks": [2, 3], "learn_sinks": True}
    assert attention.attention_settings(result.model) == want
    assert attention.attention_settings(tmp_path / "sink") == want
    # the sink logits were in the optimizers (warm-up and SFT): they left their initial value
    logits = attention.sink_parameters(result.model)
    assert len(logits) == 2 and all((p != attention.DEFAULT_SINK_LOGIT).all() for p in logits)
    assert json.loads((tmp_path / "sink" / "sft_config.json").read_text())["attention"] == "sinkflex"
    # the saved folder loads as the model that was trained: 64 tokens, four windows of 16
    ids = torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = result.model(input_ids=ids).logits
        reloaded = models.load_policy(tmp_path / "sink")(input_ids=ids).logits
        full = models.load_policy(tmp_path / "sink", attn_implementation="sdpa")
        attention.apply(full, window=None, n_sink=0)  # the same weights and sink logits, no window
        wide = full(input_ids=ids).logits
    torch.testing.assert_close(reloaded, trained, rtol=0, atol=1e-5)
    assert (wide - trained).abs().max() > 1e-3  # the window matters here, so the comparison above can fail
    # continuing the run keeps its learned sink logits; continuing it on full attention is refused
    cont = sft._build_model(sft.SFTConfig(**{**SINK_RUN, "init_from": str(tmp_path / "sink")}), result.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(attention.sink_parameters(cont), logits))
    with pytest.raises(train.ConfigError, match="trained with sink attention"):
        sft._build_model(sft.SFTConfig(**{**SINK_RUN, "attention": "sdpa", "init_from": str(tmp_path / "sink")}),
                         result.tokenizer)
    # the attention is part of the key of train_or_reuse: the same run is reused, the full-attention one is not
    def no_training(cfg):
        raise AssertionError("trained again")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert sft.train_or_reuse(sft.SFTConfig(**{**SINK_RUN, "out_dir": str(tmp_path / "sink")})) == tmp_path / "sink"
    with pytest.raises(AssertionError, match="trained again"):
        sft.train_or_reuse(sft.SFTConfig(**{**SINK_RUN, "window": 32, "out_dir": str(tmp_path / "sink")}))


def test_a_saved_config_from_before_the_attention_options_is_reused_as_full_attention(tmp_path, monkeypatch):
    cfg = sft.SFTConfig(**{**SMALL, "out_dir": str(tmp_path)})
    old = {k: v for k, v in json.loads(json.dumps(cfg.__dict__)).items()
           if k not in ("attention", "n_sink", "window", "learn_sinks", "layer_sinks")}
    (tmp_path / "sft_config.json").write_text(json.dumps(old))
    (tmp_path / "model.safetensors").write_bytes(b"")

    def no_training(cfg):
        raise AssertionError("trained again")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert sft.train_or_reuse(cfg) == tmp_path
    with pytest.raises(AssertionError, match="trained again"):
        sft.train_or_reuse(sft.SFTConfig(**{**SMALL, "out_dir": str(tmp_path), "attention": "sinkflex"}))


def test_a_retrain_cut_off_in_a_finished_folder_is_not_reused_as_the_earlier_run(tmp_path, monkeypatch):
    """A finished run A, then a run B of another config into the same folder, cut off after its first
    evaluation (its history written) or while saving (its weights written): train_or_reuse(A) must not
    reuse the folder as A's finished run, and an interruption before B writes anything keeps A."""
    small = {**SMALL, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "train_tasks": 4,
             "max_total_tokens": 512, "max_turns": 3, "max_new_tokens_per_turn": 16, "copy_warmup_steps": 1,
             "stop_at_reward": 0.0, "max_steps": 2, "eval_every": 1, "out_dir": str(tmp_path / "sft")}
    a, b = sft.SFTConfig(**small), sft.SFTConfig(**{**small, "lr": 1e-3})
    sft.train_or_reuse(a)
    weights_a = (tmp_path / "sft" / "model.safetensors").read_bytes()
    trained = []
    real_train = sft.train_sft

    def counting(cfg, save=True):
        trained.append(cfg.lr)
        return real_train(cfg, save)

    monkeypatch.setattr(sft, "train_sft", counting)

    def cut_off_b(name: str, after: bool) -> None:
        """Run B with sft.<name> raising KeyboardInterrupt, before or after doing its work."""
        real = getattr(sft, name)

        def stop(*args, **kwargs):
            if after:
                real(*args, **kwargs)
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(sft, name, stop)
            with pytest.raises(KeyboardInterrupt):
                sft.train_or_reuse(b)

    cut_off_b("_prepare", after=False)  # before B writes into the folder (its data or warm-ups): A stays
    sft.train_or_reuse(a)
    assert trained == [1e-3]
    cut_off_b("_evaluate", after=True)  # after B's first evaluation (its history replaced A's)
    sft.train_or_reuse(a)
    assert trained == [1e-3, 1e-3, 2e-3]  # trained again, not reused with B's history
    cut_off_b("_save_policy", after=True)  # killed while saving: B's weights written, its config not yet
    assert (tmp_path / "sft" / "model.safetensors").read_bytes() != weights_a
    sft.train_or_reuse(a)
    assert trained == [1e-3, 1e-3, 2e-3, 1e-3, 2e-3]
    assert (tmp_path / "sft" / "model.safetensors").read_bytes() == weights_a  # A again (seeded)
    assert json.loads((tmp_path / "sft" / "sft_config.json").read_text())["lr"] == 2e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_stage_is_trained_again_when_its_base_or_its_sink_counts_changed(tmp_path, monkeypatch):
    """train_or_reuse of a stage continued from another run (init_from) notices that the base was trained
    again, although the stage's own settings override the base's changed one (max_steps), and that the
    sink counts file its layer_sinks names now holds other counts."""
    small = {**SMALL, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "train_tasks": 4,
             "max_total_tokens": 512, "max_turns": 3, "max_new_tokens_per_turn": 16, "copy_warmup_steps": 1,
             "stop_at_reward": 0.0, "eval_every": 2}
    stage = {"identity_warmup_steps": 1, "identity_rows": 1, "max_steps": 1, "eval_every": 1}
    base = sft.train_or_reuse(sft.SFTConfig(**small, max_steps=2, out_dir=str(tmp_path / "sft")))
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_identity", **stage))
    trained = []
    real_train = sft.train_sft

    def counting(cfg, save=True):
        trained.append(Path(cfg.out_dir).name)
        return real_train(cfg, save)

    monkeypatch.setattr(sft, "train_sft", counting)
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_identity", **stage))
    assert trained == []  # nothing changed: reused
    sft.train_or_reuse(sft.SFTConfig(**small, max_steps=4, out_dir=str(tmp_path / "sft")))
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_identity", **stage))
    assert trained == ["sft", "sft_identity"]
    # a sink-attention stage whose counts file changed since
    (base / "sinkflex_sinks.json").write_text(json.dumps({"n_sink": [1]}))
    sink = {**stage, "identity_warmup_steps": 0, "identity_rows": 0, "attention": "sinkflex", "window": 64,
            "layer_sinks": str(base / "sinkflex_sinks.json")}
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_sink", **sink))
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_sink", **sink))
    assert trained == ["sft", "sft_identity", "sft_sink"]
    (base / "sinkflex_sinks.json").write_text(json.dumps({"n_sink": [2]}))
    sft.train_or_reuse(sft.identity_stage(base, tmp_path / "sft_sink", **sink))
    assert trained == ["sft", "sft_identity", "sft_sink", "sft_sink"]
    # counts estimated on a folder's weights go when those weights are trained again
    sft.train_or_reuse(sft.SFTConfig(**small, max_steps=3, out_dir=str(tmp_path / "sft")))
    assert not (base / "sinkflex_sinks.json").exists()


def test_options_that_cannot_work_are_refused_before_the_warm_ups(tmp_path, monkeypatch):
    with pytest.raises(train.ConfigError, match="not a multiple"):
        sft.SFTConfig(hidden_size=32, num_heads=3, num_kv_heads=1).validate()
    with pytest.raises(train.ConfigError, match="previous_token_heads"):
        sft.SFTConfig(num_heads=2, num_kv_heads=2).validate()
    sft.SFTConfig(num_heads=2, num_kv_heads=2, previous_token_heads=False).validate()
    with pytest.raises(train.ConfigError, match="3 counts for a model of 2 layers"):
        sft.SFTConfig(num_layers=2, attention="sinkflex", layer_sinks=[4, 4, 4]).validate()

    def no_warmup(*args, **kwargs):
        raise AssertionError("warm-up before the options were checked")

    monkeypatch.setattr(sft, "copy_warmup", no_warmup)
    with pytest.raises(train.ConfigError, match="never call"):
        sft.train_sft(sft.SFTConfig(**{**SMALL, "train_tasks": 4, "action_rows": 1, "action_tools": "no_such_tool",
                                       "out_dir": str(tmp_path / "sft")}))


def test_a_continued_run_records_the_shape_of_the_weights_it_continued(tmp_path, monkeypatch):
    """`--init-from` with the command's default shape fields: the saved config names the continued
    weights' shape (a model card or a later stage reads it), and the same command is reused."""
    small = {**SMALL, "train_tasks": 4, "max_total_tokens": 512, "max_turns": 3, "max_new_tokens_per_turn": 16,
             "copy_warmup_steps": 1, "stop_at_reward": 0.0, "max_steps": 1, "eval_every": 1}
    base = sft.train_or_reuse(sft.SFTConfig(**{**small, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                               "num_kv_heads": 1, "out_dir": str(tmp_path / "base")}))
    command = sft.SFTConfig(**{**small, "init_from": str(base), "out_dir": str(tmp_path / "next")})
    assert (command.hidden_size, command.num_layers) != (32, 1)
    sft.train_or_reuse(command)
    saved = sft.saved_config(tmp_path / "next")
    assert [saved[k] for k in sft.SHAPE_FIELDS] == [command.vocab_size, 32, 1, 2, 1]

    def no_training(cfg):
        raise AssertionError("trained again")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert sft.train_or_reuse(command) == tmp_path / "next"


@pytest.mark.parametrize("sink_attention", [False, True])
def test_bf16_runs_the_decoder_in_bfloat16_and_keeps_weights_grads_and_head_in_float32(sink_attention):
    from sinkflex_core import attention
    from sinkflex_core.train.policy import TokenLogprobs

    tok = get_tokenizer()
    model = build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=0)
    if sink_attention:
        attention.apply(model, n_sink=2, window=16)
    ids = torch.randint(20, 2000, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    pos = torch.arange(48).expand(2, -1)
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    exact, _ = TokenLogprobs(model)(ids, mask, pos)
    mixed_policy = TokenLogprobs(model, autocast_dtype=torch.bfloat16)
    mixed, _ = mixed_policy(ids, mask, pos)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    assert mixed.dtype == torch.float32
    gap = (mixed - exact).abs().max().item()
    assert 0 < gap < 0.15, gap  # bfloat16's rounding, not another model
    mixed[:, 1:].mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert any("sink" in n for n in grads) == sink_attention
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_is_an_option_of_the_sft_command_line_off_by_default():
    import argparse

    p = argparse.ArgumentParser()
    train.add_config_arguments(p, sft.SFTConfig, keep_defaults=True)
    assert sft.SFTConfig().bf16 is False and p.parse_args([]).bf16 is False
    assert p.parse_args(["--bf16"]).bf16 is True and p.parse_args(["--no-bf16"]).bf16 is False


def test_a_run_of_the_warm_ups_alone_trains_the_short_rows_it_asks_for_and_evaluates_nothing(tmp_path, monkeypatch):
    """``max_steps`` 0 (the address stage's drill): the short-row warm-up with ``short_warmup_rows`` rows a
    step, its weights saved as they end, an empty history; a config that would train nothing is refused."""
    small = {**SMALL, "train_tasks": 4, "max_total_tokens": 512, "max_turns": 3, "max_new_tokens_per_turn": 16,
             "copy_warmup_steps": 1, "stop_at_reward": 0.0, "max_steps": 1, "eval_every": 1}
    base = sft.train_or_reuse(sft.SFTConfig(**{**small, "out_dir": str(tmp_path / "base")}))
    rows = []
    real_batch = sft.action_batch

    def counted(data, cuts, n, *args, **kwargs):
        rows.append((n, kwargs.get("short") is not None))
        return real_batch(data, cuts, n, *args, **kwargs)

    def no_evaluation(*args, **kwargs):
        raise AssertionError("a run of warm-ups alone plays no validation episode")

    monkeypatch.setattr(sft, "action_batch", counted)
    monkeypatch.setattr(sft, "evaluate_policy", no_evaluation)
    drill = sft.SFTConfig(**{**small, "init_from": str(base), "out_dir": str(tmp_path / "drill"), "max_steps": 0,
                             "short_warmup_steps": 3, "short_warmup_rows": 5})
    out = sft.train_or_reuse(drill)
    assert rows == [(5, True)] * 3
    assert train.policy_digest(out) != train.policy_digest(base)
    history = (out / "sft_history.csv").read_text().splitlines()
    assert history == [",".join(sft.HISTORY_COLUMNS)]
    assert sft.saved_config(out)["max_steps"] == 0 and sft.saved_config(out)["short_warmup_rows"] == 5
    # without short_warmup_rows the rows follow batch_tokens, as before
    rows.clear()
    sft.train_sft(sft.SFTConfig(**{**drill.__dict__, "short_warmup_rows": 0, "short_warmup_steps": 1,
                                   "batch_tokens": 4096, "out_dir": str(tmp_path / "drill2")}))
    assert len(rows) == 1 and rows[0][0] not in (0, 5)
    with pytest.raises(sft.ConfigError, match="max_steps 0 trains only the warm-ups"):
        sft.SFTConfig(**{**small, "init_from": str(base), "max_steps": 0}).validate()
    with pytest.raises(sft.ConfigError, match="max_steps must be an integer >= 0"):
        sft.SFTConfig(max_steps=-1).validate()
    with pytest.raises(sft.ConfigError, match="short_warmup_rows"):
        sft.SFTConfig(short_warmup_rows=-2).validate()
    sft.SFTConfig(max_steps=0).validate()  # a new model: the copy warm-up alone
