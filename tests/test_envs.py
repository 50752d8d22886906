"""The tool environments: parser, world generator, tools, tasks, customer, reward, oracle, interface."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import (
    ENV_IDS,
    WRITE_TOOLS,
    OracleAgent,
    RetailTools,
    RetailWorld,
    ScriptedCustomer,
    evaluate_agent,
    expected_hash,
    expert_conversation,
    format_tool_call,
    get_tasks,
    parse_action,
    pass_at_k,
    pass_hat_k,
    run_episode,
    state_hash,
)
from sinkflex_core.envs.oracle import DoNothingAgent, RandomAgent
from sinkflex_core.envs.retail_tasks import generate_tasks
from sinkflex_core.envs.retail_tools import order_items
from sinkflex_core.envs.retail_world import generate_world
from sinkflex_core.models import get_tokenizer, load_tokenizer
from sinkflex_core.start import start_dir


@pytest.fixture(scope="module")
def world():
    return RetailWorld.get(0)


@pytest.fixture(scope="module")
def retail_test_env():
    env = gym.make("sinkflex/Retail-v0", split="test")
    yield env
    env.close()


# ---- parser ---------------------------------------------------------------------------------------

def test_parse_action_formats():
    a = parse_action('<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "x"}}\n</tool_call>')
    assert (a.kind, a.name, a.arguments) == ("tool", "get_user_details", {"user_id": "x"})
    b = parse_action('{"name": "think", "arguments": {"thought": "a"}}')
    assert (b.kind, b.name) == ("tool", "think")
    c = parse_action('<tool_call>{"name": "think", "arguments": "{\\"thought\\": \\"a\\"}"}</tool_call>')
    assert c.kind == "tool" and c.arguments == {"thought": "a"}
    d = parse_action('<tool_call>{"type": "function", "function": {"name": "think", "arguments": {}}}</tool_call>')
    assert d.kind == "tool" and d.name == "think"
    assert parse_action("Hello, how can I help?").kind == "message"
    assert parse_action('{"just": "json"}').kind == "message"
    assert parse_action("").kind == "message"
    assert format_tool_call("think", {"thought": "t"}) == (
        '<tool_call>\n{"name": "think", "arguments": {"thought": "t"}}\n</tool_call>')
    assert parse_action(format_tool_call("calculate", {"expression": "1+2"})).arguments == {"expression": "1+2"}


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "x", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>',
     "one tool call per turn"),
    ("x" * 70_000, "characters long"),
])
def test_parse_action_rejects(text, message):
    a = parse_action(text)
    assert a.kind == "invalid" and message in a.error


def test_parse_action_type_error():
    with pytest.raises(TypeError, match="must be a str"):
        parse_action(None)


# ---- world ----------------------------------------------------------------------------------------

def test_world_scale_and_mix(world):
    s = world.stats()
    assert (s["users"], s["orders"], s["products"]) == (500, 1000, 50)
    assert 500 <= s["variants"] <= 750 and 0.5 < s["available_variants"] / s["variants"] < 0.8
    mix = {k: v / 1000 for k, v in s["order_status"].items()}
    assert abs(mix["pending"] - 0.42) < 0.05 and abs(mix["delivered"] - 0.37) < 0.05
    assert abs(mix["processed"] - 0.10) < 0.04 and abs(mix["cancelled"] - 0.10) < 0.04
    per_product = Counter(v["product_id"] for v in world.data.variants.values())
    assert min(per_product.values()) >= 5 and max(per_product.values()) <= 20
    assert all(re.fullmatch(r"#W\d{7}", o) for o in world.data.orders)
    assert all(re.fullmatch(r"[a-z]+_[a-z]+_\d{4}", u) for u in world.data.users)
    assert all(re.fullmatch(r"(credit_card|gift_card|paypal)_\d{7}", p) for p in world.data.payment_methods)
    n_items = [len(o["items"]) for o in world.data.orders.values()]
    assert max(n_items) == 5 and 2.3 < sum(n_items) / len(n_items) < 3.3


def test_world_deterministic(world):
    again = generate_world(0)
    assert again.orders == world.data.orders and again.users == world.data.users
    other = generate_world(1)
    assert other.orders != world.data.orders
    assert state_hash(world.new_episode_db()) == world.initial_hash


def test_episode_copies_are_private(world):
    a, b = world.new_episode_db(), world.new_episode_db()
    RetailTools(a).call("modify_user_address", {"user_id": next(iter(world.data.users)), "address1": "1 X",
                                                "address2": "", "city": "c", "state": "s", "country": "USA",
                                                "zip": "00000"})
    assert state_hash(a) != world.initial_hash
    assert state_hash(b) == world.initial_hash == state_hash(world.new_episode_db())


# ---- tools ----------------------------------------------------------------------------------------

def _order(world, status, min_items=1):
    return next(o for o in world.data.orders.values() if o["status"] == status and len(o["items"]) >= min_items)


def _call(tools, name, **args):
    return tools.call(name, args).output


def test_read_tools(world):
    tools = RetailTools(world.new_episode_db())
    user = next(iter(world.data.users.values()))
    assert _call(tools, "find_user_id_by_email", email=user["email"].upper()) == user["user_id"]
    assert _call(tools, "find_user_id_by_name_zip", first_name=user["first_name"], last_name=user["last_name"],
                 zip=user["address"]["zip"]) == user["user_id"]
    details = json.loads(_call(tools, "get_user_details", user_id=user["user_id"]))
    assert details["orders"] == user["order_ids"]
    assert [p["id"] for p in details["payment_methods"]] == user["payment_method_ids"]
    record = _call(tools, "get_order_details", order_id=user["order_ids"][0])
    items = order_items(json.loads(record))
    assert [i["item_id"] for i in items] == world.data.orders[user["order_ids"][0]]["items"]
    assert [i["name"] for i in items] == [world.data.products[world.data.variants[i["item_id"]]["product_id"]]["name"]
                                          for i in items]
    # each item's id is the value of its name, two tokens after it (a small policy's previous-token
    # heads reach that far back, so it can read an item's id by its name)
    for tok in (get_tokenizer(), load_tokenizer(str(start_dir()))):  # a fresh one and the shipped start's
        for item in items:
            _name_two_tokens_before_id(tok, record, item)
    product = json.loads(_call(tools, "get_product_details", product_id=items[0]["product_id"]))
    assert items[0]["item_id"] in [v["item_id"] for v in product["variants"]]
    assert len(json.loads(_call(tools, "list_all_product_types"))) == 50
    assert _call(tools, "calculate", expression="(10 + 2.5) * 2") == "25.00"
    assert _call(tools, "calculate", expression="__import__('os')").startswith("Error")
    assert _call(tools, "calculate", expression="1/0") == "Error: division by zero"
    for overflow in ("1e999", "-1e999", "1e999 - 1e999"):  # infinity, not-a-number: refused
        assert _call(tools, "calculate", expression=overflow) == "Error: number too large"
    assert _call(tools, "get_order_details", order_id="#W0000000") == "Error: order not found"


def _name_two_tokens_before_id(tok, record: str, item: dict) -> None:
    spans = tok(record, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    name_last = record.index(f'"{item["name"]}":"{item["item_id"]}"') + len(item["name"])  # its last letter
    id_first = record.index(item["item_id"], name_last)
    name_token = next(n for n, (a, b) in enumerate(spans) if a <= name_last < b)
    id_token = next(n for n, (a, b) in enumerate(spans) if a <= id_first < b)
    assert id_token - name_token == 2, (item, [record[a:b] for a, b in spans[name_token:id_token + 1]])


def test_write_tools_refuse_without_change(world):
    conn = world.new_episode_db()
    tools = RetailTools(conn)
    delivered, pending = _order(world, "delivered", 2), _order(world, "pending", 1)
    other_user_pm = next(p for p, v in world.data.payment_methods.items() if v["user_id"] != pending["user_id"])
    own_pm = world.data.users[pending["user_id"]]["payment_method_ids"][0]
    bad = [
        ("cancel_pending_order", dict(order_id=delivered["order_id"], reason="no longer needed"), "non-pending"),
        ("cancel_pending_order", dict(order_id=pending["order_id"], reason="because"), "must be one of"),
        ("return_delivered_order_items", dict(order_id=pending["order_id"], item_ids=pending["items"][:1],
                                              payment_method_id=own_pm), "non-delivered"),
        ("modify_pending_order_payment", dict(order_id=pending["order_id"], payment_method_id=other_user_pm),
         "payment method not found"),
        ("modify_pending_order_items", dict(order_id=pending["order_id"], item_ids=["123"], new_item_ids=["456"],
                                            payment_method_id=own_pm), "not found in the order"),
        ("modify_pending_order_items", dict(order_id=pending["order_id"], item_ids=pending["items"][:1],
                                            new_item_ids=delivered["items"][:1], payment_method_id=own_pm),
         "not a variant of the same product"),
        ("get_user_details", dict(user_id=1), "must be a string"),
        ("get_user_details", dict(), "missing the argument"),
        ("get_user_details", dict(user_id="x", extra="y"), "unexpected argument"),
        ("drop_table", dict(), "unknown tool"),
        ("get_order_details", dict(order_id="#W1' OR '1'='1"), "order not found"),
    ]
    before = state_hash(conn)
    for name, args, message in bad:
        out = tools.call(name, args).output
        assert out.startswith("Error") and message in out, (name, out)
    assert state_hash(conn) == before and conn.total_changes == 0


def test_modify_items_once_and_unavailable(world):
    conn = world.new_episode_db()
    tools = RetailTools(conn)
    for order in (o for o in world.data.orders.values() if o["status"] == "pending"):
        iid = order["items"][0]
        variant = world.data.variants[iid]
        siblings = [world.data.variants[i] for i in world.data.products[variant["product_id"]]["item_ids"] if i != iid]
        avail = [s for s in siblings if s["available"] and s["item_id"] not in order["items"]]
        unavail = [s for s in siblings if not s["available"]]
        card = next((p for p in world.data.users[order["user_id"]]["payment_method_ids"]
                     if world.data.payment_methods[p]["source"] != "gift_card"), None)
        if avail and unavail and card:
            break
    args = dict(order_id=order["order_id"], item_ids=[iid], payment_method_id=card)
    out = _call(tools, "modify_pending_order_items", new_item_ids=[unavail[0]["item_id"]], **args)
    assert out.endswith("not available")
    assert conn.total_changes == 0
    out = _call(tools, "modify_pending_order_items", new_item_ids=[avail[0]["item_id"]], **args)
    assert "modified" in out
    details = json.loads(_call(tools, "get_order_details", order_id=order["order_id"]))
    assert details["status"] == "pending (item modified)" and order_items(details)[0]["item_id"] == avail[0]["item_id"]
    diff = avail[0]["price_cents"] - variant["price_cents"]
    if diff:
        assert details["payment_history"][-1]["amount"] == round(abs(diff) / 100, 2)
    again = _call(tools, "modify_pending_order_items", new_item_ids=[iid], **{**args, "item_ids": [avail[0]["item_id"]]})
    assert again == "Error: non-pending order cannot be modified"


def test_cancel_refunds_gift_card(world):
    conn = world.new_episode_db()
    tools = RetailTools(conn)
    order = next(o for o in world.data.orders.values() if o["status"] == "pending"
                 and world.data.payment_methods[o["payments"][0]["payment_method_id"]]["source"] == "gift_card")
    pm = order["payments"][0]["payment_method_id"]
    before = world.data.payment_methods[pm]["balance_cents"]
    assert "cancelled" in _call(tools, "cancel_pending_order", order_id=order["order_id"], reason="ordered by mistake")
    after = conn.execute("SELECT balance_cents FROM payment_methods WHERE payment_method_id = ?", (pm,)).fetchone()[0]
    assert after == before + order["payments"][0]["amount_cents"]
    details = json.loads(_call(tools, "get_order_details", order_id=order["order_id"]))
    assert details["status"] == "cancelled" and details["payment_history"][-1]["type"] == "refund"


def test_cancel_after_a_payment_change_refunds_each_method_once(world):
    """The old method was refunded when the payment changed; cancelling refunds only the new one."""
    order = next(o for o in world.data.orders.values() if o["status"] == "pending"
                 and world.data.payment_methods[o["payments"][0]["payment_method_id"]]["source"] == "gift_card"
                 and len(world.data.users[o["user_id"]]["payment_method_ids"]) > 1)
    gift = order["payments"][0]["payment_method_id"]
    other = next(p for p in world.data.users[order["user_id"]]["payment_method_ids"] if p != gift)
    conn = world.new_episode_db()
    tools = RetailTools(conn)

    def balance():
        return conn.execute("SELECT balance_cents FROM payment_methods WHERE payment_method_id = ?",
                            (gift,)).fetchone()[0]

    start, cents = balance(), order["payments"][0]["amount_cents"]
    _call(tools, "modify_pending_order_payment", order_id=order["order_id"], payment_method_id=other)
    assert balance() == start + cents
    _call(tools, "cancel_pending_order", order_id=order["order_id"], reason="no longer needed")
    assert balance() == start + cents  # not refunded a second time
    history = json.loads(_call(tools, "get_order_details", order_id=order["order_id"]))["payment_history"]
    refunds = Counter(h["payment_method_id"] for h in history if h["type"] == "refund")
    assert refunds == {gift: 1, other: 1}


# ---- tasks ----------------------------------------------------------------------------------------

def test_tasks_cover_the_tools(world):
    train, test = get_tasks(0, "train"), get_tasks(0, "test")
    assert len(train) >= 500 and len(test) >= 100
    for tasks in (train, test):
        used = {a["name"] for t in tasks for a in t["actions"]}
        assert set(WRITE_TOOLS) <= used
        kinds = Counter(r["kind"] for t in tasks for r in t["requests"])
        assert kinds["refuse"] >= 0.1 * len(tasks)
        assert sum(len(t["requests"]) > 1 for t in tasks) >= 0.15 * len(tasks)
        assert all(t["outputs"] or t["actions"] for t in tasks)  # a do-nothing agent can never pass
    assert not {t["user_id"] for t in train} & {t["user_id"] for t in test}
    assert get_tasks(0, "test") == tuple(generate_tasks(world.data, "test"))  # deterministic


def test_synthetic_split_is_apart_from_train_and_test(world):
    """The SFT expert data's split: training users only, a task stream of its own, one env interface."""
    train, test, synthetic = (get_tasks(0, s) for s in ("train", "test", "synthetic"))
    assert len(synthetic) == 10_000
    users = {t["user_id"] for t in synthetic}
    assert not users & {t["user_id"] for t in test}
    assert len(users) >= 300 and users <= set(world.data.users)  # spread over the training users
    same = sum(a["instruction"] == b["instruction"] for a, b in zip(train, synthetic))
    assert same < 5, same  # an independent draw, not the train split again
    assert synthetic[0]["task_id"].startswith("synthetic-")
    env = gym.make("sinkflex/Retail-v0", split="synthetic")
    obs, info = env.reset(options={"task_index": 9_999})
    assert info["task"]["task_id"] == "synthetic-9999" and obs
    env.close()
    with pytest.raises(ValueError, match="synthetic"):
        gym.make("sinkflex/Retail-v0", split="validation")
    with pytest.raises(ValueError, match="'train', 'test'"):
        generate_tasks(world.data, "dev")


def test_ground_truth_replays_cleanly(world):
    for split in ("train", "test"):
        for task in get_tasks(0, split):
            tools = RetailTools(world.new_episode_db())
            for action in task["actions"]:
                out = tools.call(action["name"], action["arguments"]).output
                assert not out.startswith("Error"), (task["task_id"], action, out)


# ---- customer -------------------------------------------------------------------------------------

def test_scripted_customer():
    task = next(t for t in get_tasks(0, "test") if t["requests"][0]["kind"] == "cancel" and len(t["requests"]) == 1)
    req = task["requests"][0]
    c = ScriptedCustomer(task)
    assert c.opening() == "Hi! " + req["text"]
    ident, done = c.reply("Please give me your email or name and zip code.")
    assert not done and (task["persona"]["email"] in ident or task["persona"]["zip"] in ident)
    wrong, _ = c.reply(f"I will cancel order {req['order_id']} (reason: something else). Proceed? (yes/no)")
    assert wrong.startswith("No")
    reason = req["actions"][0]["arguments"]["reason"]
    assert c.reply(f"I will cancel order {req['order_id']} (reason: {reason}). Proceed? (yes/no)") == ("yes", False)
    text, done = c.reply("Done.")
    assert done and text.endswith("###STOP###")
    stuck = ScriptedCustomer(task)
    replies = [stuck.reply("hmm") for _ in range(6)]
    assert replies[-1][1] and "###STOP###" in replies[-1][0]


def test_the_oracles_item_confirmations_name_each_item_before_its_id():
    from sinkflex_core.envs.oracle import _name_items, expert_conversation

    shelf = {"name": "Bookshelf", "item_id": "2552978718", "options": {"material": "cotton", "style": "modern"}}
    card = {"name": "Gift Card", "item_id": "1234567890", "options": {}}
    assert _name_items([shelf]) == "the Bookshelf 2552978718 (cotton, modern)"
    assert _name_items([shelf, card, shelf]) == ("the Bookshelf 2552978718 (cotton, modern), the Gift Card 1234567890 "
                                                 "and the Bookshelf 2552978718 (cotton, modern)")
    # in a whole episode: the customer confirms it and the return is rewarded
    task = next(i for i, t in enumerate(get_tasks(0, "test")) if [r["kind"] for r in t["requests"]] == ["return"])
    messages, reward = expert_conversation("sinkflex/Retail-v0", "test", task)
    confirmation = next(m["content"] for m in messages if m["role"] == "assistant" and "Proceed?" in m["content"])
    call = get_tasks(0, "test")[task]["requests"][0]["actions"][0]["arguments"]
    assert re.search(r"I will return the .+ " + call["item_ids"][0], confirmation) and reward == 1.0


# ---- environment interface ------------------------------------------------------------------------

@pytest.mark.parametrize("env_id", ENV_IDS)
def test_check_env(env_id):
    env = gym.make(env_id, split="train")
    check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_reset_contract(env_id):
    env = gym.make(env_id, split="test", max_turns=5)
    try:
        assert env.unwrapped.num_tasks >= 100
        obs, info = env.reset(seed=0, options={"task_index": 1})
        assert isinstance(obs, str) and obs and info["obs_role"] == "user"
        assert isinstance(info["task"], dict) and isinstance(info["policy"], str) and len(info["policy"]) > 200
        for tool in info["tools"]:
            assert tool["type"] == "function" and set(tool["function"]) == {"name", "description", "parameters"}
            assert tool["function"]["parameters"]["type"] == "object"
        rewards = []
        for _ in range(5):
            obs, reward, terminated, truncated, step_info = env.step("hello")
            rewards.append(reward)
            assert step_info["obs_role"] in ("user", "tool")
            if terminated or truncated:
                break
        assert (terminated or truncated) and all(r == 0.0 for r in rewards), (terminated, truncated, rewards)
        obs, reward, terminated, _, _ = env.unwrapped.step('<tool_call>{"name": "think", "arguments": {}}</tool_call>')
        assert obs.startswith("Error: the episode has ended") and terminated
        with pytest.raises(ValueError, match="task_index"):
            env.reset(options={"task_index": 10_000})
        with pytest.raises(ValueError, match="split"):
            gym.make(env_id, split="dev")
    finally:
        env.close()


def test_step_before_reset_raises():
    env = gym.make("sinkflex/Retail-v0")
    with pytest.raises(RuntimeError, match="reset"):
        env.unwrapped.step("hi")
    with pytest.raises(gym.error.ResetNeeded):
        env.step("hi")
    env.close()


def test_random_reset_is_seeded():
    env = gym.make("sinkflex/Retail-v0")
    a = env.reset(seed=7)[1]["task_index"]
    b = env.reset(seed=7)[1]["task_index"]
    assert a == b
    assert len({env.reset(seed=s)[1]["task_index"] for s in range(10)}) > 1
    env.close()


# ---- reward and oracle ----------------------------------------------------------------------------

@pytest.mark.slow
def test_oracle_solves_test_split(retail_test_env):
    rewards = [run_episode(retail_test_env, OracleAgent(), i)[1] for i in range(retail_test_env.unwrapped.num_tasks)]
    assert sum(rewards) / len(rewards) >= 0.99


def test_bank_oracle_solves_test_split():
    env = gym.make("sinkflex/BankSQL-v0", split="test")
    rewards = [run_episode(env, OracleAgent(), i)[1] for i in range(env.unwrapped.num_tasks)]
    assert sum(rewards) / len(rewards) >= 0.99


@pytest.mark.parametrize("env_id", ["sinkflex/Retail-v0", "sinkflex/BankSQL-v0"])
def test_baselines_near_zero(env_id):
    env = gym.make(env_id, split="test")
    for agent in (RandomAgent(0), DoNothingAgent()):
        rewards = [run_episode(env, agent, i)[1] for i in range(0, env.unwrapped.num_tasks, 2)]
        assert sum(rewards) / len(rewards) <= 0.05
    env.close()


def test_reward_needs_state_and_outputs(retail_test_env):
    env = retail_test_env
    tasks = get_tasks(0, "test")
    # a write task: right state -> 1; replaying ground truth directly (no conversation) is also enough
    i = next(k for k, t in enumerate(tasks) if t["actions"] and not t["outputs"])
    env.reset(options={"task_index": i})
    backend = env.unwrapped.backend
    for a in tasks[i]["actions"]:
        assert not backend.call_tool(a["name"], a["arguments"]).output.startswith("Error")
    assert backend.reward()[0] == 1.0
    # one extra write -> different state -> 0
    env.reset(options={"task_index": i})
    for a in tasks[i]["actions"]:
        backend.call_tool(a["name"], a["arguments"])
    backend.call_tool("modify_user_address", {"user_id": tasks[i]["user_id"], "address1": "9 Nowhere", "address2": "",
                                              "city": "X", "state": "Y", "country": "USA", "zip": "00001"})
    reward, details = backend.reward()
    assert reward == 0.0 and not details["db_match"] and details["db_changed"]
    # an information task: the answer must be said to the customer
    j = next(k for k, t in enumerate(tasks) if t["outputs"] and not t["actions"])
    env.reset(options={"task_index": j})
    assert backend.reward()[0] == 0.0
    backend.respond(f"The answer is {tasks[j]['outputs'][0].upper()}.")
    reward, details = backend.reward()
    assert reward == 0.0 and details["outputs_found"] == [True] and not details["answers_looked_up"]  # a guess
    assert details["db_match"] and not details["db_changed"]  # nothing was written
    backend.call_tool("get_order_details", {"order_id": "#W0000000"})  # a failed read reads nothing
    assert backend.reward()[0] == 0.0
    for r in tasks[j]["requests"]:
        assert not backend.call_tool("get_order_details", {"order_id": r["order_id"]}).output.startswith("Error")
    assert backend.reward() == (1.0, {**details, "answers_looked_up": True})
    env.reset(options={"task_index": j})  # what was read belongs to its episode
    backend.respond(f"The answer is {tasks[j]['outputs'][0].upper()}.")
    assert backend.reward()[0] == 0.0
    assert expected_hash(env.unwrapped.backend.world, "test", j) == env.unwrapped.backend.world.initial_hash


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_constant_answer_earns_nothing(split):
    """A policy that says the commonest answer whatever the customer asks ("the order is delivered"),
    with no tool call, would answer every task whose answer it is; an answer counts only once the order
    it is about was looked up."""
    env = gym.make("sinkflex/Retail-v0", split=split)
    tasks = get_tasks(0, split)
    guessable = [k for k, t in enumerate(tasks) if not t["actions"] and t["outputs"] == ["delivered"]]
    assert len(guessable) >= 10
    for k in guessable:
        env.reset(options={"task_index": k})
        terminated = truncated = False
        while not (terminated or truncated):
            _, reward, terminated, truncated, info = env.step("The order is delivered.")
        assert reward == 0.0 and info["reward_info"]["outputs_found"] == [True], k
        assert not info["reward_info"]["answers_looked_up"], k
    env.close()


def test_naming_every_status_answers_no_status_question(retail_test_env):
    """A message that lists every possible answer neither earns the reward nor satisfies the customer,
    while the one right label does both (the oracle's answers: test_oracle_solves_test_split)."""
    from sinkflex_core.envs.retail_tasks import ANSWER_LABELS, answer_given

    stuffing = "Your order is pending, processed, delivered or cancelled; the item is not available."
    tasks = get_tasks(0, "test")
    label_tasks = [k for k, t in enumerate(tasks) if not t["actions"] and set(t["outputs"]) <= set(ANSWER_LABELS)]
    assert len(label_tasks) >= 10
    for k in label_tasks:
        obs, info = retail_test_env.reset(options={"task_index": k})
        obs, reward, terminated, truncated, info = retail_test_env.step(stuffing)
        assert reward == 0.0 and "Thanks" not in obs, (k, obs)
        assert retail_test_env.unwrapped.backend.reward()[0] == 0.0
    assert answer_given("pending", "Order #W1 is Pending.") and answer_given("76.40", "That is 76.40 dollars.")
    assert not answer_given("pending", "It is pending or delivered.")
    assert answer_given("not available", "Sorry, the lamp is not available.")
    assert not answer_given("delivered", "Order #W1 was undelivered")  # a substring that is not the word
    assert answer_given("cancelled", "Order #W1 is cancelled, so I cannot cancel it.")


def test_expert_conversation_format():
    messages, reward = expert_conversation("sinkflex/Retail-v0", "test", 2)
    assert reward == 1.0 and messages[0]["role"] == "system" and messages[1]["role"] == "user"
    roles = [m["role"] for m in messages]
    assert roles[-1] == "user" and "###STOP###" in messages[-1]["content"]
    for prev, m in zip(messages, messages[1:]):
        if m["role"] == "tool":
            assert prev["role"] == "assistant" and prev["tool_calls"]
        if m["role"] == "assistant" and m.get("tool_calls"):
            call = m["tool_calls"][0]
            assert m["content"] == "" and call["type"] == "function" and isinstance(call["function"]["arguments"], dict)
    assert expert_conversation("sinkflex/Retail-v0", "test", 2) == (messages, reward)  # deterministic
    bank_messages, bank_reward = expert_conversation("sinkflex/BankSQL-v0", "train", 0)
    assert bank_reward == 1.0 and bank_messages[-2]["tool_calls"][0]["function"]["name"] == "submit_answer"


def test_bank_grading_is_by_result_set():
    env = gym.make("sinkflex/BankSQL-v0", split="test")
    from sinkflex_core.envs.bank import bank_tasks

    tasks = bank_tasks(0, "test")
    i = next(k for k, t in enumerate(tasks) if len(t["answer"]) > 2)
    sql = tasks[i]["sql"]
    env.reset(options={"task_index": i})
    *_, reward, terminated, _, _ = env.step(format_tool_call("submit_answer", {"query": f"SELECT * FROM ({sql}) ORDER BY 1 DESC"}))
    assert terminated and reward == 1.0
    env.reset(options={"task_index": i})
    _, reward, terminated, _, _ = env.step(format_tool_call("submit_answer", {"query": f"SELECT * FROM ({sql}) LIMIT 1"}))
    assert terminated and reward == 0.0
    env.close()


def test_pass_at_k_is_the_chance_that_one_of_k_tries_succeeds():
    assert pass_at_k([[True, True, False, False]], 1) == pytest.approx(0.5)
    assert pass_at_k([[True, True, False, False]], 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k([(1, 4), (0, 4)], 4) == pytest.approx(0.5)
    outcomes = [True, False, True, False, False]  # every 3 of the 5 tries, counted by hand
    subsets = list(itertools.combinations(outcomes, 3))
    assert pass_at_k([outcomes], 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k([(3, 8), (1, 8)], 1) == pytest.approx(pass_hat_k([(3, 8), (1, 8)], 1))
    with pytest.raises(ValueError, match="fewer than k"):
        pass_at_k([[True]], 2)
    with pytest.raises(ValueError, match="positive int"):
        pass_at_k([[True]], 0)


def test_pass_hat_k():
    assert pass_hat_k([[True, True, False, False]], 1) == pytest.approx(0.5)
    assert pass_hat_k([[True, True, False, False]], 2) == pytest.approx(1 / 6)
    assert pass_hat_k([(4, 4), (0, 4)], 3) == pytest.approx(0.5)
    assert pass_hat_k([[True] * 8, [True] * 7 + [False]], 8) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="fewer than k"):
        pass_hat_k([[True]], 2)
    with pytest.raises(ValueError, match="positive"):
        pass_hat_k([[True]], 0)


def test_pass_at_k_reads_numpy_counts_and_bool_outcomes():
    import numpy as np

    counts = [(c, 8) for c in np.array([3, 0])]  # numpy ints, as from a DataFrame's values
    assert pass_at_k(counts, 1) == pytest.approx(3 / 16) and pass_hat_k(counts, 1) == pytest.approx(3 / 16)
    assert pass_at_k([(False, True)], 1) == pytest.approx(0.5)  # two outcomes, not a (c, n) pair
    assert pass_at_k([(True, False)], 2) == pytest.approx(1.0)


def test_custom_customer_plugs_in():
    class TerseCustomer:  # stands in for an LLM-backed customer
        def __init__(self, task):
            self.task = task

        def opening(self):
            return f"hello, I am {self.task['persona']['first_name']}"

        def reply(self, agent_text):
            return ("bye ###STOP###", True) if "bye" in agent_text else ("go on", False)

    env = gym.make("sinkflex/Retail-v0", split="test", customer_factory=TerseCustomer)
    obs, info = env.reset(options={"task_index": 0})
    assert obs == f"hello, I am {info['task']['persona']['first_name']}"
    assert env.step("hi")[0] == "go on"
    obs, reward, terminated, truncated, _ = env.step("bye")
    assert terminated and not truncated and reward == 0.0
    env.close()


@pytest.mark.parametrize("env_id", ["sinkflex/BankSQL-v0", "sinkflex/Airline-v0", "sinkflex/Bash-v0",
                                    "sinkflex/CodeRepair-v0"])
def test_the_one_oracle_agent_plays_every_world(env_id):
    env = gym.make(env_id, split="test")
    try:
        results = evaluate_agent(env, lambda t: OracleAgent(), range(2), trials=1, seed=0)
    finally:
        env.close()
    assert [r[0] for r in results] == [1.0, 1.0]
