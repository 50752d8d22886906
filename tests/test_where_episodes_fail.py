"""benchmarks/where_episodes_fail.py: where an episode first leaves the oracle's tool calls, and the
teacher-forced accuracy on the values of those calls."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark

from sinkflex_core import sft
from sinkflex_core.envs.base import format_tool_call
from sinkflex_core.envs.oracle import expert_conversation
from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config
from sinkflex_core.sft_data import token_texts


@pytest.fixture(scope="module")
def script():
    return load_benchmark("where_episodes_fail")


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer()


def _turn(text: str = "", calls: list | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return message


def _next_token_model(vocab: int, wrong: set = frozenset()) -> torch.nn.Module:
    """A model that predicts every next token of its input, except at the positions in ``wrong`` (the
    token before each predicts another token)."""
    class NextToken(torch.nn.Module):
        def forward(self, input_ids, **kw):
            target = torch.roll(input_ids, -1, 1)
            for n in wrong:
                target[0, n - 1] = (target[0, n - 1] + 1) % vocab
            return type("Out", (), {"logits": torch.nn.functional.one_hot(target, vocab).float()})()

    return NextToken()


def test_the_first_difference_names_the_call_and_the_value(script):
    oracle = [("find_user_id_by_email", {"email": "mei.patel4567@example.com"}),
              ("get_user_details", {"user_id": "mei_patel_4567"})]
    right, wrong_id = oracle[0], ("get_user_details", {"user_id": "mei_patel_4566"})
    greeting = _turn("Sure. Please tell me your email.")
    cases = {
        "every call right (answer, extra calls or the end)": [greeting, _turn(calls=[right]), _turn(calls=[oracle[1]])],
        "call 1 (get_user_details): wrong user_id": [greeting, _turn(calls=[right]), _turn(calls=[wrong_id])],
        "call 1 (get_user_details): never made": [greeting, _turn(calls=[right]), _turn("Your order is pending.")],
        "call 0 (find_user_id_by_email): another tool (get_user_details)": [_turn(calls=[oracle[1]])],
        # a call written in the text, as read by the environment's parser, counts like a recorded one
        "call 0 (find_user_id_by_email): wrong email,zip": [_turn(format_tool_call(
            "find_user_id_by_email", {"email": "mei.patel4567@example.org", "zip": "1"}))],
        # an unreadable call: where its text leaves the oracle's call
        "call 0 (find_user_id_by_email): unreadable, off at email": [_turn(
            '<tool_call>\n{"name": "find_user_id_by_email", "arguments": {"email": "mei.pat "x"}}\n</tool_call>')],
        "call 0 (find_user_id_by_email): unreadable, off at tool name": [_turn(
            '<tool_call>\n{"name": "find_user_id_by_mail", "arguments": {"email": }}\n</tool_call>')],
        "call 0 (find_user_id_by_email): unreadable, off at format": [_turn(
            '<tool_call>\n{"name": "find_user_id_by_email", "arguments": {"email": "mei.patel4567@example.com"}}}'
            '\n</tool_call>')],
    }
    for expected, messages in cases.items():
        assert script.first_difference(messages, oracle) == expected, messages


def test_the_oracles_own_episodes_leave_nothing(script):
    messages, reward = expert_conversation("sinkflex/Retail-v0", "test", 4)
    calls = script.oracle_calls(messages)
    assert reward == 1.0 and calls[0][0].startswith("find_user_id_by_") and len(calls) >= 3
    assert script.first_difference(messages, calls) == "every call right (answer, extra calls or the end)"
    assert script.first_difference(messages[:-3], calls + [("think", {"thought": "x"})]).endswith("never made")


def test_value_accuracy_is_perfect_for_a_model_that_knows_the_next_token(script, tokenizer):
    examples = sft.expert_examples(tokenizer, sft.SFTConfig(), [0, 1, 2], split="test")

    rows = script.value_accuracy(_next_token_model(len(tokenizer)), tokenizer, examples)
    by = {(r["argument"], r["origin"]): r for r in rows}
    assert {("email", "copy"), ("user_id", "copy"), ("order_id", "copy"), ("name", "new")} <= set(by)
    assert all(r["first"] == r["rest"] == r["whole"] == 1.0 for r in rows)
    random = build_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer))
    guessed = script.value_accuracy(random, tokenizer, examples)
    assert [(r["argument"], r["values"]) for r in guessed] == [(r["argument"], r["values"]) for r in rows]
    assert sum(r["whole"] for r in guessed) < 0.5 * len(guessed)  # random weights copy (almost) nothing


def test_the_item_ids_of_the_oracles_confirmations_are_rows_of_their_own(script, tokenizer):
    from sinkflex_core.train import task_kinds

    kinds = task_kinds("test", list(range(120)))
    tasks = [next(t for t, k in enumerate(kinds) if k == kind)
             for kind in ("return_delivered_order_items", "exchange_delivered_order_items", "modify_pending_order_items")]
    examples = sft.expert_examples(tokenizer, sft.SFTConfig(), tasks, split="test")

    rows = {(r["argument"], r["origin"]): r for r in script.value_accuracy(_next_token_model(len(tokenizer)), tokenizer,
                                                                       examples)}
    # every item id the calls name, each once in the confirmation before them; the new items of the
    # exchange and of the change of items too (the calls' rows count the first id of each list)
    calls = [args for t in tasks for _, args in script.oracle_calls(expert_conversation("sinkflex/Retail-v0", "test", t)[0])]
    assert sum(r["values"] for (arg, _), r in rows.items() if arg == "items (message)") == \
        sum(len(a.get("item_ids", [])) for a in calls) == 5
    assert sum(r["values"] for (arg, _), r in rows.items() if arg == "new items (message)") == \
        sum(len(a.get("new_item_ids", [])) for a in calls) == 3
    assert all(r["whole"] == 1.0 for r in rows.values())
    # wrong at the first token of the confirmation's first item id: only that row's first token drops
    texts = token_texts(tokenizer)
    ids = examples[0]["input_ids"]
    text, starts = script.text_and_starts(ids, texts)
    assert text == tokenizer.decode(ids) and len(starts) == len(ids)
    confirmed = script.CONFIRMED_ITEMS.search(text)
    first_id = script.ITEM_ID.search(confirmed.group(1))
    at = confirmed.start(1) + first_id.start()
    first = max(n for n, c in enumerate(starts) if c <= at)
    wrong = {(r["argument"], r["origin"]): r
             for r in script.value_accuracy(_next_token_model(len(tokenizer), {first}), tokenizer, examples[:1])}
    origin = script._listed(text[:starts[first]], first_id.group())
    assert origin in ("first listed", "listed later")
    for key, r in wrong.items():
        assert (r["first"] < 1.0) == (key == ("items (message)", origin)), key


def test_a_confirmed_item_is_placed_in_the_last_record_that_lists_it(script):
    record = '<tool_response>\n{"items":[{"Lamp":"111","product_id":"9"},{"Kettle":"222","product_id":"8"}]}\n</tool_response>'
    variants = '<tool_response>\n{"variants":{"333":{"item_id":"333"},"111":{"item_id":"111"}}}\n</tool_response>'
    assert script._listed(record, "111") == "first listed"
    assert script._listed(record, "222") == "listed later"
    assert script._listed(record + variants, "111") == "listed later"  # the last output that names it
    assert script._listed(record + variants, "222") == "listed later"
    assert script._listed(record, "444") == "new"
    assert script._listed('{"item_id":"444"} outside any tool output', "444") == "new"


def test_the_payment_methods_of_the_oracles_confirmations_are_rows_of_their_own(script, tokenizer):
    from sinkflex_core.train import task_kinds

    kinds = task_kinds("test", list(range(120)))
    tasks = [t for t, k in enumerate(kinds) if k == "modify_pending_order_payment"][:3]
    examples = sft.expert_examples(tokenizer, sft.SFTConfig(), tasks, split="test")

    rows = [r for r in script.value_accuracy(_next_token_model(len(tokenizer)), tokenizer, examples)
            if r["argument"] == "payment (message)"]
    # one confirmation before each payment change; the call after it and the report are not message rows
    calls = [args for t in tasks for name, args in script.oracle_calls(
        expert_conversation("sinkflex/Retail-v0", "test", t)[0]) if name == "modify_pending_order_payment"]
    assert sum(r["values"] for r in rows) == len(calls) == 3
    assert all(r["whole"] == 1.0 for r in rows)
    # wrong at the first digits of the first confirmation's id: that row's first token drops, the rest stays
    texts = token_texts(tokenizer)
    ids = examples[0]["input_ids"]
    text, starts = script.text_and_starts(ids, texts)
    value = calls[0]["payment_method_id"]
    at = text.index(f"{value}. Proceed") + value.rindex("_") + 1
    first = starts.index(at)
    wrong = [r for r in script.value_accuracy(_next_token_model(len(tokenizer), {first}), tokenizer, examples[:1])
             if r["argument"] == "payment (message)"]
    assert [(r["first"], r["rest"]) for r in wrong] == [(0.0, 1.0)]
    assert wrong[0]["origin"] == script._latest_of_prefix(text[:at - value.rindex("_") - 1], value)


def test_a_confirmed_payment_method_is_placed_among_the_ids_with_its_last_word(script):
    user = '{"payment_methods":[{"id":"gift_card_111"},{"id":"credit_card_222"},{"id":"paypal_333"}]}'
    order = '{"payment_history":[{"payment_method_id":"credit_card_222"}]}'
    # a gift card's id and a credit card's share the tokens before their digits (card _)
    assert script._latest_of_prefix(user, "credit_card_222") == "latest of its prefix"
    assert script._latest_of_prefix(user, "gift_card_111") == "another after it"
    assert script._latest_of_prefix(user + order, "paypal_333") == "latest of its prefix"
    assert script._latest_of_prefix(user + order + "gift_card_111", "gift_card_111") == "latest of its prefix"
    assert script._latest_of_prefix(order, "paypal_333") == "new"


def test_command_line(script, tokenizer, tmp_path, capsys):
    policy = tmp_path / "policy"
    build_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer)).save_pretrained(
        policy)
    tokenizer.save_pretrained(policy)
    assert script.main(["--policy", str(policy), "--tasks", "3", "--samples", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 test tasks x 1 episodes at temperature 1: 0 of 3 succeeded" in printed
    assert "call 0 (find_user_id_by_" in printed and "teacher-forced" in printed
    with pytest.raises(SystemExit):
        script.main(["--policy", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        script.main(["--policy", str(policy), "--kinds", "no such kind"])


def test_a_temperature_that_is_not_a_number_is_refused_before_the_policy_loads(script, tmp_path, monkeypatch,
                                                                              capsys):
    from sinkflex_core import models

    def no_work(*args, **kwargs):
        raise AssertionError("the policy was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_policy", no_work)
    (tmp_path / "config.json").write_text("{}")  # passes the folder check; never loaded
    for value in ("nan", "inf", "-1"):
        with pytest.raises(SystemExit) as exc:
            script.main(["--policy", str(tmp_path), "--temperature", value])
        assert exc.value.code == 2 and f"--temperature {float(value)}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        script.main(["--policy", str(tmp_path), "--threads", "-1"])
    assert exc.value.code == 2 and "--threads must be >= 0" in capsys.readouterr().err
