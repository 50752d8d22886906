"""SINKFLEX in the GRPO loop: the tiny-cpu preset's sink attention, per-layer sink counts (estimated on
the start policy from expert episodes, saved, read back on resume, and present in the model the
trainer updates and the rollouts sample from), and the sampler/trainer gap logged at the first update."""

from __future__ import annotations

import json

import pytest
import torch

from sinkflex_core import attention as A
from sinkflex_core import train
from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
from sinkflex_core.train import ConfigError, TrainConfig, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TINY = dict(hidden_size=64, num_layers=2, tasks_per_step=2, group_size=2, num_minibatches=2, micro_batch_size=2,
            ppo_epochs=1, max_total_tokens=320, max_new_tokens_per_turn=12, max_turns=3, system_prompt="x",
            include_tools=False, eval_tasks=2, eval_samples=2, kl_coef=0.04, lr=1e-3, threads=1, progress=False,
            tensorboard=False, save_every=1, eval_every=0, attention="sinkflex", window=32, n_sink=2)


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig.from_dict({**TINY, "out_dir": str(out), **kw})


def _counts(model) -> list[int]:
    return [m.sinkflex_n_sink for m in A._attention_modules(train.causal_lm(model))]


def test_the_tiny_cpu_preset_trains_with_sink_attention():
    cfg = train.resolve_config("tiny-cpu")
    assert (cfg.attention, cfg.n_sink, cfg.window, cfg.learn_sinks, cfg.layer_sinks) == ("sinkflex", 4, 768, True,
                                                                                         "auto")
    assert cfg.window < cfg.max_total_tokens  # the window is shorter than the episodes: it matters
    assert train.resolve_config("tiny-cpu", {"layer_sinks": "some/dir"}).layer_sinks == "some/dir"


def test_estimate_on_the_start_shape_from_expert_episodes(tok, tmp_path):
    """On the start policy's shape (hidden 128, 4 layers, 4 heads, 2 KV heads, the project tokenizer) and
    the retail oracle's episodes, the estimate has one count per layer within [min_sinks, max_sinks]; a
    layer given an attention sink on the first token finds it; the saved file loads back."""
    cfg = train.resolve_config("tiny-cpu", {"out_dir": str(tmp_path)})
    ids = train.expert_calibration_ids(cfg, tok, episodes=4)
    assert ids.shape[0] == 4 and 300 < ids.shape[1] <= train.layer_sinks.CALIBRATION_TOKENS
    # real tokens, not padding, and every row starts like a chat
    assert tok.pad_token_id is not None and (ids != tok.pad_token_id).all()
    first = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, return_dict=True)["input_ids"][0]
    assert (ids[:, 0] == first).all(), (first, ids[:, :4])
    model = build_model(tiny_qwen2_config(len(tok), hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                          tokenizer=tok), seed=0)
    est = A.estimate_layer_sinks(model, ids, min_sinks=1, max_sinks=8)
    assert len(est.n_sink) == 4 and all(1 <= n <= 8 for n in est.n_sink)
    # layer 2 given an attention sink on a token found only at position 3: that layer keeps 4 sinks
    unused = next(t for t in range(3, len(tok)) if not (ids == t).any())
    ids[:, 3] = unused
    A.plant_attention_sink(model, layers=[2], token_id=unused, strength=6.0)
    est = A.estimate_layer_sinks(model, ids, min_sinks=1, max_sinks=8)
    assert est.n_sink == [1, 1, 4, 1], est.n_sink
    A.save_layer_sinks(est, tmp_path)
    assert A.load_layer_sinks(tmp_path) == est.n_sink == A.load_layer_sinks(tmp_path / A.SINKS_FILENAME)


def test_auto_counts_are_estimated_saved_used_and_kept_on_resume(tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(_cfg(out, layer_sinks="auto", steps=1))
    record = out / A.SINKS_FILENAME
    saved = json.loads(record.read_text())
    assert "estimated" in saved["source"] and len(saved["mass"]) == TINY["num_layers"]
    counts = saved["n_sink"]
    assert all(TINY["n_sink"] <= c <= 16 for c in counts)  # n_sink is every layer's floor
    # the model the trainer updates, its reference and the one the rollouts sample from all carry them
    assert _counts(trainer.policy.lm) == _counts(trainer.ref.lm) == _counts(trainer.backend.model) == counts
    assert trainer.backend.model is trainer.policy.lm
    trainer.run()
    assert (out / "checkpoints").is_dir()
    again = Trainer(_cfg(out, layer_sinks="auto", steps=2))  # resumes: reads the record, no new estimate
    assert _counts(again.policy.lm) == counts and again.try_resume() is not None
    # counts that differ from the checkpoint's are refused, not trained on silently
    record.write_text(json.dumps({**saved, "n_sink": [c + 3 for c in counts]}))
    changed = Trainer(_cfg(out, layer_sinks="auto", steps=2))
    assert _counts(changed.policy.lm) == [c + 3 for c in counts]
    with pytest.raises(ConfigError, match="attention"):
        changed.try_resume()


def test_layer_counts_from_a_file_or_the_start_policy_reach_the_model(tok, tmp_path):
    sinks = tmp_path / "counts.json"
    sinks.write_text(json.dumps({"n_sink": [1, 8]}))
    trainer = Trainer(_cfg(tmp_path / "a", layer_sinks=str(sinks), steps=1))
    assert _counts(trainer.policy.lm) == _counts(trainer.backend.model) == [1, 8]
    uniform = Trainer(_cfg(tmp_path / "b", steps=1))  # same seed, same weights, n_sink=2 everywhere
    assert _counts(uniform.policy.lm) == [2, 2]
    ids = torch.randint(20, 2000, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = trainer.policy.lm(input_ids=ids).logits
        b = uniform.policy.lm(input_ids=ids).logits
    assert (a - b).abs().max() > 1e-4
    # a start policy folder that carries its counts: "auto" takes them (and records them in the run)
    start = tmp_path / "start"
    model = build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=1)
    model.save_pretrained(start)
    (start / A.SINKS_FILENAME).write_text(json.dumps({"n_sink": [3, 5]}))
    cfg = _cfg(tmp_path / "c", layer_sinks="auto", model=str(start))
    lm = train.load_model(cfg, tok, torch.device("cpu"))
    assert _counts(lm) == [3, 5] and A.load_layer_sinks(tmp_path / "c") == [3, 5]
    with pytest.raises(ConfigError, match="layer_sinks"):
        train.load_model(_cfg(tmp_path / "d", layer_sinks=str(tmp_path / "missing.json")), tok, torch.device("cpu"))


def test_the_run_record_of_the_sink_counts_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A rank that starts later with resume=True reads the record: a write cut half way (a full disk, a
    killed process) must not leave half a JSON file under its name."""
    from pathlib import Path

    from sinkflex_core.train.layer_sinks import resolve_layer_sinks

    start = tmp_path / "start"
    start.mkdir()
    (start / A.SINKS_FILENAME).write_text(json.dumps({"n_sink": [3, 5]}))
    cfg = _cfg(tmp_path / "run", layer_sinks="auto", model=str(start))
    real = Path.write_text

    def cut_short(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("no space left on device")

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(OSError):
        resolve_layer_sinks(cfg, None, None)
    monkeypatch.setattr(Path, "write_text", real)
    assert not (tmp_path / "run" / A.SINKS_FILENAME).exists()
    assert resolve_layer_sinks(cfg, None, None) == [3, 5] == A.load_layer_sinks(tmp_path / "run")


def test_sampler_gap_sums_measure_a_known_perturbation():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 10, generator=g) * 4
    mask = torch.ones(3, 10)
    mask[:, :2] = 0  # prompt tokens: not counted
    shift = torch.where(torch.arange(10) % 2 == 0, 0.3, 0.05).expand(3, 10)  # half out of the band, half in
    sampler = torch.where(mask.bool(), logp - shift, logp + 5.0)
    s = train.update.sampler_gap_sums(logp, sampler, mask, clip_low=0.2, clip_high=0.2)
    assert s["gap_tokens"] == 24
    assert s["gap_abs"] / s["gap_tokens"] == pytest.approx(0.175, abs=1e-6)
    assert s["gap_out"] / s["gap_tokens"] == pytest.approx(0.5)  # exp(0.3) = 1.35 > 1.2; exp(0.05) inside


class PerturbedSampler(Trainer):
    """The step's rollouts as sampled, then their sampling log-probs moved by ``shift`` on policy tokens."""

    shift = 0.0

    def _collect_step(self, step):
        rows = super()._collect_step(step)
        rows["old_logprobs"] = rows["old_logprobs"] - self.shift * rows["loss_mask"]
        return rows


@pytest.mark.parametrize("attention,old_logprobs", [("sdpa", "rollout"), ("sinkflex", "rollout"),
                                                    ("sinkflex", "recompute")])
def test_the_first_update_logs_the_sampler_trainer_gap(tmp_path, attention, old_logprobs):
    """Unchanged, the sampler and the trainer agree (the rollouts used the training attention); with the
    sampler's log-probs moved by a known amount, the logged gap is that amount and every token's ratio
    leaves the clip band."""
    rows = {}
    for shift in (0.0, 0.3):
        PerturbedSampler.shift = shift
        trainer = PerturbedSampler(_cfg(tmp_path / f"{shift}", attention=attention, old_logprobs=old_logprobs,
                                        steps=1, save_every=0))
        rows[shift] = trainer.step()
    assert rows[0.0]["logp_gap_rollout"] < 1e-4 and rows[0.0]["rollout_clip_frac"] == 0.0
    assert rows[0.3]["logp_gap_rollout"] == pytest.approx(0.3, abs=1e-4)
    assert rows[0.3]["rollout_clip_frac"] == 1.0
    assert set(train.METRIC_COLUMNS) == set(train.METRIC_HELP)
