"""A saved policy loads with the attention it was trained with: sink counts, window, learned
zero-value sink logits and LoRA adapters, through models.load_policy, which the screen and pass@k
(train.success_table) use; and a sink policy is not silently served with other attention."""

from __future__ import annotations

import pytest
import torch

from sinkflex_core import attention as A
from sinkflex_core import train
from sinkflex_core.models import build_model, get_tokenizer, load_policy, tiny_qwen2_config
from sinkflex_core.train import TrainConfig, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TINY = dict(hidden_size=64, num_layers=2, tasks_per_step=1, group_size=2, max_total_tokens=200,
            max_new_tokens_per_turn=8, max_turns=2, system_prompt="x", include_tools=False, eval_tasks=1,
            eval_samples=1, threads=1, progress=False, tensorboard=False, attention="sinkflex", n_sink=2,
            window=24)


def _move_sinks(model, scale: float = 1.0) -> None:
    """Learned sink logits away from their initial value, as training leaves them."""
    with torch.no_grad():
        for i, p in enumerate(A.sink_parameters(model)):
            p.copy_(scale * torch.linspace(-1.5, 1.5, p.numel()) + 0.3 * i)


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (2, 60), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    return ids, mask


def test_exported_sink_policy_loads_with_its_attention(tokenizer_dir, tmp_path):
    trainer = Trainer(TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "out_dir": str(tmp_path / "run")}))
    lm = trainer.policy.lm
    _move_sinks(lm)
    folder = trainer.export_policy()
    ids, mask = _inputs(lm.config.vocab_size)
    real = mask.bool()
    loaded = load_policy(folder)
    with torch.no_grad():
        expect = lm.eval()(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert (got - expect)[real].abs().max() < 1e-5
    assert [A._layer_settings(m) for m in A._attention_modules(loaded)] == [(2, 24), (2, 24)]
    assert all(torch.equal(a, b) for a, b in zip(A.sink_parameters(loaded), A.sink_parameters(lm)))
    # what plain from_pretrained (the screen's loader before) gives is another model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert (plain(input_ids=ids, attention_mask=mask).logits - expect)[real].abs().max() > 0.05
        # and asked for sink attention by name, it refuses to run without the learned sinks
        plain.set_attn_implementation(A.IMPLEMENTATION)
        with pytest.raises(ValueError, match="learned sink logits"):
            plain(input_ids=ids)
    # the screen / pass@k path runs on it (and reads the policy through load_policy)
    table = train.success_table(folder, "train", [0], samples=1, progress=False)
    assert list(table["task"]) == [0] and int(table["tries"].iloc[0]) == 1


def test_exported_lora_sink_policy_loads_over_its_base(tokenizer_dir, tmp_path):
    tok = get_tokenizer()
    base = tmp_path / "base"
    build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=4).save_pretrained(base)
    tok.save_pretrained(base)
    cfg = TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "out_dir": str(tmp_path / "run"),
                                 "model": str(base), "lora": True, "lora_r": 4})
    trainer = Trainer(cfg)
    lm = trainer.policy.lm
    _move_sinks(lm)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # adapters that change the model
    folder = trainer.export_policy()
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()
    ids, mask = _inputs(len(tok))
    real = mask.bool()
    loaded = load_policy(folder)
    with torch.no_grad():
        expect = lm.eval()(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
        bare = load_policy(base)(input_ids=ids, attention_mask=mask).logits
    assert (got - expect)[real].abs().max() < 1e-4
    assert (bare - expect)[real].abs().max() > 1e-3  # adapters and sinks did matter
    assert A.attention_settings(folder) == {"n_sink": 2, "window": 24, "layer_sinks": None, "learn_sinks": True}
    table = train.success_table(folder, "train", [0], samples=1, progress=False)  # the screen reads adapters too
    assert list(table["task"]) == [0] and len(table["policy_digest"].iloc[0]) == 16


def test_policy_folders_that_cannot_be_loaded_say_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved model"):
        load_policy(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": null}')
    with pytest.raises(ValueError, match="base_model"):
        load_policy(tmp_path)


def test_a_sink_policy_is_not_served_by_vllm_with_plain_attention(tmp_path):
    from sinkflex_core.rollout import VLLMBackend

    tok = get_tokenizer()
    model = A.apply(build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=1, tokenizer=tok)),
                    n_sink=2, window=24)
    with pytest.raises(ValueError, match="sink attention"):
        VLLMBackend(model, tok)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sink attention"):
        VLLMBackend(model_path=str(tmp_path))


def test_the_load_report_about_our_sink_logits_alone_is_dropped(tmp_path, caplog):
    """A folder whose weights file holds the learned sink logits (as the SFT saves it) makes transformers
    report them as unexpected keys; load_policy loads them itself, so that report alone is noise. A
    report that names any other key is kept."""
    import logging

    from safetensors.torch import load_file, save_file

    model = A.apply(build_model(tiny_qwen2_config(vocab_size=300, hidden_size=32, num_layers=2)), n_sink=2,
                    window=8)
    _move_sinks(model)
    model.save_pretrained(tmp_path)
    A.save_attention_settings(model, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert any("sinkflex_sink_logits" in k for k in weights)  # the case the filter is for
    with caplog.at_level(logging.WARNING):
        loaded = load_policy(tmp_path)
    assert "LOAD REPORT" not in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(A.sink_parameters(loaded), A.sink_parameters(model)))
    save_file({**weights, "model.stray.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_policy(tmp_path)
    assert "LOAD REPORT" in caplog.text and "model.stray.weight" in caplog.text


def test_a_sink_policy_plays_with_full_attention_only_when_asked(tokenizer_dir, tmp_path):
    """load_policy(saved_attention=False) and attention.remove: the same weights under full causal
    attention, the learned sinks, window and config entries gone; the table names it ``full``."""
    tok = get_tokenizer()
    def cfg():  # a fresh config each time: apply() writes its settings into the model's config
        return tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok)

    model = A.apply(build_model(cfg(), seed=3), n_sink=2, window=8)
    _move_sinks(model)
    model.save_pretrained(tmp_path / "sink")
    A.save_attention_settings(model, tmp_path / "sink")
    tok.save_pretrained(tmp_path / "sink")
    ids, mask = _inputs(len(tok))
    real = mask.bool()
    with torch.no_grad():
        plain = build_model(cfg(), seed=3).eval()(input_ids=ids, attention_mask=mask).logits
        sink = load_policy(tmp_path / "sink")(input_ids=ids, attention_mask=mask).logits
        full_model = load_policy(tmp_path / "sink", saved_attention=False)
        full = full_model(input_ids=ids, attention_mask=mask).logits
    assert (sink - plain)[real].abs().max() > 0.05  # a window of 8 on 60 tokens is another model
    assert (full - plain)[real].abs().max() < 1e-5
    assert A.attention_settings(full_model) is None and not A.sink_parameters(full_model)
    assert full_model.config._attn_implementation == "sdpa"
    # saved again, it is a plain policy: nothing of the sink attention is left to reload
    full_model.save_pretrained(tmp_path / "full")
    assert A.attention_settings(tmp_path / "full") is None
    assert "sinkflex" not in (tmp_path / "full" / "config.json").read_text()
    # the default still loads the trained attention, and remove() undoes apply() in place
    again = load_policy(tmp_path / "sink")
    assert len(A.sink_parameters(again)) == 2
    with torch.no_grad():
        assert (A.remove(again)(input_ids=ids, attention_mask=mask).logits - plain)[real].abs().max() < 1e-5
    with pytest.raises(ValueError, match="another attention"):
        A.remove(again, A.IMPLEMENTATION)
    with pytest.raises(ValueError, match="full attention"):
        load_policy(tmp_path / "sink", saved_attention=False, attn_implementation=A.IMPLEMENTATION)
    table = train.success_table(tmp_path / "sink", "train", [0], samples=1, progress=False, saved_attention=False)
    assert list(table["attention"]) == ["full"] and int(table["tries"].iloc[0]) == 1
    with pytest.raises(ValueError, match="saved with full attention"):
        train.success_table(tmp_path / "full", "train", [0], samples=1, progress=False, saved_attention=False)
    with pytest.raises(ValueError, match="two different attentions"):
        train.success_table(tmp_path / "sink", "train", [0], samples=1, progress=False, saved_attention=False,
                            sinks={"n_sink": 2, "window": 8})
    # the trainer refuses to run the sink policy with plain attention unless asked, as it says
    run = {**TINY, "tokenizer": tokenizer_dir, "attention": "sdpa"}
    with pytest.raises(train.ConfigError, match="saved_attention=false"):
        Trainer(TrainConfig.from_dict({**run, "model": str(tmp_path / "sink"), "out_dir": str(tmp_path / "r1")}))
    asked = TrainConfig.from_dict({**run, "model": str(tmp_path / "sink"), "out_dir": str(tmp_path / "r2"),
                                   "saved_attention": False})
    lm = Trainer(asked).policy.lm
    assert A.attention_settings(lm) is None and lm.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert (lm(input_ids=ids, attention_mask=mask).logits - plain)[real].abs().max() < 1e-5
    # with sink attention, the run's own settings apply afresh: not the folder's window or learned sinks
    fresh = TrainConfig.from_dict({**TINY, "tokenizer": tokenizer_dir, "model": str(tmp_path / "sink"),
                                   "out_dir": str(tmp_path / "r3"), "saved_attention": False, "window": 16})
    lm = Trainer(fresh).policy.lm
    assert A.attention_settings(lm)["window"] == 16
    saved = A.sink_parameters(load_policy(tmp_path / "sink"))
    for p, q in zip(A.sink_parameters(lm), saved, strict=True):  # one initial value per head, not the learned ones
        assert p.detach().unique().numel() == 1 and (p.detach() - q.detach()).abs().max() > 0.5
    tok.save_pretrained(tmp_path / "full")
    with pytest.raises(train.ConfigError, match="changes nothing"):
        Trainer(TrainConfig.from_dict({**run, "model": str(tmp_path / "full"), "out_dir": str(tmp_path / "r4"),
                                       "saved_attention": False}))
    with pytest.raises(train.ConfigError, match="saved folder"):
        TrainConfig.from_dict({**run, "saved_attention": False})
    with pytest.raises(train.ConfigError, match="LoRA"):
        TrainConfig.from_dict({**run, "model": str(tmp_path / "sink"), "saved_attention": False, "lora": True})


def test_a_full_attention_policy_saved_over_a_sink_policy_loads_with_full_attention(tokenizer_dir, tmp_path):
    """A rerun into the same folder (``--no-resume``, or SFT into its default folder) with full attention
    must not leave the earlier sink run's settings or sink logits to be read as the new policy's."""
    from safetensors.torch import save_file

    tok = get_tokenizer()
    model = A.apply(build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=3),
                    n_sink=2, window=8)
    _move_sinks(model)
    model.save_pretrained(tmp_path / "run" / "policy")
    A.save_attention_settings(model, tmp_path / "run" / "policy")
    save_file({"stale.sinkflex_sink_logits": torch.zeros(4)}, str(tmp_path / "run" / "policy" / "sink_logits.safetensors"))
    assert A.attention_settings(tmp_path / "run" / "policy")["n_sink"] == 2
    trainer = Trainer(TrainConfig.from_dict({**TINY, "attention": "sdpa", "tokenizer": tokenizer_dir,
                                             "out_dir": str(tmp_path / "run")}))
    folder = trainer.export_policy()
    assert A.attention_settings(folder) is None
    assert not (folder / A.SETTINGS_FILENAME).exists() and not (folder / "sink_logits.safetensors").exists()
    loaded = load_policy(folder)
    assert not A.sink_parameters(loaded) and loaded.config._attn_implementation == "sdpa"
    ids, mask = _inputs(trainer.policy.lm.config.vocab_size)
    with torch.no_grad():
        expect = trainer.policy.lm.eval()(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert (got - expect)[mask.bool()].abs().max() < 1e-5


def test_broken_attention_records_are_refused_naming_the_file(tokenizer_dir, tmp_path):
    tok = get_tokenizer()
    model = A.apply(build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=3),
                    n_sink=2, window=8)
    folder = tmp_path / "sink"
    model.save_pretrained(folder)
    A.save_attention_settings(model, folder)
    tok.save_pretrained(folder)
    record = folder / A.SETTINGS_FILENAME
    for text, message in [('{"n_sink": 2, "win', "is not a JSON file"), ("[2, 8]", "not a JSON object"),
                          ('{"window": 8}', "names no 'n_sink'"), ('{"n_sink": 2, "window": 0}', "is not valid"),
                          ('{"n_sink": 2, "window": 8, "layer_sinks": [2, "x"]}', "is not valid")]:
        record.write_text(text)
        with pytest.raises(ValueError, match=message) as err:
            load_policy(folder)
        assert str(record) in str(err.value)
        with pytest.raises(train.ConfigError, match=message):  # the trainer says it as a config error
            Trainer(TrainConfig.from_dict({**TINY, "model": str(folder), "tokenizer": tokenizer_dir,
                                           "out_dir": str(tmp_path / "run")}))
    A.save_attention_settings(model, folder)
    counts = tmp_path / "counts.json"
    for text in ('{"n_sink": [2, ', '{"n_sink": [2, true]}', '{"n_sink": 2}', "[]"):
        counts.write_text(text)
        with pytest.raises(train.ConfigError, match="counts.json"):
            Trainer(TrainConfig.from_dict({**TINY, "model": str(folder), "tokenizer": tokenizer_dir,
                                           "layer_sinks": str(counts), "out_dir": str(tmp_path / "run")}))
    counts.write_text('{"n_sink": [2, 2, 2]}')  # a count per layer of another model
    with pytest.raises(train.ConfigError, match="sink attention"):
        Trainer(TrainConfig.from_dict({**TINY, "model": str(folder), "tokenizer": tokenizer_dir,
                                       "layer_sinks": str(counts), "out_dir": str(tmp_path / "run")}))


def test_a_run_whose_sink_attention_differs_from_its_starts_says_so(tmp_path, capfd):
    """The run's settings win over the shipped start's (window 768, 4 sinks a layer, learned sinks),
    with a note; the same settings load without one."""
    from sinkflex_core.paths import data_dir

    start = data_dir() / "retail-tiny-start"
    base = {**train.resolve_config("tiny-cpu").to_dict(), "model": str(start), "progress": False,
            "out_dir": str(tmp_path)}
    for changes, note in [({}, None), ({"layer_sinks": "", "n_sink": 4}, None),
                          ({"window": 256}, "window 768 -> 256"),
                          ({"layer_sinks": "", "n_sink": 2}, "sink tokens per layer [4, 4, 4, 4] -> [2, 2, 2, 2]"),
                          ({"learn_sinks": False}, "its learned sink logits are kept")]:
        capfd.readouterr()
        model = train.load_model(TrainConfig.from_dict({**base, **changes}), None, torch.device("cpu"))
        err = capfd.readouterr().err
        assert (note in err) if note else "other sink attention" not in err, (changes, err)
        assert A.attention_settings(model)["window"] == changes.get("window", 768)
