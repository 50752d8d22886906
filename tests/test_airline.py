"""The airline world: generator, tools and their refusals, answers, tasks, customer, reward, oracle."""

from __future__ import annotations

import json
import re
from collections import Counter

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import OracleAgent, expert_conversation, run_episode
from sinkflex_core.envs.airline import AirlineCustomer, expected_hash
from sinkflex_core.envs.airline_schemas import TOOL_NAMES, WRITE_TOOLS
from sinkflex_core.envs.airline_tasks import generate_tasks, get_tasks
from sinkflex_core.envs.airline_text import answer_given, parse_request
from sinkflex_core.envs.airline_tools import AirlineTools
from sinkflex_core.envs.airline_world import (
    DAY_BEFORE_NOW,
    NOW,
    AirlineWorld,
    generate_world,
    state_hash,
)
from sinkflex_core.envs.oracle import DoNothingAgent, RandomAgent


@pytest.fixture(scope="module")
def world():
    return AirlineWorld.get(0)


@pytest.fixture(scope="module")
def test_env():
    env = gym.make("sinkflex/Airline-v0", split="test")
    yield env
    env.close()


def _call(tools, name, **args):
    return tools.call(name, args).output


def _dep(world, f):
    return f"{f['date']}T{world.data.flights[f['flight_number']]['departure']}"


def _open(world, res):
    return res["status"] is None and all(_dep(world, f) > NOW for f in res["flights"])


def _reservation(world, **want):
    """The first open reservation whose fields (or predicates) match ``want``."""
    for r in world.data.reservations.values():
        if _open(world, r) and all(v(r[k]) if callable(v) else r[k] == v for k, v in want.items()):
            return r
    raise LookupError(want)


# ---- world ----------------------------------------------------------------------------------------

def test_world_scale_and_mix(world):
    s = world.stats()
    assert (s["users"], s["flights"], s["flight_dates"], s["reservations"]) == (500, 300, 9000, 2000)
    assert set(s["membership"]) == {"regular", "silver", "gold"} and set(s["cabin"]) == {
        "basic_economy", "economy", "business"}
    assert set(s["status"]) == {"available", "landed", "flying", "on time", "delayed", "cancelled"}
    assert 0.3 < s["flight_type"]["round_trip"] / 2000 < 0.6
    sources = Counter(p["source"] for p in world.data.payment_methods.values())
    assert set(sources) == {"credit_card", "gift_card", "certificate"}
    assert all(re.fullmatch(r"[A-Z0-9]{6}", r) for r in world.data.reservations)
    assert all(re.fullmatch(r"[a-z]+_[a-z]+_\d{4}", u) for u in world.data.users)
    assert all(re.fullmatch(r"SF\d{3}", f) for f in world.data.flights)
    for r in world.data.reservations.values():  # every itinerary chains from its origin
        legs = [world.data.flights[f["flight_number"]] for f in r["flights"]]
        assert legs[0]["origin"] == r["origin"] and all(a["destination"] == b["origin"] for a, b in zip(legs, legs[1:]))
        assert 1 <= len(r["passengers"]) <= 3 and r["payments"]
    # some open reservations are cancellable on each ground, so the tasks can cover them
    assert any(r["created_at"] > DAY_BEFORE_NOW and _open(world, r) for r in world.data.reservations.values())


def test_world_deterministic_and_copies_private(world):
    again = generate_world(0)
    assert again.reservations == world.data.reservations and again.flight_dates == world.data.flight_dates
    assert generate_world(1).reservations != world.data.reservations
    a, b = world.new_episode_db(), world.new_episode_db()
    user = next(iter(world.data.users))
    assert "certificate" in _call(AirlineTools(a), "send_certificate", user_id=user, amount=50)
    assert state_hash(a) != world.initial_hash == state_hash(b)


# ---- tools: reads ---------------------------------------------------------------------------------

def test_read_tools(world):
    tools = AirlineTools(world.new_episode_db())
    uid, user = next(iter(world.data.users.items()))
    details = json.loads(_call(tools, "get_user_details", user_id=uid))
    assert details["reservations"] == user["reservation_ids"] and details["membership"] == user["membership"]
    assert [p["id"] for p in details["payment_methods"]] == user["payment_ids"]
    res = json.loads(_call(tools, "get_reservation_details", reservation_id=user["reservation_ids"][0]))
    assert [f["flight_number"] for f in res["flights"]] == [
        f["flight_number"] for f in world.data.reservations[res["reservation_id"]]["flights"]]
    assert len(json.loads(_call(tools, "list_all_airports"))) == 20
    number, date = next(k for k, v in world.data.flight_dates.items() if v["status"] == "available")
    f = world.data.flights[number]
    found = json.loads(_call(tools, "search_direct_flight", origin=f["origin"], destination=f["destination"], date=date))
    assert number in [x["flight_number"] for x in found]
    assert all(world.data.flight_dates[(x["flight_number"], date)]["status"] == "available" for x in found)
    assert _call(tools, "get_flight_status", flight_number=number, date=date) == "available"
    pairs = json.loads(_call(tools, "search_onestop_flight", origin="JFK", destination="LAX", date="2024-06-20"))
    assert pairs and all(a["destination"] == b["origin"] and a["arrival"] <= b["departure"] for a, b in pairs)
    assert _call(tools, "calculate", expression="(100 + 50) * 3") == "450"
    assert _call(tools, "calculate", expression="10 / 4") == "2.50"
    for overflow in ("1e309", "1e309 - 1e309"):  # infinity and not-a-number: refused, not a crash
        assert _call(tools, "calculate", expression=overflow) == "Error: number too large"
    assert _call(tools, "get_reservation_details", reservation_id="' OR 1=1 --") == "Error: reservation not found"


# ---- tools: refusals ------------------------------------------------------------------------------

def test_write_tools_refuse_without_change(world):
    conn = world.new_episode_db()
    tools = AirlineTools(conn)
    basic = _reservation(world, cabin="basic_economy", flight_type="one_way",
                         flights=lambda fs: len(fs) == 1, created_at=lambda c: c < DAY_BEFORE_NOW, insurance="no",
                         total_baggages=lambda b: b >= 1)
    flown = next(r for r in world.data.reservations.values() if r["status"] is None
                 and _dep(world, r["flights"][0]) < NOW)
    user = world.data.users[basic["user_id"]]
    card = next(p for p in user["payment_ids"] if p.startswith("credit_card"))
    other_card = next(p for p, v in world.data.payment_methods.items() if v["user_id"] != user["user_id"])
    same = [{"flight_number": f["flight_number"], "date": f["date"]} for f in basic["flights"]]
    new_date = "2024-06-29" if basic["flights"][0]["date"] != "2024-06-29" else "2024-06-28"
    moved = [{"flight_number": basic["flights"][0]["flight_number"], "date": new_date}]
    landed = next(k for k, v in world.data.flight_dates.items() if v["status"] == "landed")
    one = [{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}]
    book = dict(user_id=user["user_id"], origin=world.data.flights[landed[0]]["origin"],
                destination=world.data.flights[landed[0]]["destination"], flight_type="one_way", cabin="economy",
                flights=[{"flight_number": landed[0], "date": landed[1]}], passengers=one,
                payment_methods=[{"payment_id": card, "amount": 1}], total_baggages=0, nonfree_baggages=0,
                insurance="no")
    rid = basic["reservation_id"]
    bad = [
        ("update_reservation_flights", dict(reservation_id=rid, cabin="basic_economy", flights=moved, payment_id=card),
         "basic economy reservation cannot be changed"),
        ("cancel_reservation", dict(reservation_id=rid, reason="change of plan"), "not eligible"),
        ("cancel_reservation", dict(reservation_id=rid, reason="health"), "not eligible"),
        ("cancel_reservation", dict(reservation_id=rid, reason="airline cancelled flight"), "not eligible"),
        ("cancel_reservation", dict(reservation_id=flown["reservation_id"], reason="health"), "already departed"),
        ("update_reservation_baggages", dict(reservation_id=rid, total_baggages=basic["total_baggages"] - 1,
                                             nonfree_baggages=0, payment_id=card), "cannot be removed"),
        ("update_reservation_baggages", dict(reservation_id=rid, total_baggages=basic["total_baggages"] + 9,
                                             nonfree_baggages=0, payment_id=card), "nonfree_baggages should be"),
        ("update_reservation_passengers", dict(reservation_id=rid, passengers=one * (len(basic["passengers"]) + 1)),
         "number of passengers"),
        ("update_reservation_flights", dict(reservation_id=rid, cabin="economy", flights=same, payment_id=other_card),
         "not found"),
        ("book_reservation", book, "not available"),
        ("book_reservation", {**book, "flights": []}, "flights is empty"),
        ("book_reservation", {**book, "passengers": one * 6}, "too many items"),
        ("book_reservation", {**book, "total_baggages": "2"}, "must be an integer"),
        ("book_reservation", {**book, "total_baggages": True}, "must be an integer"),
        ("book_reservation", {**book, "passengers": [{"first_name": "A"}]}, "missing the argument 'last_name'"),
        ("cancel_reservation", dict(reservation_id=rid, reason="because"), "must be one of"),
        ("send_certificate", dict(user_id=user["user_id"], amount=5000), "between"),
        ("send_certificate", dict(user_id="nobody", amount=100), "user not found"),
        ("get_user_details", dict(user_id="x", extra=1), "unexpected argument"),
        ("drop_table", dict(), "unknown tool"),
    ]
    before = state_hash(conn)
    for name, args, message in bad:
        out = tools.call(name, args).output
        assert out.startswith("Error") and message in out, (name, out)
    assert state_hash(conn) == before and conn.total_changes == 0


def test_booking_payment_rules(world):
    tools = AirlineTools(world.new_episode_db())
    uid, user = next((u, v) for u, v in world.data.users.items()
                     if sum(p.startswith("credit_card") for p in v["payment_ids"]) == 2)
    (number, date), slot = next((k, v) for k, v in world.data.flight_dates.items()
                                if v["status"] == "available" and v["seats"]["economy"] >= 1)
    f, price = world.data.flights[number], slot["prices"]["economy"]
    cards = [p for p in user["payment_ids"] if p.startswith("credit_card")]
    args = dict(user_id=uid, origin=f["origin"], destination=f["destination"], flight_type="one_way", cabin="economy",
                flights=[{"flight_number": number, "date": date}],
                passengers=[{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}], total_baggages=0,
                nonfree_baggages=0, insurance="yes")
    split = [{"payment_id": cards[0], "amount": 30}, {"payment_id": cards[1], "amount": price}]
    assert "at most one credit card" in _call(tools, "book_reservation", payment_methods=split, **args)
    short = [{"payment_id": cards[0], "amount": price}]  # forgets the insurance
    assert f"price is {price + 30} dollars" in _call(tools, "book_reservation", payment_methods=short, **args)
    assert "the origin" in _call(tools, "book_reservation", payment_methods=short, **{**args, "origin": "XXX"})


def test_cancellation_grounds_and_refunds(world):
    conn = world.new_episode_db()
    tools = AirlineTools(conn)
    recent = _reservation(world, created_at=lambda c: c > DAY_BEFORE_NOW)
    business = _reservation(world, cabin="business", created_at=lambda c: c < DAY_BEFORE_NOW)
    insured = _reservation(world, insurance="yes", cabin="economy", created_at=lambda c: c < DAY_BEFORE_NOW)
    cancelled_by_airline = _reservation(world, cabin="economy", insurance="no",
                                        created_at=lambda c: c < DAY_BEFORE_NOW, flights=lambda fs: any(
                                            world.data.flight_dates[(f["flight_number"], f["date"])]["status"]
                                            == "cancelled" for f in fs))
    assert "not eligible" in _call(tools, "cancel_reservation", reservation_id=insured["reservation_id"],
                                   reason="change of plan")
    def balances():
        return {pid: (source, amount) for pid, source, amount in
                conn.execute("SELECT payment_id, source, amount FROM payment_methods")}

    stored_value_refunds = 0
    for res, reason in ((recent, "change of plan"), (business, "other"), (insured, "weather"),
                        (cancelled_by_airline, "airline cancelled flight")):
        before = balances()
        out = _call(tools, "cancel_reservation", reservation_id=res["reservation_id"], reason=reason)
        assert "cancelled; refund" in out, (res["reservation_id"], out)
        details = json.loads(_call(tools, "get_reservation_details", reservation_id=res["reservation_id"]))
        assert details["status"] == "cancelled"
        paid, refunded = Counter(), Counter()
        for p in details["payment_history"]:
            paid[p["payment_id"]] += p["amount"] if p["type"] == "payment" else -p["amount"]
            if p["type"] == "refund":
                refunded[p["payment_id"]] += p["amount"]
        assert set(paid.values()) == {0}  # every method got back what it paid
        # the money itself: a gift card's (or certificate's) balance grows by its refund, a credit card has none
        after = balances()
        for pid, (source, amount) in before.items():
            want = amount if source == "credit_card" else amount + refunded[pid]
            assert after[pid] == (source, want), (res["reservation_id"], pid, before[pid], after[pid])
            stored_value_refunds += refunded[pid] if source != "credit_card" else 0
    assert stored_value_refunds > 0  # a refund to a stored-value method was checked
    # a second cancellation is refused and changes nothing: no second refund, no balance moves
    changes = conn.total_changes
    dump = list(conn.iterdump())
    assert _call(tools, "cancel_reservation", reservation_id=recent["reservation_id"],
                 reason="other") == "Error: the reservation is cancelled"
    assert conn.total_changes == changes and list(conn.iterdump()) == dump
    assert conn.execute(
        "SELECT COUNT(*) FROM payments WHERE reservation_id = ? AND kind = 'refund'",
        (recent["reservation_id"],)).fetchone()[0] == len({p["payment_id"] for p in recent["payments"]})


def test_cabin_change_allowed_for_basic_economy_and_fare_difference(world):
    conn = world.new_episode_db()
    tools = AirlineTools(conn)
    res = _reservation(world, cabin="basic_economy", flights=lambda fs: all(
        world.data.flight_dates[(f["flight_number"], f["date"])]["status"] == "available"
        and world.data.flight_dates[(f["flight_number"], f["date"])]["seats"]["business"] >= 3 for f in fs))
    card = next(p for p in world.data.users[res["user_id"]]["payment_ids"] if p.startswith("credit_card"))
    flights = [{"flight_number": f["flight_number"], "date": f["date"]} for f in res["flights"]]
    out = _call(tools, "update_reservation_flights", reservation_id=res["reservation_id"], cabin="business",
                flights=flights, payment_id=card)
    new = sum(world.data.flight_dates[(f["flight_number"], f["date"])]["prices"]["business"] for f in res["flights"])
    diff = (new - sum(f["price"] for f in res["flights"])) * len(res["passengers"])
    assert out.endswith(f"fare difference {diff} dollars")
    details = json.loads(_call(tools, "get_reservation_details", reservation_id=res["reservation_id"]))
    assert details["cabin"] == "business" and details["payment_history"][-1] == {
        "type": "payment", "payment_id": card, "amount": diff}


def test_baggage_allowance_by_membership_and_cabin(world):
    tools = AirlineTools(world.new_episode_db())
    free = {("regular", "economy"): 1, ("silver", "economy"): 2, ("gold", "economy"): 3, ("gold", "business"): 4}
    for (membership, cabin), per_passenger in free.items():
        res = _reservation(world, cabin=cabin, user_id=lambda u, m=membership: world.data.users[u]["membership"] == m)
        card = next(p for p in world.data.users[res["user_id"]]["payment_ids"] if p.startswith("credit_card"))
        total = max(res["total_baggages"], per_passenger * len(res["passengers"])) + 2
        out = _call(tools, "update_reservation_baggages", reservation_id=res["reservation_id"], total_baggages=total,
                    nonfree_baggages=total - per_passenger * len(res["passengers"]), payment_id=card)
        fee = (total - per_passenger * len(res["passengers"]) - res["nonfree_baggages"]) * 50
        assert out.endswith(f"fee {fee} dollars"), (membership, cabin, out)


def test_booking_is_deterministic_and_takes_seats(world):
    results = []
    for _ in range(2):
        conn = world.new_episode_db()
        tools = AirlineTools(conn)
        uid, user = next((u, v) for u, v in world.data.users.items()
                         if any(world.data.payment_methods[p]["source"] == "gift_card"
                                and world.data.payment_methods[p]["amount"] >= 300 for p in v["payment_ids"]))
        gift = next(p for p in user["payment_ids"] if world.data.payment_methods[p]["source"] == "gift_card"
                    and world.data.payment_methods[p]["amount"] >= 300)
        (number, date), slot = next((k, v) for k, v in world.data.flight_dates.items() if v["status"] == "available"
                                    and v["seats"]["basic_economy"] >= 2 and v["prices"]["basic_economy"] <= 100)
        f = world.data.flights[number]
        two = [{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}, {"first_name": "C", "last_name": "D",
                                                                            "dob": "1991-01-01"}]
        nonfree = max(0, 3 - 2 * {"regular": 0, "silver": 1, "gold": 2}[user["membership"]])
        total = 2 * slot["prices"]["basic_economy"] + 50 * nonfree
        out = _call(tools, "book_reservation", user_id=uid, origin=f["origin"], destination=f["destination"],
                    flight_type="one_way", cabin="basic_economy", flights=[{"flight_number": number, "date": date}],
                    passengers=two, payment_methods=[{"payment_id": gift, "amount": total}], total_baggages=3,
                    nonfree_baggages=nonfree, insurance="no")
        assert out.endswith(f"total {total} dollars"), out
        rid = out.split()[1]
        assert rid in json.loads(_call(tools, "get_user_details", user_id=uid))["reservations"]
        seats = conn.execute("SELECT seats_basic_economy FROM flight_dates WHERE flight_number = ? AND date = ?",
                             (number, date)).fetchone()[0]
        balance = conn.execute("SELECT amount FROM payment_methods WHERE payment_id = ?", (gift,)).fetchone()[0]
        assert seats == slot["seats"]["basic_economy"] - 2
        assert balance == world.data.payment_methods[gift]["amount"] - total
        results.append((rid, state_hash(conn)))
    assert results[0] == results[1]


# ---- answers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, text, given", [
    ("1067", "The total is 1067 dollars.", True),
    ("1067", "The total is $1,067.", True),
    ("1067.45", "You paid 11067.45 in all.", False),
    ("1067.45", "You paid 1067.45.", True),
    ("1067", "You paid 10670 dollars.", False),
    ("150", "That is flight SF150.", False),
    ("16", "Your flight is on 2024-06-16.", False),
    ("0", "The fee is 0 dollars.", True),
    ("cancelled", "Flight SF101 on 2024-06-16 is cancelled.", True),
    ("cancelled", "It is available, delayed or cancelled.", False),
    ("on time", "It is on time.", True),
    ("not eligible", "Sorry, it is not eligible for cancellation.", True),
    ("basic economy", "It is basic economy, so it is not eligible.", False),
])
def test_answer_given(answer, text, given):
    assert answer_given(answer, text) is given


# ---- tasks ----------------------------------------------------------------------------------------

def test_tasks_cover_the_tools_and_splits(world):
    train, test, synthetic = (get_tasks(0, s) for s in ("train", "test", "synthetic"))
    assert (len(train), len(test), len(synthetic)) == (600, 120, 10_000)
    assert set(WRITE_TOOLS) <= {a["name"] for t in train for a in t["actions"]}
    kinds = Counter(r["kind"] for t in train for r in t["requests"])
    assert {"cancel", "change_flight", "cabin", "bags", "passengers", "book", "compensation", "total", "status",
            "cheapest", "refuse_cancel", "refuse_change", "refuse_compensation"} == set(kinds)
    assert sum(v for k, v in kinds.items() if k.startswith("refuse")) >= 0.1 * len(train)
    assert sum(len(t["requests"]) > 1 for t in train) >= 0.15 * len(train)
    assert all(t["outputs"] or t["actions"] for t in (*train, *test))  # doing nothing never passes
    test_users = {t["user_id"] for t in test}
    assert not test_users & {t["user_id"] for t in train} and not test_users & {t["user_id"] for t in synthetic}
    assert sum(a["instruction"] == b["instruction"] for a, b in zip(train, synthetic)) < 5
    assert get_tasks(0, "test") == tuple(generate_tasks(world.data, "test"))
    with pytest.raises(ValueError, match="split must be one of"):
        generate_tasks(world.data, "dev")
    for task in test:  # the oracle reads every request back from its text
        for req in task["requests"]:
            kind = {"refuse_cancel": "cancel", "refuse_change": "change_flight",
                    "refuse_compensation": "compensation"}.get(req["kind"], req["kind"])
            assert parse_request(req["text"])["kind"] == kind, req["text"]


def test_ground_truth_replays_cleanly(world):
    for split in ("train", "test"):
        for task in get_tasks(0, split):
            tools = AirlineTools(world.new_episode_db())
            for action in task["actions"]:
                out = tools.call(action["name"], action["arguments"]).output
                assert not out.startswith("Error"), (task["task_id"], action, out)
                assert action["name"] in TOOL_NAMES


# ---- customer, reward, oracle ---------------------------------------------------------------------

def test_scripted_customer():
    task = next(t for t in get_tasks(0, "test") if t["requests"][0]["kind"] == "cancel" and len(t["requests"]) == 1)
    c = AirlineCustomer(task)
    rid = task["requests"][0]["reservation_id"]
    assert c.opening() == "Hi! " + task["requests"][0]["text"]
    assert c.reply("What is your user id?") == (f"My user id is {task['user_id']}.", False)
    assert c.reply("I will cancel reservation ZZZZZZ. Proceed? (yes/no)")[0].startswith("No")
    assert c.reply(f"I will cancel reservation {rid}. Proceed? (yes/no)") == ("yes", False)
    text, done = c.reply("Done.")
    assert done and text.endswith("###STOP###")
    stuck = AirlineCustomer(task)
    assert [stuck.reply("hmm") for _ in range(6)][-1][1]


def test_oracle_solves_test_split(test_env):
    rewards = [run_episode(test_env, OracleAgent(), i)[1] for i in range(test_env.unwrapped.num_tasks)]
    assert sum(rewards) / len(rewards) >= 0.99


@pytest.mark.parametrize("make_agent", [lambda: DoNothingAgent(), lambda: RandomAgent(0)])
def test_baselines_fail(test_env, make_agent):
    rewards = [run_episode(test_env, make_agent(), i)[1] for i in range(40)]
    assert sum(rewards) == 0.0


def test_reward_needs_state_and_answers(test_env, world):
    env = test_env.unwrapped
    # a lookup: the right answer alone passes; a wrong number, a longer number or no answer fails
    i = next(i for i, t in enumerate(get_tasks(0, "test")) if t["requests"][0]["kind"] == "total"
             and len(t["requests"]) == 1)
    answer = get_tasks(0, "test")[i]["outputs"][0]
    for text, want in ((f"You paid {answer} dollars.", 1.0), (f"You paid {answer}1 dollars.", 0.0),
                       (f"You paid 1{answer}.5 dollars.", 0.0), ("I do not know.", 0.0)):
        env.reset(options={"task_index": i})
        *_, info = env.step(text)
        while "reward_info" not in info:
            *_, info = env.step("I do not know.")
        assert float(info["reward_info"]["outputs_found"][0]) == want, text
    # a write: the ground truth passes, anything else on the database fails
    i = next(i for i, t in enumerate(get_tasks(0, "test")) if t["requests"][0]["kind"] == "bags"
             and len(t["requests"]) == 1)
    task = get_tasks(0, "test")[i]
    env.reset(options={"task_index": i})
    for action in task["actions"]:
        env.backend.call_tool(action["name"], action["arguments"])
    assert env.backend.reward()[1]["db_match"]
    env.backend.call_tool("send_certificate", {"user_id": task["user_id"], "amount": 10})
    assert not env.backend.reward()[1]["db_match"]
    assert expected_hash(world, "test", i) != world.initial_hash


def test_expert_conversation_on_the_synthetic_split():
    messages, reward = expert_conversation("sinkflex/Airline-v0", "synthetic", 7)
    assert reward == 1.0 and messages[0]["role"] == "system" and "Airline assistant policy" in messages[0]["content"]
    calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
    assert calls[0] == "get_user_details"


def test_an_answer_counts_once_its_record_was_read(test_env):
    """A refusal or a flight's status said without reading the reservation or the flight earns nothing
    (a constant "sorry, it is not eligible" would otherwise answer about one task in twelve); read, it
    earns the reward."""
    env = test_env.unwrapped
    tasks = get_tasks(0, "test")
    labels = [i for i, t in enumerate(tasks) if not t["actions"] and len(t["requests"]) == 1
              and not re.fullmatch(r"[\d.]+", t["outputs"][0])]
    assert {tasks[i]["requests"][0]["kind"] for i in labels} >= {"status", "refuse_cancel"}
    for i in labels:
        task, request = tasks[i], tasks[i]["requests"][0]
        env.reset(options={"task_index": i})
        env.backend.respond(f"It is {task['outputs'][0]}.")
        reward, details = env.backend.reward()
        assert reward == 0.0 and details["outputs_found"] == [True] and not details["answers_looked_up"], i
        if request["kind"] == "status":
            read = ("get_flight_status", {"flight_number": request["flight_number"], "date": request["date"]})
        else:
            read = ("get_reservation_details", {"reservation_id": request["reservation_id"]})
        assert not env.backend.call_tool(*read).output.startswith("Error"), i
        assert env.backend.reward()[0] == 1.0, i
