"""The preset names: every shape builds through the one small-model family (or the 7B's published
config), every training run names the shape it trains and that shape agrees with the run's own
settings, the names users type keep working, and the recorded CSVs' ``preset`` column still resolves."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from sinkflex_core import bench, models, presets, sft, train

DATA = Path(__file__).resolve().parents[1] / "data"


def test_every_run_has_settings_and_a_shape():
    assert set(presets.RUNS) == set(train.PRESETS)
    for run, shape in presets.RUNS.items():
        assert shape in presets.SHAPES
        assert train.resolve_config(run).preset == run
        assert presets.shape(run) is presets.SHAPES[shape]


def test_the_tiny_policy_shape_is_the_model_sft_builds():
    # tiny-cpu trains the SFT start: the shape must be what sft builds with its defaults.
    cfg = sft.SFTConfig()
    built = models.tiny_qwen2_config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                     num_layers=cfg.num_layers, num_heads=cfg.num_heads or None,
                                     num_kv_heads=cfg.num_kv_heads or None)
    ours = presets.shape("tiny-cpu").model_config()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size"):
        assert getattr(ours, key) == getattr(built, key), key
    tiny_cpu = train.resolve_config("tiny-cpu")  # and the sizes of the run's own fields
    assert (tiny_cpu.vocab_size, tiny_cpu.hidden_size, tiny_cpu.num_layers) == \
        (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers)
    model = models.build_model(presets.shape("tiny-policy").model_config(max_tokens=64), seed=0)
    assert 1.5e6 < models.count_parameters(model) < 1.7e6  # the "1.6M" of notebook 05 and the docs


def test_the_paper_shape_is_the_paper_run_at_its_settings():
    paper = train.resolve_config("paper-8xh100")
    shape = presets.shape("paper-8xh100")
    assert shape.name == "qwen25-7b"
    assert (shape.chunk_size, shape.window) == (paper.logprob_chunk_size, paper.window)
    published = models.qwen25_7b_config()
    config = shape.model_config(max_tokens=65536)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == \
        (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.ffn, shape.vocab)
    assert config.eos_token_id == published.eos_token_id  # the published config, not a look-alike
    assert config.max_position_embeddings == 65536 and config.use_cache is False


def test_small_shapes_build_from_the_one_family():
    for name in ("tiny", "tiny-policy", "qwen25-1.5b"):
        shape = presets.SHAPES[name]
        config = shape.model_config(max_tokens=1024)
        family = models.tiny_qwen2_config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_layers=shape.layers,
                                          num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                                          intermediate_size=shape.ffn)
        family.use_cache = False
        assert config.to_dict() == family.to_dict(), name


def test_unknown_names_are_refused_with_the_valid_ones(capsys):
    with pytest.raises(ValueError, match=r"unknown preset '70b'; choose one of \[.*'qwen25-7b'.*'tiny-cpu'"):
        presets.shape("70b")
    with pytest.raises(train.ConfigError, match=r"choose one of \['paper-8xh100', 'tiny-cpu'\]"):
        train.resolve_config("qwen25-7b")  # a shape has no run settings
    with pytest.raises(SystemExit):
        bench.main(["vram", "--preset", "70b", "--list"])
    assert "qwen25-7b" in capsys.readouterr().err


def test_the_names_users_type_keep_working(capsys):
    for name in ("tiny", "qwen25-7b", "qwen25-1.5b", "tiny-cpu", "paper-8xh100"):
        assert bench.main(["vram", "--preset", name, "--device", "cpu", "--tokens", "512", "--attention", "sdpa",
                           "--logprobs", "full", "--mlp", "plain", "--list"]) == 0, name
    assert capsys.readouterr().out.split() == ["sdpa/full/plain/512"] * 5
    tiny = bench.Settings(preset="tiny", device="cpu").resolved()
    assert (tiny.chunk_size, tiny.slice_tokens, tiny.window) == (256, 512, 256)
    # A run stands for its model's shape; the CSV's preset column names the shape.
    paper = bench.Settings(preset="paper-8xh100", device="cpu").resolved()
    row = bench.row_for(bench.Case("sdpa", "chunked", "plain", 4096), paper, {"status": "ok"}, {})
    assert (row["preset"], row["hidden"], row["chunk_size"]) == ("qwen25-7b", 3584, 2048)


def test_recorded_rows_still_name_a_shape():
    rows = [r for path in sorted(DATA.glob("vram_*.csv")) for r in csv.DictReader(path.open()) if r["preset"]]
    assert {r["preset"] for r in rows} >= {"tiny", "qwen25-7b"}
    for r in rows:
        shape = dataclasses.asdict(presets.shape(r["preset"]))
        for col in ("hidden", "layers", "ffn", "vocab", "heads", "kv_heads"):
            assert int(r[col]) == shape[col], (r["case"], col)
