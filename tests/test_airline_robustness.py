"""The airline under bad input (thousands of random and adversarial actions, in process and over
HTTP), behind gymnasium's checker and async vector env, and found by env id by the training tools."""

from __future__ import annotations

import json
import random
import threading

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env
from vector_envs import assert_workers_replay_single_envs

import sinkflex_core  # noqa: F401
from sinkflex_core.envs import AIRLINE_ENV_IDS, format_tool_call
from sinkflex_core.envs.airline_schemas import TOOL_NAMES, TOOL_SCHEMAS, WRITE_TOOLS
from sinkflex_core.envs.airline_tasks import get_tasks
from sinkflex_core.envs.airline_world import CABINS, DATES, AirlineWorld
from sinkflex_core.envs.http_server import post_raw
from sinkflex_core.envs.retail_tools import TOOL_SCHEMAS as RETAIL_TOOLS
from sinkflex_core.envs.worlds import world_of

WORLD = AirlineWorld.get(0)
WORLD_TASKS = get_tasks(0, "train")
NASTY = ["'; DROP TABLE reservations; --", "' OR '1'='1", "\x00", "NULL", "🙂" * 40, "A" * 3000, "<tool_call>",
         "###STOP###", "yes", "(yes/no)", "-1", "1e309", "SF", "2024-13-45", "../../etc/passwd"]


class _Actions:
    """A seeded stream of agent turns: plausible tool calls (with real ids, so that some writes go
    through), wrong types, unknown names, malformed or huge payloads, and messages to the customer."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        d = WORLD.data
        self.ids = {"reservation_id": list(d.reservations)[:60], "user_id": list(d.users)[:40],
                    "payment_id": list(d.payment_methods)[:60], "flight_number": list(d.flights)[:60],
                    "date": DATES, "origin": ["JFK", "LAX", "SEA", "ORD", "XXX"], "cabin": list(CABINS)}
        self.ids["destination"] = self.ids["origin"]

    def _string(self, key: str):
        rng = self.rng
        if key in self.ids and rng.random() < 0.85:
            return rng.choice(self.ids[key])
        return rng.choice(NASTY + ["", "x", "economy", "health", "one_way", "yes"])

    def _value(self, key: str, spec: dict):
        rng = self.rng
        roll = rng.random()
        if roll < 0.06:  # a wrong type
            return rng.choice([None, True, 3.5, -7, [], {}, "7", [1, 2], {"a": "b"}])
        kind = spec["type"]
        if kind == "integer":
            return rng.choice([0, 1, 2, 3, 5, 50, 100, 200, -1, 10**6])
        if kind == "array":
            return [self._value(key, spec["items"]) for _ in range(rng.choice([0, 1, 1, 2, 3, 7]))]
        if kind == "object":
            return {k: self._value(k, v) for k, v in spec["properties"].items() if rng.random() < 0.95}
        if "enum" in spec and rng.random() < 0.9:
            return rng.choice(spec["enum"])
        return self._string(key)

    def __call__(self) -> str:
        rng = self.rng
        kind = rng.random()
        if kind < 0.6:
            tool = rng.choice(TOOL_SCHEMAS)["function"]
            if tool["name"] == "transfer_to_human_agents" and rng.random() < 0.8:
                tool = rng.choice(TOOL_SCHEMAS)["function"]
            args = {k: self._value(k, v) for k, v in tool["parameters"]["properties"].items() if rng.random() < 0.95}
            if rng.random() < 0.05:
                args[rng.choice(["zzz", "user_id", "amount"])] = rng.choice(NASTY)
            return format_tool_call(tool["name"], args)
        if kind < 0.68:
            return format_tool_call(rng.choice(["run_sql", "", "get_order_details", "x" * 200, "__init__", "call",
                                                "_reservation", "conn"]), {"q": 1})
        if kind < 0.78:
            body = format_tool_call(rng.choice(TOOL_NAMES), {"reservation_id": "ABC"})
            cut = rng.randrange(len(body))
            return rng.choice([body[:cut], body[:cut] + body[cut + 1:], body + body, "<tool_call>[1]</tool_call>",
                               '{"name": "think", "arguments": 3}', "<tool_call>" + "[" * 3000 + "</tool_call>"])
        if kind < 0.8:
            return rng.choice(["x" * 70_000, format_tool_call("think", {"thought": "y" * 60_000})])
        return rng.choice(NASTY + ["Please tell me your user id.", "I will cancel it. Proceed? (yes/no)", "Done."])


def _invariants(conn) -> None:
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT COUNT(*) FROM payment_methods WHERE amount < 0").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM flight_dates WHERE min(seats_basic_economy, seats_economy, "
                        "seats_business) < 0").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM reservation_flights r LEFT JOIN flight_dates d USING "
                        "(flight_number, date) WHERE d.status IS NULL").fetchone()[0] == 0


@pytest.mark.parametrize("env_id", AIRLINE_ENV_IDS)
def test_thousands_of_random_actions(env_id):
    """2,000 turns per environment: no exception escapes, a refused call writes nothing, the database
    stays whole and consistent, and some random writes do go through (the stream reaches them)."""
    env = gym.make(env_id, split="train", max_turns=40)
    backend = env.unwrapped.backend
    make = _Actions(0 if "HTTP" in env_id else 1)
    done_writes, episodes = 0, 1
    env.reset(seed=0, options={"task_index": 0})
    try:
        for n in range(2_000):
            action = make()
            before = backend.conn.total_changes
            obs, reward, terminated, truncated, info = env.step(action)
            assert isinstance(obs, str) and isinstance(reward, float) and 0.0 <= reward <= 1.0
            if info["obs_role"] == "tool" and obs.startswith("Error"):
                assert backend.conn.total_changes == before, (action[:300], obs)
            elif info.get("action_kind") == "tool" and any(f'"name": "{w}"' in action for w in WRITE_TOOLS):
                done_writes += backend.conn.total_changes > before
            if terminated or truncated:
                _invariants(backend.conn)
                assert env.step("hello")[0].startswith("Error: the episode has ended")
                env.reset(options={"task_index": (n * 7) % env.unwrapped.num_tasks})
                episodes += 1
        _invariants(backend.conn)
    finally:
        env.close()
    assert done_writes >= 5 and episodes >= 20, (done_writes, episodes)


# ---- HTTP -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_env():
    env = gym.make("sinkflex/AirlineHTTP-v0", split="test")
    env.reset(options={"task_index": 0})
    yield env
    env.close()


def test_http_serves_the_airline_tools(http_env):
    url = http_env.unwrapped.backend.url
    with __import__("urllib.request").request.urlopen(f"{url}/tools", timeout=10) as resp:
        assert json.loads(resp.read())["tools"] == TOOL_SCHEMAS
    json_h = {"Content-Type": "application/json"}
    rid = next(iter(WORLD.data.reservations))
    status, body = post_raw(f"{url}/tools/get_reservation_details", json.dumps({"arguments": {"reservation_id": rid}})
                            .encode(), json_h)
    assert status == 200 and json.loads(body["output"])["reservation_id"] == rid
    for tool, args, code in [("get_reservation_details", {"reservation_id": 5}, 422),
                             ("book_reservation", {"user_id": "x"}, 422),
                             ("get_order_details", {"order_id": "#W1"}, 404),  # a retail tool is unknown here
                             ("no_such_tool", {}, 404)]:
        status, body = post_raw(f"{url}/tools/{tool}", json.dumps({"arguments": args}).encode(), json_h)
        assert status == code and "error" in body, (tool, status, body)
    assert post_raw(f"{url}/tools/get_reservation_details", b"{not json", json_h)[0] == 400


def test_http_retail_server_still_serves_retail_tools():
    env = gym.make("sinkflex/RetailHTTP-v0", split="test")
    try:
        env.reset(options={"task_index": 0})
        url = env.unwrapped.backend.url
        with __import__("urllib.request").request.urlopen(f"{url}/tools", timeout=10) as resp:
            assert json.loads(resp.read())["tools"] == RETAIL_TOOLS
        assert post_raw(f"{url}/tools/search_direct_flight", b'{"arguments": {}}',
                        {"Content-Type": "application/json"})[0] == 404
    finally:
        env.close()


def test_http_matches_in_process():
    local = gym.make("sinkflex/Airline-v0", split="test")
    remote = gym.make("sinkflex/AirlineHTTP-v0", split="test")
    rid = next(iter(WORLD.data.reservations))
    calls = [format_tool_call("get_reservation_details", {"reservation_id": rid}), format_tool_call("nope", {}),
             format_tool_call("get_reservation_details", {"reservation_id": 3}), "<tool_call>{bad</tool_call>",
             format_tool_call("cancel_reservation", {"reservation_id": rid, "reason": "other"}),
             format_tool_call("search_onestop_flight", {"origin": "JFK", "destination": "SEA", "date": "2024-06-20"})]
    try:
        for env in (local, remote):
            env.reset(options={"task_index": 3})
        for action in calls:
            assert local.step(action)[0] == remote.step(action)[0]
        assert local.unwrapped.backend.state_hash() == remote.unwrapped.backend.state_hash()
    finally:
        local.close()
        remote.close()


def test_the_http_server_accepts_the_calls_whose_arguments_are_lists_of_objects():
    # booking and rewriting passengers send arrays of objects; the server checks them with the same
    # checker as the backend, so the oracle's episode over HTTP is the in-process one, reward included
    from sinkflex_core.envs.oracle import OracleAgent, run_episode

    task_index = next(i for i, task in enumerate(WORLD_TASKS) if any(
        isinstance(v, list) and v and isinstance(v[0], dict) for a in task["actions"] for v in a["arguments"].values()))
    local = gym.make("sinkflex/Airline-v0", split="train")
    remote = gym.make("sinkflex/AirlineHTTP-v0", split="train")
    try:
        here, reward_here, _ = run_episode(local, OracleAgent(), task_index)
        there, reward_there, _ = run_episode(remote, OracleAgent(), task_index)
        assert reward_here == 1.0 and reward_there == 1.0
        assert there == here
    finally:
        local.close()
        remote.close()


def test_a_bad_make_of_the_http_env_leaves_no_server_behind():
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="split must be one of"):
        gym.make("sinkflex/AirlineHTTP-v0", split="bogus")
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []


# ---- gymnasium ------------------------------------------------------------------------------------

@pytest.mark.parametrize("env_id", AIRLINE_ENV_IDS)
def test_check_env_and_make_vec_async(env_id):
    env = gym.make(env_id, split="train")
    check_env(env.unwrapped)
    env.close()
    obs = assert_workers_replay_single_envs(env_id, 4, "Please tell me your user id.")
    assert any(o.startswith("My user id is") for o in obs)


# ---- found by env id ------------------------------------------------------------------------------

def test_the_training_tools_find_the_world_by_env_id():
    from sinkflex_core import train

    assert world_of("sinkflex/AirlineHTTP-v0").name == "airline" and world_of("sinkflex/Retail-v0").name == "retail"
    with pytest.raises(ValueError, match="no task world"):
        world_of("sinkflex/BankSQL-v0")
    tasks = world_of("sinkflex/Airline-v0").get_tasks("test")
    kinds = train.task_kinds("test", list(range(10)), "sinkflex/Airline-v0")
    assert kinds == ["+".join(sorted({a["name"] for a in t["actions"]})) or "read only" for t in tasks[:10]]
    assert set(kinds) <= set(WRITE_TOOLS) | {"read only"} | {k for k in kinds if "+" in k}
    from sinkflex_core.envs import airline, retail

    assert airline.REWARD_VERSION != retail.REWARD_VERSION  # each env id finds its own world's version
    assert train.reward_version("sinkflex/Airline-v0") == airline.REWARD_VERSION
    assert train.reward_version() == train.reward_version("sinkflex/RetailHTTP-v0") == retail.REWARD_VERSION


def test_oracle_rollouts_through_the_generation_interface():
    """The path of SFT data and pass@k: the oracle behind AgentBackend, rolled out by env id."""
    from sinkflex_core import train
    from sinkflex_core.envs.oracle import DoNothingAgent
    from sinkflex_core.models import get_tokenizer
    from sinkflex_core.rollout import AgentBackend

    tokenizer = get_tokenizer()
    tasks = [0, 1, 2]
    solved = train.success_counts(AgentBackend(tokenizer), tokenizer, "test", tasks, samples=1, tasks_per_call=3,
                                   progress=False, env_id="sinkflex/Airline-v0")
    assert solved == [1, 1, 1]
    idle = train.success_counts(AgentBackend(tokenizer, DoNothingAgent), tokenizer, "test", tasks, samples=1,
                                 tasks_per_call=3, progress=False, env_id="sinkflex/Airline-v0")
    assert idle == [0, 0, 0]


def test_pass_at_k_script_takes_the_env_id(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    import pandas as pd

    from sinkflex_core.models import build_model, get_tokenizer, tiny_qwen2_config

    spec = importlib.util.spec_from_file_location(
        "pass_at_k_script", Path(__file__).resolve().parents[1] / "benchmarks" / "pass_at_k.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokenizer = get_tokenizer()
    policy = tmp_path / "policy"
    build_model(tiny_qwen2_config(len(tokenizer), hidden_size=32, num_layers=1, tokenizer=tokenizer)).save_pretrained(
        policy)
    tokenizer.save_pretrained(policy)
    out = tmp_path / "counts.csv"
    assert script.main(["--policy", str(policy), "--env-id", "sinkflex/Airline-v0", "--tasks", "2", "--samples", "1",
                        "--out", str(out), "--no-progress"]) == 0
    table = pd.read_csv(out)
    tasks = world_of("sinkflex/Airline-v0").get_tasks("test")
    assert list(table["kind"]) == ["+".join(sorted({a["name"] for a in t["actions"]})) or "read only"
                                   for t in tasks[:2]]
    from sinkflex_core.envs.airline import REWARD_VERSION

    assert set(table["reward_version"]) == {REWARD_VERSION} and "2 test tasks x 1 episodes" in capsys.readouterr().out
