"""Bad input never crashes an environment nor changes its database; the HTTP server rejects malformed
requests; the environments run under gymnasium's async vector env."""

from __future__ import annotations

import http.client
import json
import socket

import gymnasium as gym
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vector_envs import assert_workers_replay_single_envs

import sinkflex_core  # noqa: F401
from sinkflex_core.envs import TOOL_NAMES, RetailWorld, format_tool_call
from sinkflex_core.envs.bank import TOOL_SCHEMAS as BANK_TOOLS
from sinkflex_core.envs.http_server import post_raw

WORLD = RetailWorld.get(0)
IDS = (list(WORLD.data.orders)[:20] + list(WORLD.data.users)[:10] + list(WORLD.data.variants)[:20]
       + list(WORLD.data.payment_methods)[:10] + [u["email"] for u in list(WORLD.data.users.values())[:5]])
NASTY = ["'; DROP TABLE orders; --", "#W1' OR '1'='1", "\x00", "NULL", "' UNION SELECT * FROM users --",
         "SELECT * FROM users", "DELETE FROM payments", "PRAGMA writable_schema = 1", "🙂" * 50, "A" * 5000,
         "\\u0000", "{{}}", "<tool_call>", "</tool_call>", "###STOP###", "yes", "no longer needed"]
ARG_NAMES = ["order_id", "user_id", "item_ids", "new_item_ids", "payment_method_id", "reason", "email", "zip",
             "first_name", "last_name", "address1", "query", "expression", "thought", "summary", "product_id", "x"]

strings = st.one_of(st.sampled_from(IDS), st.sampled_from(NASTY), st.text(max_size=30))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), strings),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
arguments = st.dictionaries(st.sampled_from(ARG_NAMES), st.one_of(strings, st.lists(strings, max_size=3), json_values),
                            max_size=5)
tool_names = st.one_of(st.sampled_from(TOOL_NAMES + [t["function"]["name"] for t in BANK_TOOLS]), st.text(max_size=20))


@st.composite
def actions(draw):
    kind = draw(st.integers(0, 7))
    name, args = draw(tool_names), draw(arguments)
    if kind <= 2:  # a well-formed call, often to a real tool with plausible arguments
        return format_tool_call(name, args)
    if kind == 3:  # a bare JSON call
        return json.dumps({"name": name, "arguments": args})
    if kind == 4:  # malformed JSON or markup
        body = format_tool_call(name, args)
        cut = draw(st.integers(0, len(body)))
        return draw(st.sampled_from([body[:cut], body[:cut] + body[cut + 1:], body + body, "<tool_call></tool_call>",
                                     "<tool_call>{\"name\": 5}</tool_call>", "{\"name\": \"x\", \"arguments\": 3}"]))
    if kind == 5:  # huge
        return draw(st.sampled_from(["x" * 70_000, format_tool_call("think", {"thought": "y" * 60_000}),
                                     format_tool_call("get_order_details", {"order_id": "#W" * 3_000})]))
    return draw(st.one_of(st.text(max_size=200), st.sampled_from(NASTY)))  # plain text to the customer


def _fuzz(env, acts, task_index, counter):
    backend = env.unwrapped.backend
    env.reset(seed=task_index, options={"task_index": task_index % env.unwrapped.num_tasks})
    conn = backend.conn
    for action in acts:
        before = conn.total_changes
        hash_before = backend.state_hash() if counter["n"] % 25 == 0 else None
        obs, reward, terminated, truncated, info = env.step(action)
        counter["n"] += 1
        assert isinstance(obs, str) and isinstance(reward, float) and 0.0 <= reward <= 1.0
        assert info["obs_role"] in ("user", "tool")
        if info["obs_role"] == "tool" and obs.startswith("Error"):
            assert conn.total_changes == before, (action[:200], obs)  # a refused call writes nothing
            if hash_before is not None:
                assert backend.state_hash() == hash_before
        if terminated or truncated:
            obs, *_ = env.step(action)
            assert obs.startswith("Error: the episode has ended")
            env.reset(options={"task_index": task_index % env.unwrapped.num_tasks})
            conn = backend.conn
    assert backend.integrity_check() == "ok"


FUZZ = settings(max_examples=130, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


@pytest.fixture(scope="module", params=["sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/BankSQL-v0"])
def fuzz_env(request):
    env = gym.make(request.param, split="train", max_turns=40)
    counter = {"n": 0}
    yield env, counter
    env.close()
    assert counter["n"] >= 1000, counter  # at least 1,000 hostile actions per environment


@pytest.mark.slow
@FUZZ
@given(acts=st.lists(actions(), min_size=8, max_size=12), task_index=st.integers(0, 599))
def test_fuzz_actions(fuzz_env, acts, task_index):
    env, counter = fuzz_env
    _fuzz(env, acts, task_index, counter)


def test_bank_database_never_changes():
    env = gym.make("sinkflex/BankSQL-v0")
    backend = env.unwrapped.backend
    before = backend.state_hash()
    env.reset(options={"task_index": 0})
    for sql in ["DELETE FROM customers", "UPDATE accounts SET balance_cents = 0", "DROP TABLE loans",
                "INSERT INTO branches VALUES (99, 'x', 'y')", "SELECT 1; DELETE FROM loans", "PRAGMA query_only = OFF",
                "ATTACH DATABASE ':memory:' AS other", "CREATE TABLE t (x)", "VACUUM", "REINDEX",
                "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c",
                "SELECT zeroblob(100000000)"]:
        obs, *_ = env.step(format_tool_call("run_sql", {"query": sql}))
        assert obs.startswith("Error"), (sql, obs)
    assert backend.state_hash() == before and backend.integrity_check() == "ok"
    env.close()


# ---- HTTP server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def http_env():
    env = gym.make("sinkflex/RetailHTTP-v0", split="test")
    env.reset(options={"task_index": 0})
    yield env
    env.close()


def test_http_binds_loopback_only(http_env):
    host, port = http_env.unwrapped.backend.server.server_address[:2]
    assert host == "127.0.0.1" and port > 0


def test_http_status_codes(http_env):
    url = http_env.unwrapped.backend.url
    order = next(iter(WORLD.data.orders))
    json_h = {"Content-Type": "application/json"}
    ok, body = post_raw(f"{url}/tools/get_order_details", json.dumps({"arguments": {"order_id": order}}).encode(), json_h)
    assert ok == 200 and json.loads(body["output"])["order_id"] == order
    cases = [
        (f"{url}/tools/get_order_details", b"{not json", json_h, "POST", 400),
        (f"{url}/tools/get_order_details", b"[1, 2]", json_h, "POST", 400),
        (f"{url}/tools/get_order_details", b"\xff\xfe", json_h, "POST", 400),
        (f"{url}/tools/get_order_details", json.dumps({"arguments": [1]}).encode(), json_h, "POST", 400),
        (f"{url}/tools/get_order_details", json.dumps({"arguments": {"order_id": "#W1"}, "extra": 1}).encode(),
         json_h, "POST", 400),  # the OpenAPI request model forbids other keys
        (f"{url}/tools/no_such_tool", json.dumps({"arguments": {}}).encode(), json_h, "POST", 404),
        (f"{url}/elsewhere", b"{}", json_h, "POST", 404),
        (f"{url}/tools/get_order_details", json.dumps({"arguments": {"order_id": 5}}).encode(), json_h, "POST", 422),
        (f"{url}/tools/get_order_details", json.dumps({"arguments": {}}).encode(), json_h, "POST", 422),
        (f"{url}/tools/get_order_details", b"{}", {"Content-Type": "text/plain"}, "POST", 415),
        (f"{url}/tools/get_order_details", b"x" * 70_000, json_h, "POST", 413),
        (f"{url}/tools/get_order_details", b"{}", json_h, "PUT", 405),
        (f"{url}/nothing", None, {}, "GET", 404),
    ]
    for target, data, headers, method, code in cases:
        status, body = post_raw(target, data, headers, method)
        assert status == code and "error" in body, (target, data, status, body)
    # no Content-Length at all
    host, port = http_env.unwrapped.backend.server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"POST /tools/think HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n")
        assert s.recv(200).split(b" ")[1] == b"411"
    # garbage instead of HTTP, unknown methods, bad versions: a status line and a JSON error all the same
    for raw, code in [(b"\x16\x03\x01 garbage\r\n\r\n", b"400"), (b"BREW /tools HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
                      (b"GET /tools HTTP/9.9\r\n\r\n", b"400"), (b"GET\r\n\r\n", b"400"),
                      (b"GET /tools HTTP/1.1\r\n\r\n", b"400"), (b"GET /tools HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),
                      (b"GET /tools HTTP/2.0\r\nHost: x\r\n\r\n", b"400")]:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(raw)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert reply.startswith(b"HTTP/1.") and reply.split(b" ")[1] == code, (raw, reply)
            assert "error" in json.loads(body), (raw, reply)
    # JSON nested deeper than the parser's recursion limit, and a string that is no valid Unicode
    deep = b'{"arguments": {"thought": ' + b"[" * 3000 + b"]" * 3000 + b"}}"
    assert post_raw(f"{url}/tools/think", deep, json_h)[0] == 400
    lone = b'{"arguments": {"email": "a\\ud800@x.com"}}'
    status, body = post_raw(f"{url}/tools/find_user_id_by_email", lone, json_h)
    assert status == 422 and "Unicode" in body["error"]
    # the server is still serving after all of that
    assert post_raw(f"{url}/tools/list_all_product_types", b"{}", json_h)[0] == 200


def _call_text(tool: str, arguments_json: str) -> str:
    """A tool call whose arguments are given as raw JSON text (escapes and nesting kept as written)."""
    return '<tool_call>\n{"name": "' + tool + '", "arguments": ' + arguments_json + '}\n</tool_call>'


@pytest.mark.parametrize("env_id", ["sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/BankSQL-v0"])
def test_deep_json_and_lone_surrogates_are_errors_not_crashes(env_id):
    env = gym.make(env_id, split="train")
    env.reset(options={"task_index": 0})
    before = env.unwrapped.backend.state_hash()
    tool = "run_sql" if "Bank" in env_id else "find_user_id_by_email"
    key = "query" if "Bank" in env_id else "email"
    actions = {
        '<tool_call>\n{"name": "think", "arguments": {"thought": ' + "[" * 3000 + "]" * 3000 + '}}\n</tool_call>':
            "nested too deeply",
        _call_text(tool, '{"' + key + '": "a\\ud800@x.com"}'):
            "not valid Unicode",
        _call_text(tool, json.dumps(json.dumps({key: 0}).replace("0", "[" * 3000 + "]" * 3000))):
            "nested too deeply",
    }
    try:
        for action, message in actions.items():
            obs, reward, terminated, truncated, info = env.step(action)
            assert obs.startswith("Error") and message in obs, obs[:200]
        assert env.unwrapped.backend.state_hash() == before
    finally:
        env.close()


def test_a_bad_make_of_the_http_env_leaves_no_server_behind():
    import threading

    before = {t.ident for t in threading.enumerate()}
    for bad, message in (({"split": "bogus"}, "split must be one of"), ({"max_turns": 0}, "max_turns must be")):
        with pytest.raises(ValueError, match=message):
            gym.make("sinkflex/RetailHTTP-v0", **bad)
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []


def test_closing_the_bank_env_closes_its_database_copy():
    import sqlite3

    env = gym.make("sinkflex/BankSQL-v0", split="train")
    env.reset(options={"task_index": 0})
    conn = env.unwrapped.backend.conn
    env.close()
    with pytest.raises(sqlite3.ProgrammingError):
        conn.execute("SELECT 1")
    env.close()  # twice is harmless


def test_http_matches_in_process():
    local = gym.make("sinkflex/Retail-v0", split="test")
    remote = gym.make("sinkflex/RetailHTTP-v0", split="test")
    order = next(iter(WORLD.data.orders))
    calls = [format_tool_call("get_order_details", {"order_id": order}), format_tool_call("nope", {}),
             format_tool_call("get_order_details", {"order_id": 3}), "<tool_call>{bad</tool_call>",
             format_tool_call("cancel_pending_order", {"order_id": order, "reason": "no longer needed"})]
    for env in (local, remote):
        env.reset(options={"task_index": 3})
    for action in calls:
        assert local.step(action)[0] == remote.step(action)[0]
    url = remote.unwrapped.backend.url
    remote.close()
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(OSError):
        http.client.HTTPConnection(host, int(port), timeout=2).request("GET", "/tools")
    local.close()


# ---- vector envs ----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/BankSQL-v0"])
def test_make_vec_async(env_id):
    assert_workers_replay_single_envs(env_id, 8, "Please tell me your email.")
