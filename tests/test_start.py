"""The shipped start policy (``data/retail-tiny-start``) and the code that makes it
(:mod:`sinkflex_core.start`): the folder loads as the policy its card describes, its sink estimate
fits its layers, its card's figures are those of its measurement files; the measurement plays the
policy with full and with sink attention and keeps a finished part when run again."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from benchmark_scripts import load_benchmark

from sinkflex_core import attention as A
from sinkflex_core import start, train
from sinkflex_core.models import build_model, get_tokenizer, load_policy, tiny_qwen2_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SHIPPED = start.start_dir()


def test_shipped_start_is_small_and_loads_with_the_presets_sink_attention_it_trained_with():
    assert (SHIPPED / "model.safetensors").is_file(), f"{SHIPPED}/model.safetensors is tracked; it must be here"
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size <= 25 * 2**20, f"the start folder holds {size / 2**20:.1f} MiB"
    model = load_policy(SHIPPED)
    counts = A.load_layer_sinks(SHIPPED)
    assert len(counts) == model.config.num_hidden_layers and all(1 <= c <= 16 for c in counts)
    # its last stage trained with the tiny-cpu preset's sink attention and those counts: loading restores it
    preset = train.resolve_config("tiny-cpu")
    assert A.attention_settings(model) == {"n_sink": preset.n_sink, "window": preset.window, "layer_sinks": counts,
                                           "learn_sinks": preset.learn_sinks}
    assert [A._layer_settings(m) for m in A._attention_modules(model)] == [(c, preset.window) for c in counts]
    # its learned sink logits are loaded, not the initial ones, and full attention drops them
    learned = A.sink_parameters(model)
    assert len(learned) == len(counts) and any((p - A.hf.DEFAULT_SINK_LOGIT).abs().max() > 1e-3 for p in learned)
    plain = load_policy(SHIPPED, saved_attention=False)
    assert A.attention_settings(plain) is None and not A.sink_parameters(plain)


def test_shipped_card_states_the_measured_rewards_and_the_weights_digest():
    card = (SHIPPED / "README.md").read_text()
    assert f"`{train.policy_digest(SHIPPED)}`" in card
    tests = pd.read_csv(SHIPPED / "test_rewards.csv", dtype={"policy_digest": str})
    assert set(tests["policy_digest"]) == {train.policy_digest(SHIPPED)}
    labels = list(dict.fromkeys(tests["attention"]))
    # a start trained with sink attention: its own, then its weights under full attention
    assert labels == ["saved", "full"]
    stated = [float(x) for x in re.findall(r"Test reward with [^:]+: \*\*([0-9.]+)\*\*", card)]
    for label, value in zip(labels, stated, strict=True):
        t = tests[tests["attention"] == label]
        assert t["task"].nunique() == train.count_tasks("sinkflex/Retail-v0", "test")
        assert value == pytest.approx(t["successes"].sum() / t["tries"].sum(), abs=5e-4)
    assert start.card_text(SHIPPED) == card  # the card is what --card-only writes from these files


def test_the_cards_use_snippet_loads_the_policy_with_the_tokenizer_it_was_trained_on():
    """The card's code block runs as written, and the tokenizer it loads splits numbers as the folder's
    ``tokenizer.json`` does (groups of three digits), not as the class ``AutoTokenizer`` picks does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    card = (SHIPPED / "README.md").read_text()
    block = card.split("## Use", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(block, scope)
    text = "return item 1234567890 of order #W0012345"
    saved = Tokenizer.from_file(str(SHIPPED / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert scope["tokenizer"](text, add_special_tokens=False)["input_ids"] == saved
    words = scope["tokenizer"].convert_ids_to_tokens(saved)
    assert words[words.index("123"):][:4] == ["123", "456", "789", "0"]  # the number in groups of three
    assert scope["policy"].config.vocab_size == len(scope["tokenizer"])
    # what the card warns of: AutoTokenizer on this folder reads the digits otherwise (if it ever stops
    # doing so, the warning in the card can go)
    assert AutoTokenizer.from_pretrained(SHIPPED)(text, add_special_tokens=False)["input_ids"] != saved


def test_the_card_names_the_stages_that_made_the_start(tmp_path):
    import shutil

    folder = tmp_path / "start"
    shutil.copytree(SHIPPED, folder)
    recipe = folder / "recipe"
    for later in recipe.glob("stage*"):
        if not later.name.startswith("stage1_"):
            later.unlink()
    assert "\npython -m sinkflex_core.start\n" in start.card_text(folder)  # one stage: no flag
    for part in ("config.json", "history.csv"):
        shutil.copy2(recipe / f"stage1_sft_{part}", recipe / f"stage2_sft_lookup_{part}")
    card = start.card_text(folder)
    assert "\npython -m sinkflex_core.start --lookup-stage\n" in card and "`stage2_sft_lookup`" in card


def test_recipe_stages_come_in_the_order_they_ran(tmp_path):
    import json

    import pandas as pd

    recipe = tmp_path / "recipe"
    recipe.mkdir()
    for n in (10, 2, 1):  # by name, stage10 would come before stage2
        (recipe / f"stage{n}_run{n}_config.json").write_text(json.dumps({"lr": n}))
        pd.DataFrame({"step": [n]}).to_csv(recipe / f"stage{n}_run{n}_history.csv", index=False)
    (recipe / "stage3_orphan_config.json").write_text("{}")  # no history: not a stage
    stages = start.recipe_stages(tmp_path)
    assert [label for label, _, _ in stages] == ["stage1_run1", "stage2_run2", "stage10_run10"]
    assert [cfg["lr"] for _, cfg, _ in stages] == [1, 2, 10]
    assert [int(hist["step"].iloc[0]) for _, _, hist in stages] == [1, 2, 10]
    assert start.recipe_stages(tmp_path / "nothing") == []


@pytest.fixture
def trained_stages(monkeypatch):
    """No training: ``start.build`` records each stage's config in the returned list and saves it, as
    ``train_or_reuse`` would; nothing is exported, estimated or measured."""
    import dataclasses
    import json
    from pathlib import Path

    from sinkflex_core import sft

    trained = []

    def fake_train(cfg):
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sft_config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        trained.append(cfg)
        return out

    monkeypatch.setattr(sft, "train_or_reuse", fake_train)
    for name in ("_export", "estimate_sinks", "measure", "write_card"):
        monkeypatch.setattr(start, name, lambda *a, **k: None)
    return trained


def test_the_lookup_stage_runs_its_rounds_each_on_the_one_before(tmp_path, trained_stages):
    from sinkflex_core import sft

    trained = trained_stages
    start.build(tmp_path / "start", tmp_path / "work", threads=1, progress=False, lookup_stage=True, device="cpu")
    assert [c.out_dir for c in trained] == [str(tmp_path / "work" / d) for d in ("sft", "sft_lookup", "sft_lookup2")]
    assert [(c.device, c.threads) for c in trained] == [("cpu", 1)] * len(trained)  # every stage where it was asked
    assert [c.init_from for c in trained[1:]] == [trained[0].out_dir, trained[1].out_dir]
    assert trained[1].recall_warmup_steps == sft.LOOKUP_STAGE["recall_warmup_steps"] > 0
    assert trained[2].recall_warmup_steps == trained[2].identity_warmup_steps == 0
    assert all(c.recall_fact_fillers == 0 and c.max_steps == sft.LOOKUP_STAGE["max_steps"] for c in trained[1:])
    assert len(trained) == 1 + start.LOOKUP_ROUNDS


def test_the_zip_stage_drills_then_runs_its_rounds_on_the_lookup_rounds(tmp_path, trained_stages):
    from pathlib import Path

    from sinkflex_core import sft

    trained = trained_stages
    start.build(tmp_path / "start", tmp_path / "work", threads=1, progress=False, lookup_stage=True, zip_stage=True)
    names = [Path(c.out_dir).name for c in trained]
    assert names == ["sft", "sft_lookup", "sft_lookup2", "sft_zip_drills", "sft_zip1", "sft_zip2", "sft_zip3",
                     "sft_zip4"]
    assert all(b.init_from == a.out_dir for a, b in zip(trained, trained[1:]))
    drills, rounds = trained[3], trained[4:]
    # the drills: the zip code's layout alone, long and fast enough to be learned; one step of SFT
    assert (drills.recall_fact_fillers, drills.recall_warmup_steps, drills.lr, drills.max_steps) == (1, 400, 2e-3, 1)
    assert drills.identity_warmup_steps == 0 and drills.recall_plain_share == 0
    # the rounds: no warm-ups, both drill layouts beside the episodes, the lookup stage's other settings kept
    assert [c.max_steps for c in rounds] == list(start.ZIP_ROUND_STEPS) == [c.eval_every for c in rounds]
    for c in rounds:
        assert c.recall_warmup_steps == c.identity_warmup_steps == 0 and c.lr == 1e-3
        assert (c.recall_fact_fillers, c.recall_plain_share, c.recall_fraction) == (1, 0.5, 0.25)
        assert c.identity_rows == sft.LOOKUP_STAGE["identity_rows"] and c.swap_digit_pairs


def test_the_address_stage_drills_then_runs_its_rounds_on_the_sink_stage_with_its_counts(tmp_path, trained_stages,
                                                                                        monkeypatch):
    from pathlib import Path

    def estimate(folder):  # the full-attention stage's counts, as estimate_sinks saves them
        (Path(folder) / A.SINKS_FILENAME).write_text('{"n_sink": [4, 5]}')

    monkeypatch.setattr(start, "estimate_sinks", estimate)
    trained = trained_stages
    start.build(tmp_path / "start", tmp_path / "work", threads=1, progress=False, sink_stage=True, address_stage=True)
    names = [Path(c.out_dir).name for c in trained]
    assert names == ["sft", "sft_sink", "sft_address_drill", "sft_address1", "sft_address2"]
    assert all(b.init_from == a.out_dir for a, b in zip(trained, trained[1:]))
    runs = trained[2:]
    assert [(c.short_warmup_steps, c.max_steps) for c in runs] == list(start.ADDRESS_RUNS)
    assert [c.eval_every for c in runs] == [1, 600, 600]  # one evaluation a round, at its end
    for before, c in zip(trained[1:], runs):
        # the preset's sink attention on the counts the sink stage trained with, copied into every run
        assert c.attention == "sinkflex" and c.layer_sinks == str(Path(before.out_dir) / A.SINKS_FILENAME)
        assert (Path(c.out_dir) / A.SINKS_FILENAME).read_text() == '{"n_sink": [4, 5]}'
        assert all(getattr(c, k) == v for k, v in start.ADDRESS_ROWS.items())
        assert c.recall_warmup_steps == c.identity_warmup_steps == 0 and (c.threads, c.progress) == (1, False)
    # the card's command names the flag of each stage, the address stage's last
    assert start.recipe_flags([(f"stage{n}_{name}", {}, None) for n, name in enumerate(names, 1)]) == \
        ["--sink-stage", "--address-stage"]


def test_the_payment_stage_follows_the_address_stage_and_its_rounds_keep_the_address_rows(tmp_path, trained_stages,
                                                                                          monkeypatch):
    from pathlib import Path

    monkeypatch.setattr(start, "estimate_sinks",
                        lambda folder: (Path(folder) / A.SINKS_FILENAME).write_text('{"n_sink": [4, 6]}'))
    trained = trained_stages
    start.build(tmp_path / "start", tmp_path / "work", threads=1, progress=False, sink_stage=True, address_stage=True,
                payment_stage=True)
    names = [Path(c.out_dir).name for c in trained]
    assert names[-3:] == ["sft_payment_drill", "sft_payment1", "sft_payment2"] and names[-4] == "sft_address2"
    assert all(b.init_from == a.out_dir for a, b in zip(trained, trained[1:]))
    runs = trained[-3:]
    assert [(c.short_warmup_steps, c.max_steps, c.eval_every) for c in runs] == [(600, 0, 1), (0, 600, 600),
                                                                                (0, 600, 600)]
    # the drill: the payment rows alone; the rounds: the payment and both address tools' rows
    assert runs[0].action_tools == "modify_pending_order_payment"
    assert [set(c.action_tools.split(",")) for c in runs[1:]] == [
        {"modify_pending_order_payment", "modify_pending_order_address", "modify_user_address"}] * 2
    for c in runs:
        assert c.attention == "sinkflex" and c.action_confirmations and c.short_action_rows == 4
        assert (Path(c.out_dir) / A.SINKS_FILENAME).read_text() == '{"n_sink": [4, 6]}'
    assert start.recipe_flags([(f"stage{n}_{name}", {}, None) for n, name in enumerate(names, 1)]) == \
        ["--sink-stage", "--address-stage", "--payment-stage"]


def test_the_return_stage_continues_a_saved_start_and_its_rounds_keep_the_payment_and_address_rows(
        tmp_path, trained_stages):
    import shutil
    from pathlib import Path

    base = tmp_path / "base"
    shutil.copytree(SHIPPED, base)
    trained = trained_stages
    start.build(tmp_path / "start", tmp_path / "work", threads=1, progress=False, return_stage=True, base=base)
    assert [Path(c.out_dir).name for c in trained] == ["sft_return_drill", "sft_return1", "sft_return2"]
    assert trained[0].init_from == str(base) and all(b.init_from == a.out_dir for a, b in zip(trained, trained[1:]))
    assert [(c.short_warmup_steps, c.max_steps, c.eval_every) for c in trained] == [(450, 0, 1), (0, 600, 600),
                                                                                   (0, 600, 600)]
    assert trained[0].action_tools == "return_delivered_order_items"
    assert [set(c.action_tools.split(",")) for c in trained[1:]] == [
        {"return_delivered_order_items", "modify_pending_order_payment", "modify_pending_order_address",
         "modify_user_address"}] * 2
    for c in trained:  # the shipped start's sink attention and counts, in every run
        assert c.attention == "sinkflex" and c.action_confirmations and c.short_action_rows == 4
        assert (Path(c.out_dir) / A.SINKS_FILENAME).read_bytes() == (base / A.SINKS_FILENAME).read_bytes()
    # refused before any training: a stage the saved start has, its own folder as out, a folder with no start
    trained.clear()
    with pytest.raises(ValueError, match="not --payment-stage"):
        start.build(tmp_path / "start", tmp_path / "work", payment_stage=True, return_stage=True, base=base)
    with pytest.raises(ValueError, match="another folder"):
        start.build(base, tmp_path / "work", return_stage=True, base=base)
    with pytest.raises(ValueError, match="no model.safetensors"):
        start.build(tmp_path / "start", tmp_path / "work", return_stage=True, base=tmp_path / "work")
    assert trained == []


def test_a_start_continued_from_another_carries_its_recipe_and_names_every_flag(tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(SHIPPED, base)
    runs = []
    for name in ("sft_return_drill", "sft_return1"):  # two stages as train_or_reuse leaves them
        runs.append(tmp_path / "work" / name)
        shutil.copytree(SHIPPED, runs[-1], ignore=shutil.ignore_patterns("recipe", "*.csv", "README.md"))
        (runs[-1] / "sft_history.csv").write_text("step\n")
    start._export(runs[-1], tmp_path / "out", runs, base)
    carried = [label for label, _, _ in start.recipe_stages(base)]
    labels = [label for label, _, _ in start.recipe_stages(tmp_path / "out")]
    n = len(carried)
    assert labels == carried + [f"stage{n + 1}_sft_return_drill", f"stage{n + 2}_sft_return1"]
    assert start.recipe_flags(start.recipe_stages(tmp_path / "out")) == \
        start.recipe_flags(start.recipe_stages(base)) + ["--return-stage"]


def test_from_refuses_a_folder_that_is_no_start_or_an_earlier_stage_before_any_work(tmp_path, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before --from was checked")

    monkeypatch.setattr(start, "build", no_work)
    for base, flags, said in ((tmp_path, ["--return-stage"], "no model.safetensors"),
                              (SHIPPED, ["--sink-stage", "--return-stage"], "not --sink-stage")):
        with pytest.raises(SystemExit) as exc:
            start.main(["--from", str(base), "--out", str(tmp_path / "new"), *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--from" in err and said in err, err


def test_the_card_counts_a_drill_of_short_rows_and_a_stage_without_evaluation(tmp_path):
    import json
    import shutil

    from sinkflex_core import sft

    folder = tmp_path / "start"
    shutil.copytree(SHIPPED, folder)
    recipe = folder / "recipe"
    last = max(int(f.name[len("stage"):].partition("_")[0]) for f in recipe.glob("stage*_config.json"))
    cfg = {**json.loads(next(recipe.glob("stage1_*_config.json")).read_text()), "init_from": "runs/start/sft_sink",
           "short_warmup_steps": 1500, "short_warmup_rows": 12, "max_steps": 0, "lr": 0.001,
           "action_tools": start.ADDRESS_ROWS["action_tools"]}
    label = f"stage{last + 1}_sft_address_drill"
    (recipe / f"{label}_config.json").write_text(json.dumps(cfg))
    (recipe / f"{label}_history.csv").write_text(",".join(sft.HISTORY_COLUMNS) + "\n")
    card = start.card_text(folder)
    assert (f"- `{label}`: 1,500 drill steps of 12 short rows cut at the calls of modify_pending_order_address, "
            "modify_user_address, then no SFT step, lr 0.001; the weights at the end of the drill kept (no "
            "evaluation).") in card
    flags = start.recipe_flags(start.recipe_stages(folder))
    assert "--address-stage" in flags and f"python -m sinkflex_core.start {' '.join(flags)}\n" in card
    assert "besides the drills' short rows" in card


@pytest.fixture(scope="module")
def random_start(tmp_path_factory):
    """A random tiny policy saved as a start folder would be (no SFT: the measurement is under test)."""
    folder = tmp_path_factory.mktemp("start")
    tok = get_tokenizer()
    model = build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=3)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_stage_without_a_sink_file_continues_on_the_counts_it_trained_with(tmp_path):
    import json

    # an SFT run with sink attention saves its counts with its attention, not as a sink estimate
    (tmp_path / A.SETTINGS_FILENAME).write_text(json.dumps({"n_sink": 4, "window": 768, "layer_sinks": [4, 6, 4, 5],
                                                            "learn_sinks": True}))
    assert start.sink_settings(tmp_path)["layer_sinks"] == [4, 6, 4, 5]
    # a sink estimate beside it wins: the counts estimated on that policy
    A.save_layer_sinks(A.SinkEstimate(mass=[[0.5]] * 4, n_sink=[4, 4, 7, 4], threshold=0.05, min_sinks=4,
                                      max_sinks=16, query_start=16, num_sequences=1, sequence_length=32), tmp_path)
    settings = start.sink_settings(tmp_path)
    assert A.load_layer_sinks(settings["layer_sinks"]) == [4, 4, 7, 4]
    # neither: the sink file's path, which the SFT config refuses with its own message
    assert start.sink_settings(tmp_path / "none")["layer_sinks"] == str(tmp_path / "none" / A.SINKS_FILENAME)


def test_sink_estimate_of_a_start_has_one_count_per_layer(random_start, monkeypatch):
    ids = torch.randint(3, 500, (2, 96), generator=torch.Generator().manual_seed(0))
    from sinkflex_core.train import layer_sinks

    monkeypatch.setattr(layer_sinks, "expert_calibration_ids", lambda cfg, tok: ids)
    path = start.estimate_sinks(random_start)
    counts = A.load_layer_sinks(path)
    # as a tiny-cpu run estimates them: the preset's n_sink is every layer's floor
    assert len(counts) == 2 and all(4 <= c <= 16 for c in counts)


def test_measure_plays_full_and_sink_attention_and_reuses_finished_parts(random_start, monkeypatch):
    A.save_layer_sinks(A.SinkEstimate(mass=[[0.5], [0.5]], n_sink=[1, 3], threshold=0.05, min_sinks=1,
                                      max_sinks=16, query_start=16, num_sequences=1, sequence_length=32),
                       random_start)
    calls = []
    real = train.success_table

    def counted(*args, **kwargs):
        calls.append(kwargs.get("sinks"))
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "success_table", counted)
    monkeypatch.setattr(train.evaluate, "success_table", counted)
    start.measure(random_start, test_samples=1, screen_samples=1, progress=False, test_tasks=2, screen_tasks=2)
    tests = pd.read_csv(random_start / "test_rewards.csv")
    assert list(dict.fromkeys(tests["attention"])) == [
        "saved", "sinkflex(layer_sinks=[1,3],learn_sinks=True,n_sink=4,window=768)"]
    screen = pd.read_csv(random_start / "train_screen.csv")
    assert len(screen) == 2 and set(screen["attention"]) == {tests["attention"].iloc[-1]}
    assert [c is None for c in calls] == [True, False, False]
    # run again: both test parts and the screen are kept
    start.measure(random_start, test_samples=1, screen_samples=1, progress=False, test_tasks=2, screen_tasks=2)
    assert len(calls) == 3
    # one part cut off: only that one is played again
    tests[tests["attention"] == "saved"].to_csv(random_start / "test_rewards.csv", index=False)
    start.measure(random_start, test_samples=1, screen_samples=1, progress=False, test_tasks=2, screen_tasks=2)
    assert len(calls) == 4 and calls[-1] is not None
    # a part played under an earlier reward version is played again, the others kept
    tests = pd.read_csv(random_start / "test_rewards.csv")
    tests.loc[tests["attention"] == "saved", "reward_version"] -= 1
    tests.to_csv(random_start / "test_rewards.csv", index=False)
    start.measure(random_start, test_samples=1, screen_samples=1, progress=False, test_tasks=2, screen_tasks=2)
    assert len(calls) == 5 and calls[-1] is None
    assert set(pd.read_csv(random_start / "test_rewards.csv")["reward_version"]) == {train.reward_version()}


def test_measure_only_refuses_a_folder_without_a_policy(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        start.main(["--measure-only", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "holds no policy" in capsys.readouterr().err


def test_bad_episode_counts_are_refused_before_the_sft_or_the_measurement(tmp_path, monkeypatch, capsys):
    # they reached the measurement only after the SFT stages (hours), as a traceback from the rollouts
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(start, "build", no_work)
    monkeypatch.setattr(start, "measure", no_work)
    (tmp_path / "model.safetensors").write_bytes(b"")  # a folder --measure-only accepts; never read
    for bad in (["--test-samples", "0"], ["--test-samples", "-2"], ["--screen-samples", "-1"], ["--threads", "-1"],
                ["--device", "tpu"]):
        for mode in ([], ["--measure-only"]):
            with pytest.raises(SystemExit) as exc:
                start.main(["--out", str(tmp_path / "new" if not mode else tmp_path), *mode, *bad])
            assert exc.value.code == 2 and bad[0] in capsys.readouterr().err


def test_measure_plays_a_start_trained_with_sink_attention_with_it_and_with_full_attention(tmp_path, monkeypatch):
    folder = tmp_path / "sink_start"
    tok = get_tokenizer()
    model = build_model(tiny_qwen2_config(len(tok), hidden_size=64, num_layers=2, tokenizer=tok), seed=5)
    A.apply(model, n_sink=4, window=768, learn_sinks=True, layer_sinks=[4, 4])
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    A.save_attention_settings(model, folder)
    A.save_layer_sinks(A.SinkEstimate(mass=[[0.5], [0.5]], n_sink=[4, 4], threshold=0.05, min_sinks=4,
                                      max_sinks=16, query_start=16, num_sequences=1, sequence_length=32), folder)
    calls = []
    real = train.success_table

    def counted(*args, **kwargs):
        calls.append((kwargs.get("sinks"), kwargs.get("saved_attention", True)))
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "success_table", counted)
    monkeypatch.setattr(train.evaluate, "success_table", counted)
    start.measure(folder, test_samples=1, screen_samples=1, progress=False, test_tasks=2, screen_tasks=2)
    tests = pd.read_csv(folder / "test_rewards.csv")
    assert list(dict.fromkeys(tests["attention"])) == ["saved", "full"]
    assert calls == [(None, True), (None, False), (None, True)]  # the screen: its own attention
    assert set(pd.read_csv(folder / "train_screen.csv")["attention"]) == {"saved"}
    # the recording starts its sink-attention runs from the first and its full-attention runs from the second
    curve = load_benchmark("reproduce_curve")
    assert set(curve.start_test_rows(folder, "sinkflex", 1, 2)["attention"]) == {"saved"}
    assert set(curve.start_test_rows(folder, "sdpa", 1, 2)["attention"]) == {"full"}
    assert len(calls) == 3  # both cached
    # ... and its runs resolve to those two attentions: the trainer would refuse sdpa on these weights unasked
    for attention, saved in (("sinkflex", True), ("sdpa", False)):
        cfg = curve.grpo_config(folder, 0, tmp_path / attention, False, 1, curve.run_overrides(folder, attention, {}))
        assert (cfg.attention, cfg.saved_attention) == (attention, saved)
    with pytest.raises(train.ConfigError, match="saved_attention=false"):
        train.Trainer(curve.grpo_config(folder, 0, tmp_path / "refused", False, 1, {"attention": "sdpa"}))


TINY_RECIPE = dict(hidden_size=64, num_layers=2, max_total_tokens=512, max_turns=2, max_new_tokens_per_turn=8,
                   batch_tokens=2048, train_tasks=2, val_tasks=1, max_steps=2, eval_every=2, warmup_steps=1,
                   copy_warmup_steps=2, copy_warmup_length=64, copy_fraction=0.0, stop_at_reward=0.0)


@pytest.mark.slow
def test_sink_stage_continues_the_sft_on_the_presets_sink_attention_and_the_card_says_so(tmp_path, monkeypatch):
    from sinkflex_core import sft
    from sinkflex_core.train import layer_sinks

    # the recipe's sizes cut to seconds: two SFT steps per stage, two test tasks, no screen
    monkeypatch.setattr(start, "RECIPE", TINY_RECIPE)
    monkeypatch.setattr(start, "SINK_STAGE_STEPS", 2)
    real_measure = start.measure
    monkeypatch.setattr(start, "measure", lambda out, test_samples, screen_samples, progress:
                        real_measure(out, test_samples, screen_samples, progress, test_tasks=2))
    ids = torch.randint(3, 500, (2, 96), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(layer_sinks, "expert_calibration_ids", lambda cfg, tok: ids)
    out = start.build(tmp_path / "start", tmp_path / "work", threads=1, test_samples=1, screen_samples=0,
                      progress=False, sink_stage=True)
    work = tmp_path / "work"
    stage = sft.saved_config(work / "sft_sink")
    counts = A.load_layer_sinks(work / "sft")  # estimated on the full-attention stage
    assert (stage["init_from"], stage["attention"], stage["max_steps"]) == (str(work / "sft"), "sinkflex", 2)
    assert stage["eval_every"] == 2  # one evaluation, at the end: the last weights are the stage's
    preset = train.resolve_config("tiny-cpu")
    assert (stage["n_sink"], stage["window"], stage["learn_sinks"]) == (preset.n_sink, preset.window, True)
    assert stage["layer_sinks"] == str(work / "sft" / "sinkflex_sinks.json")
    # the start is the sink stage's policy, with the attention it trained with and those counts
    assert train.policy_digest(out) == train.policy_digest(work / "sft_sink")
    assert A.attention_settings(out) == {"n_sink": preset.n_sink, "window": preset.window, "layer_sinks": counts,
                                         "learn_sinks": True}
    assert A.load_layer_sinks(out) == counts
    model = load_policy(out)
    assert [A._layer_settings(m) for m in A._attention_modules(model)] == [(c, preset.window) for c in counts]
    assert sorted(p.name for p in (out / "recipe").glob("*_config.json")) == [
        "stage1_sft_config.json", "stage2_sft_sink_config.json"]
    card = (out / "README.md").read_text()
    assert f"sink attention: a window of {preset.window} keys, with the learned zero-value sink" in card
    assert "Trained with full causal attention" not in card and "Test reward with its saved sink attention" in card
    assert "python -m sinkflex_core.start --sink-stage" in card and card == start.card_text(out)


def test_reproduce_curve_refuses_bad_arguments_before_any_work(monkeypatch, capsys):
    """--parallel 0 would start no run and wait forever; the other arguments were checked only after the
    start's SFT stages (hours with --train-start), --set without '=' as a traceback."""
    curve = load_benchmark("reproduce_curve")

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(curve, "run_sft", no_work)
    monkeypatch.setattr(curve.start, "build", no_work)
    monkeypatch.setattr(curve.train, "count_tasks", no_work)
    for bad, says in ((["--parallel", "0"], "--parallel"), (["--set", "foo"], "KEY=VALUE"),
                      (["--set", "attention=sdpa"], "--attentions"), (["--screen-samples", "-1"], ">= 0"),
                      (["--set", "no_such_key=1"], "unknown"), (["--set", "lr=fast"], "cannot read 'fast'"),
                      (["--set", "kl_coef=-1"], "kl_coef must be >= 0"), (["--seeds", "-1"], "seed must be")):
        for start_from in (["--smoke"], ["--train-start"]):
            with pytest.raises(SystemExit) as exc:
                curve.main(start_from + bad)
            assert exc.value.code == 2 and says in capsys.readouterr().err


def test_reproduce_curve_pairs_the_start_and_a_final_policy_by_task():
    curve = load_benchmark("reproduce_curve")

    def table(tasks, successes, digest):
        return pd.DataFrame({"task": tasks, "kind": "read only", "successes": successes, "tries": 8,
                             "policy_digest": digest, "attention": "saved"})

    begin = table([2, 0, 1], [5, 1, 3], "start")
    both = curve.paired_by_task(begin, table([0, 1, 2], [2, 4, 6], "end"), "sdpa seed 0")
    assert both["task"].tolist() == [0, 1, 2]
    assert both["successes_start"].tolist() == [1, 3, 5] and both["successes"].tolist() == [2, 4, 6]
    # a start table with a task twice (the same digest measured twice) paired shifted rows by position
    with pytest.raises(SystemExit, match=r"more than one row for tasks \[1\]"):
        curve.paired_by_task(table([0, 1, 1, 2], [1, 3, 3, 5], "start"), table([0, 1, 2], [2, 4, 6], "end"), "x")
    with pytest.raises(SystemExit, match=r"different tasks \(in one only: \[2, 3\]\)"):
        curve.paired_by_task(begin, table([0, 1, 3], [2, 4, 6], "end"), "x")


def test_reproduce_curve_measures_a_start_in_data_in_a_copy(tmp_path, monkeypatch):
    """A recording with other test settings than the start's recorded ones (--test-samples, --smoke) must
    not replace the measurement the shipped start's card states; the recorded one is still reused."""
    import shutil

    curve = load_benchmark("reproduce_curve")
    data = tmp_path / "data"
    shipped = data / SHIPPED.name
    shutil.copytree(SHIPPED, shipped)
    monkeypatch.setattr(curve, "data_dir", lambda: data)
    # as recorded under the current reward (the second call below reuses it)
    pd.read_csv(shipped / "test_rewards.csv", dtype={"policy_digest": str, "git_sha": str}).assign(
        reward_version=train.reward_version()).to_csv(shipped / "test_rewards.csv", index=False)
    recorded = (shipped / "test_rewards.csv").read_bytes()
    calls = []
    real = train.success_table

    def counted(*args, **kwargs):
        calls.append(kwargs.get("saved_attention", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "success_table", counted)
    monkeypatch.setattr(train.evaluate, "success_table", counted)
    rows = curve.start_test_rows(shipped, "sdpa", 1, 2, scratch=tmp_path / "runs")
    assert len(rows) == 2 and set(rows["tries"]) == {1} and calls == [True, False]
    assert (shipped / "test_rewards.csv").read_bytes() == recorded
    # the recorded measurement (all test tasks x 8) is reused from the copy, not played again
    n_test = pd.read_csv(shipped / "test_rewards.csv")["task"].nunique()
    rows = curve.start_test_rows(shipped, "sdpa", 8, n_test, scratch=tmp_path / "runs")
    assert len(rows) == n_test and calls == [True, False]
    assert (shipped / "test_rewards.csv").read_bytes() == recorded


def test_a_smoke_recording_keeps_what_set_asks_for(tmp_path):
    curve = load_benchmark("reproduce_curve")
    smoke = curve.grpo_config(tmp_path, 0, tmp_path / "run", True, 1, {})
    asked = curve.grpo_config(tmp_path, 0, tmp_path / "run", True, 1, {"steps": 5, "group_size": 4})
    assert (smoke.steps, smoke.group_size) == (2, 2)  # the smoke sizes
    assert (asked.steps, asked.group_size) == (5, 4)  # --set wins over them
