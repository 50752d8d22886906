"""benchmarks/variant_pick_drill.py: its layouts, its rows, its counts, the arguments it refuses before
training, and its CSV."""

from __future__ import annotations

import csv
import json
import random
from types import SimpleNamespace

import pytest
import torch
from benchmark_scripts import load_benchmark

from sinkflex_core.envs.retail_world import generate_world
from sinkflex_core.models import load_tokenizer
from sinkflex_core.start import start_dir


@pytest.fixture(scope="module")
def script():
    return load_benchmark("variant_pick_drill")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(start_dir())


@pytest.fixture(scope="module")
def world():
    return generate_world(0)


def _rows(script, tok, world, layout, phrase, n=6):
    rng = random.Random(3)
    return [script.make_row(rng, tok, list(world.products.values()), world.variants, layout, phrase)
            for _ in range(n)]


@pytest.mark.parametrize("layout", ["joined", "tight", "each"])
def test_the_asked_values_stand_before_the_id_in_the_record(script, tok, layout):
    """The layouts the drill compares put the last option value two tokens before the id (the name of
    an order's item stands there too); the world's record puts the options after it."""
    record = script.variant_record({"color": "red", "style": "classic"}, "6079918521", True, 271.53, layout)
    text = json.dumps(record, separators=(",", ":"))
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    ids_at = [i for i, p in enumerate(pieces) if p.startswith("607")]
    assert [pieces[i - 2] for i in ids_at] == (["red", "classic"] if layout == "each" else ["classic"])
    world_text = json.dumps(script.variant_record({"color": "red", "style": "classic"}, "6079918521", True,
                                                         271.53, "world"))
    assert world_text.index("6079918521") < world_text.index("classic")
    with pytest.raises(ValueError, match="unknown layout"):
        script.variant_record({"color": "red"}, "1", True, 1.0, "nested")


@pytest.mark.parametrize("layout,phrase", [("world", "for"), ("joined", "to"), ("tight", "to"), ("each", "to")])
def test_a_row_scores_the_new_values_and_the_new_id_alone(script, tok, world, layout, phrase):
    for row in _rows(script, tok, world, layout, phrase):
        ids, mask, slot, at = row["input_ids"], row["mask"], row["slot"], row["values_at"]
        scored = tok.decode(ids[mask])
        text = tok.decode(ids)
        confirmation = text[text.rindex("I will exchange"):]
        new_id = tok.decode(ids[slot:int(mask.nonzero().max()) + 1])
        assert len(new_id) == 10 and new_id.isdigit() and new_id in text.split("I will exchange")[0]
        if phrase == "for":
            assert at == slot and scored == new_id and f"for {new_id} in order" in confirmation
        else:
            asked = tok.decode(ids[at:slot]).strip()
            request = text[text.index("Please exchange"):]
            sep = " " if layout == "tight" else ", "
            assert f") to ({asked.replace(sep, ', ')})" in request  # the new options the customer asked for
            assert scored.replace(" ", "") == (asked + new_id).replace(" ", "")
        assert int(ids[slot]) not in row["same_last"] | row["same_first"]  # the asked item is not counted wrong
        assert row["n_same_last"] >= 1 and row["n_same_first"] >= 1


class _Predicts:
    """A model whose argmax is a chosen token at every position: the next one, or the old item's id."""

    def __init__(self, rows, old_item=False):
        self.rows, self.old_item, self.training = rows, old_item, False

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def __call__(self, input_ids, attention_mask):
        logits = torch.zeros(*input_ids.shape, 4096)
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], 1)
        logits.scatter_(2, nxt[..., None], 1.0)
        if self.old_item:
            for j, ids in enumerate(input_ids):
                row = next(r for r in self.rows if torch.equal(r["input_ids"], ids[:len(r["input_ids"])]))
                logits[j, row["slot"] - 1] = 0
                logits[j, row["slot"] - 1, row["old_first"]] = 1.0
        return SimpleNamespace(logits=logits)


def test_the_counts_tell_a_right_pick_from_the_old_item(script, tok, world):
    rows = _rows(script, tok, world, "joined", "to", n=5)
    right = script.check(_Predicts(rows), rows, pad_id=0, chunk=2)
    assert right["first_token_right"] == right["whole_id_right"] == right["values_copied"] == 5
    assert right["old_item_first"] == right["wrong_same_last"] == right["wrong_same_first"] == 0
    old = script.check(_Predicts(rows, old_item=True), rows, pad_id=0, chunk=2)
    assert old["first_token_right"] == old["whole_id_right"] == 0 and old["old_item_first"] == 5
    assert old["values_copied"] == 5  # the values before the id are still predicted right


@pytest.mark.parametrize("argv,message", [(["--steps", "0"], "must be >= 1"), (["--eval-rows", "0"], "must be >= 1"),
                                          (["--layouts", "joined,nested"], "--layouts must name"),
                                          (["--policy", "no/such/folder"], "no model.safetensors")])
def test_bad_arguments_are_refused_before_any_training(script, argv, message, monkeypatch, capsys):
    monkeypatch.setattr(script, "run_arm", lambda *a, **k: pytest.fail("an arm was trained"))
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_short_run_writes_its_checks_with_provenance(script, tmp_path):
    out = tmp_path / "new" / "drill.csv"
    results = script.main(["--layouts", "tight", "--steps", "2", "--every", "1", "--rows", "2", "--eval-rows", "3",
                           "--threads", "1", "--csv", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["layout"], r["phrase"], r["step"]) for r in rows] == [("tight", "to", s) for s in ("0", "1", "2")]
    assert rows[0]["loss"] == "" and float(rows[2]["loss"]) > 0 and all(r["git_sha"] for r in rows)
    assert [r["first_token_right"] for r in results] == [int(r["first_token_right"]) for r in rows]
