"""Inputs at and past the environments' limits: every one ends as an observation (or a JSON answer
of the HTTP server), never as an exception out of ``step()``; the bank's queries stop at a deadline
and at size caps; answers count only as whole numbers."""

from __future__ import annotations

import json
import select
import socket
import time

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import ENV_IDS, format_tool_call, get_tasks
from sinkflex_core.envs import bank as bank_module
from sinkflex_core.envs.bank import (
    MAX_RESULT_BYTES,
    MAX_ROWS_GRADED,
    MAX_VALUE_BYTES,
    QUERY_SECONDS,
    bank_tasks,
    printf_widths,
)
from sinkflex_core.envs.http_server import _result_from_answer, post_raw
from sinkflex_core.envs.retail_tasks import answer_given, mentions

HUGE_INT = "9" * 5000  # past Python's int-to-string limit (4,300 digits)


@pytest.fixture(params=ENV_IDS)
def env(request):
    env = gym.make(request.param, split="train", max_turns=50)
    env.reset(options={"task_index": 0})
    yield env
    env.close()


def test_an_integer_too_long_to_read_is_an_observation(env):
    tool = "run_sql" if "Bank" in env.spec.id else "think"
    texts = [
        '<tool_call>\n{"name": "' + tool + '", "arguments": {"x": ' + HUGE_INT + '}}\n</tool_call>',
        '<tool_call>\n{"name": "' + tool + '", "arguments": "{\\"x\\": ' + HUGE_INT + '}"}\n</tool_call>',
    ]
    for text in texts:
        obs, reward, terminated, truncated, info = env.step(text)
        assert obs.startswith("Error") and "cannot be read" in obs and "digits" in obs, obs[:300]
        assert info["obs_role"] == "tool"
    # a bare JSON object with such a number is no tool call: it goes to the customer as text
    obs, *_ , info = env.step('{"name": "' + tool + '", "arguments": {"x": ' + HUGE_INT + '}}')
    assert info["action_kind"] == "message"
    assert env.unwrapped.backend.integrity_check() == "ok"


def test_the_server_answers_an_unreadable_integer_with_400_json():
    env = gym.make("sinkflex/RetailHTTP-v0", split="train")
    try:
        env.reset(options={"task_index": 0})
        url = env.unwrapped.backend.url
        body = b'{"arguments": {"thought": ' + HUGE_INT.encode() + b"}}"
        status, payload = post_raw(f"{url}/tools/think", body, {"Content-Type": "application/json"})
        assert status == 400 and "error" in payload
        status, payload = post_raw(f"{url}/tools/think", b'{"arguments": {"thought": "x"}}',
                                   {"Content-Type": "application/json"})
        assert status == 200 and payload["output"] == "ok"  # the server is still serving
    finally:
        env.close()


def test_a_huge_non_ascii_tool_name_is_an_observation(env):
    """12,000 non-ASCII characters make a URL over 64 KiB: the name is refused before any request,
    with the same observation the in-process environments give."""
    name = "é" * 12_000
    text = '<tool_call>\n{"name": "' + name + '", "arguments": {}}\n</tool_call>'
    backend = env.unwrapped.backend
    log = getattr(getattr(backend, "server", None), "request_log", None)
    before = None if log is None else len(log)
    obs, reward, terminated, truncated, info = env.step(text)
    assert obs == "Error: unknown tool '" + "é" * 60 + "...'", obs[:200]
    if log is not None:
        assert len(log) == before  # nothing was sent


def test_every_answer_of_the_server_is_json():
    env = gym.make("sinkflex/RetailHTTP-v0", split="train")
    try:
        host, port = env.unwrapped.backend.server.server_address[:2]
        raws = [b"GET /" + b"x" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line too long: 431
                b"POST /tools/" + "é".encode() * 40_000 + b" HTTP/1.1\r\n\r\n",
                b"\x16\x03\x01 garbage\r\n\r\n", b"BREW /tools HTTP/1.1\r\n\r\n", b"GET /tools HTTP/9.9\r\n\r\n",
                b"GET\r\n\r\n", b"GET /tools HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n"]
        for raw in raws:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(raw)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            status = int(head.split(b" ")[1])
            assert 400 <= status < 500 and b"application/json" in head, (raw[:40], reply[:300])
            assert "error" in json.loads(body), (raw[:40], reply[:300])
    finally:
        env.close()


def test_an_unexpected_failure_outside_the_tools_is_answered_500_in_json():
    """A bug in a route other than a tool's (here: tool schemas that cannot be written as JSON) is
    answered in JSON like every other error, and the server goes on serving."""
    env = gym.make("sinkflex/RetailHTTP-v0", split="train")
    try:
        env.reset(options={"task_index": 0})
        server = env.unwrapped.backend.server
        host, port = server.server_address[:2]
        schemas, server.schemas = server.schemas, [object()]
        reply = _exchange(host, port, [b"GET /tools HTTP/1.1\r\nHost: x\r\n\r\n"])
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 500 ") and b"application/json" in head, reply[:300]
        assert json.loads(body) == {"error": "internal error: TypeError"}
        server.schemas = schemas
        status, payload = post_raw(f"{env.unwrapped.backend.url}/tools/think", b'{"arguments": {"thought": "x"}}',
                                   {"Content-Type": "application/json"})
        assert status == 200 and payload["output"] == "ok"
    finally:
        env.close()


def _exchange(host: str, port: int, pieces: list[bytes], pause: float = 0.0, until_answer: bool = False) -> bytes:
    """Send ``pieces`` one write each (``pause`` seconds apart), then read until the server closes. With
    ``until_answer``, stop writing once an answer is there: the server has refused the request and
    closes, and writing on would reset the connection and lose the answer."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for piece in pieces:
            if until_answer and select.select([s], [], [], 0)[0]:
                break
            s.sendall(piece)
            time.sleep(pause)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def test_the_request_head_is_bounded_however_it_arrives():
    """A head past MAX_HEAD is answered 431 in JSON, whether the parser sees it whole (a long request
    line, a long header) or as pieces of one header line that never ends; a head that arrives a few
    bytes at a time, and several requests on one connection, are served as usual."""
    from sinkflex_core.envs.http_server import MAX_HEAD

    env = gym.make("sinkflex/RetailHTTP-v0", split="train")
    try:
        host, port = env.unwrapped.backend.server.server_address[:2]
        body = b'{"arguments": {"thought": "x"}}'
        call = (b"POST /tools/think HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        too_long = [
            [b"GET /" + b"x" * (MAX_HEAD + 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n"],
            [b"GET /tools HTTP/1.1\r\nX-Big: " + b"y" * (MAX_HEAD + 10) + b"\r\n\r\n"],
            [b"GET /tools HTTP/1.1\r\nX-Big: "] + [b"y" * 4096] * (MAX_HEAD // 4096 + 8),  # never ends
        ]
        for pieces in too_long:
            reply = _exchange(host, port, pieces, pause=0.002 if len(pieces) > 1 else 0.0, until_answer=True)
            head, _, rest = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431 ") and b"application/json" in head, reply[:200]
            assert json.loads(rest) == {"error": "request head too large"}
        # a head just under the bound, one byte at a time, then a second request on the same connection
        near = call.replace(b"Host: x\r\n", b"Host: x\r\nX-Pad: " + b"p" * (MAX_HEAD - 200) + b"\r\n")
        slow = [bytes([b]) for b in call] + [near, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
        reply = _exchange(host, port, slow, pause=0.0002)
        assert reply.count(b"HTTP/1.1 200 OK") == 3, reply[:600]
        assert reply.endswith(b'{"ok":true}'), reply[-200:]
        assert [entry[2] for entry in list(env.unwrapped.backend.server.request_log)[-3:]] == [200, 200, 200]
    finally:
        env.close()


@pytest.mark.parametrize("status,raw,expected", [
    (414, b"<html><body>URI Too Long</body></html>", "Error: the tool server answered HTTP 414 with something"),
    (200, b"[1, 2]", "Error: the tool server answered HTTP 200 with an unexpected JSON value"),
    (200, b'{"output": 5}', "Error: HTTP 200"),
    (200, b"\xff\xfe", "Error: the tool server answered HTTP 200 with something"),
    (500, b'{"error": "the tool failed: KeyError"}', "Error: the tool failed: KeyError"),
    (200, b'{"output": "ok", "done": true}', "ok"),
])
def test_the_client_turns_any_answer_into_an_observation(status, raw, expected):
    result = _result_from_answer(status, raw)
    assert result.output.startswith(expected), result.output
    assert result.done == (expected == "ok")


# ---- bank: deadlines and size caps -------------------------------------------------------------

@pytest.fixture
def bank():
    env = gym.make("sinkflex/BankSQL-v0", split="train", max_turns=50)
    env.reset(options={"task_index": 0})
    yield env
    env.close()


def _sql(env, query: str, tool: str = "run_sql") -> str:
    return env.step(format_tool_call(tool, {"query": query}))[0]


def test_one_long_sqlite_call_is_refused(bank):
    """printf with a huge precision once ran for seconds inside a single SQLite call (no step-based
    guard can stop it), and the recursive query below was still running after 30 s."""
    obs = _sql(bank, "SELECT printf('%.*c', 1000000000, 'x')")
    assert obs.startswith("Error") and "printf width or precision" in obs, obs
    obs = _sql(bank, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<100000) "
                     "SELECT count(printf('%.*c', 1000000000 + x, 'x')) FROM c")
    assert obs.startswith("Error") and "printf" in obs, obs
    for query in ("SELECT format('%.*c', 1000000000, 'x')", "SELECT printf('%.*c', '1000000000 copies', 'x')",
                  "SELECT printf('%.*c', 1e999, 'x')", "SELECT printf('%1000000000c', 'x')"):
        obs = _sql(bank, query)
        assert obs.startswith("Error") and "printf" in obs, (query, obs)
    # within the limits printf and format still work as SQLite's
    assert json.loads(_sql(bank, "SELECT printf('%5.2f|%-3d|%.*c', 3.14159, 7, 3, 'z'), format('%s!', 'a')"))[
        "rows"] == [[" 3.14|7  |zzz", "a!"]]


def test_printf_widths():
    assert printf_widths("%.*c", (1000, "x")) == [1000]
    assert printf_widths("%*.*s|%%|%05d", (-20, 3, "abc", 7)) == [20, 3, 5]
    assert printf_widths("%123456789012c", ()) == [123456789012]
    assert printf_widths("%.*c", ("12", "x")) == [12]
    # what SQLite reads as a number from text, blobs and infinity counts too
    assert printf_widths("%.*c|%*d|%.*c", ("1000000000abc", "x", b" 77", 1, float("inf"), "x")) == [
        1000000000, 77, 2**63 - 1]
    assert printf_widths("%.*c", ("abc", "x")) == [0]


def test_runaway_queries_stop_and_say_which_limit(bank, monkeypatch):
    obs = _sql(bank, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c")
    assert obs.startswith("Error: the query was stopped") and "steps" in obs, obs
    # slow steps: the wall-clock deadline ends it. Which limit comes first depends on the machine's speed
    # (a fast one reaches the step cap within the deadline), so the cap is raised for this query: to 15
    # times its value (tens of seconds), which still ends the query should the deadline ever fail.
    monkeypatch.setattr(bank_module, "MAX_VM_STEPS", 15 * bank_module.MAX_VM_STEPS)
    t = time.monotonic()
    obs = _sql(bank, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                     "SELECT count(randomblob(9000)) FROM c")
    assert obs.startswith("Error: the query was stopped") and f"{QUERY_SECONDS:g} s deadline" in obs, obs
    assert time.monotonic() - t < QUERY_SECONDS + 5
    monkeypatch.undo()
    for query in ("SELECT zeroblob(100000)", "SELECT randomblob(1000000000)",
                  "SELECT group_concat(first_name) FROM customers, accounts"):
        obs = _sql(bank, query)
        assert obs.startswith("Error") and f"longer than {MAX_VALUE_BYTES:,} bytes" in obs, (query, obs)
    obs = _sql(bank, "SELECT 'a' LIKE '%" + "a" * 500 + "'")
    assert obs.startswith("Error") and "LIKE" in obs, obs


def test_a_submitted_result_is_capped_in_rows_and_bytes(bank):
    rows = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) SELECT {cols} FROM c"
    obs, reward, terminated, *_ = bank.step(format_tool_call("submit_answer", {
        "query": rows.format(n=MAX_ROWS_GRADED + 1, cols="x")}))
    assert obs == f"Error: the result has more than {MAX_ROWS_GRADED:,} rows (limit)" and not terminated
    # 5,000 rows of six 9,000-byte columns: once 270 MB kept in memory, now refused at the byte cap
    cols = ", ".join(["printf('%.*c', 9000, 'x')"] * 6)
    obs, reward, terminated, *_ = bank.step(format_tool_call("submit_answer", {
        "query": rows.format(n=MAX_ROWS_GRADED, cols=cols)}))
    assert obs == f"Error: the result is larger than {MAX_RESULT_BYTES:,} bytes (limit)" and not terminated
    assert bank.unwrapped.backend.submitted_rows is None
    # run_sql shows its first rows and says that there were more
    out = json.loads(_sql(bank, rows.format(n=100, cols="x")))
    assert out["truncated"] and len(out["rows"]) == 20


def test_a_submitted_answer_is_released_on_reset(bank):
    task = bank_tasks(0, "train")[0]
    *_, terminated, _, _ = bank.step(format_tool_call("submit_answer", {"query": task["sql"]}))
    assert terminated and bank.unwrapped.backend.submitted_rows is not None
    bank.reset(options={"task_index": 1})
    assert bank.unwrapped.backend.submitted_rows is None


# ---- answers as whole numbers --------------------------------------------------------------------

def test_numbers_match_as_whole_numbers():
    assert answer_given("1067.45", "The total is $1,067.45.")
    assert answer_given("1067.45", "Total: 1067.45")
    for wrong in ("The total is 11067.45.", "The total is 1067.456", "It is 21067.45", "1067.450 dollars",
                  "v0.1067.45"):
        assert not answer_given("1067.45", wrong), wrong
    assert mentions("#W1234567", "Cancel #W1234567? (yes/no)") and not mentions("#W1234567", "order #W12345678")
    assert not mentions("202 River Street", "to 1202 River Street") and mentions("202 River Street", "to 202 river street,")


def test_a_wrong_total_that_contains_the_right_one_scores_zero():
    """The reward and the scripted customer both refuse "11067.45" for an answer of 1067.45."""
    tasks = get_tasks(0, "test")
    k = next(i for i, t in enumerate(tasks) if t["requests"][0]["kind"] == "total" and len(t["requests"]) == 1)
    answer = tasks[k]["outputs"][0]
    env = gym.make("sinkflex/Retail-v0", split="test")
    try:
        env.reset(options={"task_index": k})
        order = {"order_id": tasks[k]["requests"][0]["order_id"]}  # read, as the reward asks of an answer
        assert not env.unwrapped.backend.call_tool("get_order_details", order).output.startswith("Error")
        obs, reward, terminated, truncated, info = env.step(f"The total is 1{answer}.")
        assert "Thanks" not in obs and not terminated  # the customer asks again
        assert env.unwrapped.backend.reward()[0] == 0.0
        obs, reward, terminated, truncated, info = env.step(f"The total is {answer}.")
        assert terminated and reward == 1.0, obs
    finally:
        env.close()


def test_bank_results_match_by_value_not_by_text():
    env = gym.make("sinkflex/BankSQL-v0", split="test")
    try:
        tasks = bank_tasks(0, "test")
        k = next(i for i, t in enumerate(tasks) if len(t["answer"]) == 1 and isinstance(t["answer"][0][0], int)
                 and t["answer"][0][0] > 0)
        value = tasks[k]["answer"][0][0]
        for query, want in ((f"SELECT 1{value}", 0.0), (f"SELECT '{value}'", 0.0), (f"SELECT {value}", 1.0)):
            env.reset(options={"task_index": k})
            *_, reward, terminated, _, _ = env.step(format_tool_call("submit_answer", {"query": query}))
            assert terminated and reward == want, query
    finally:
        env.close()
