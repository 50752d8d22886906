"""The HTTP tool server's life cycle: resets and closes while clients are talking to it, closing
while a keep-alive connection is open, an environment dropped without ``close()``; and proof that
``sinkflex/RetailHTTP-v0`` really sends its tool calls over HTTP.

The tests that once crashed the interpreter (SIGSEGV) run their scenario in a child process, so that
a crash shows up as a failed test with the child's exit status instead of ending pytest.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import gymnasium as gym

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import RetailWorld, format_tool_call

ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports this checkout's ``sinkflex_core``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints the threads' stacks to stderr
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(ROOT))


def port_is_free(port: int) -> bool:
    """Whether a new listening socket can take ``port`` on 127.0.0.1 (as a restarted server would)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        return True
    except OSError:
        return False
    finally:
        s.close()


HAMMER = """
import http.client, json, socket, threading, time
import gymnasium as gym
import sinkflex_core
from sinkflex_core.envs import RetailWorld

orders = list(RetailWorld.get(0).data.orders)[:50]
env = gym.make("sinkflex/RetailHTTP-v0", split="train")
env.reset(options={"task_index": 0})
host, port = env.unwrapped.backend.server.server_address[:2]
baseline = {t.ident for t in threading.enumerate()}
stop = threading.Event()
stats = {"answers": 0, "not_json": [], "refused": 0}
lock = threading.Lock()

def client(k):
    conn = http.client.HTTPConnection(host, port, timeout=10)
    i = 0
    while not stop.is_set():
        i += 1
        if i % 3 == 0:  # a write: cancelling races the reset that replaces the database
            body = {"arguments": {"order_id": orders[(k + i) % 50], "reason": "no longer needed"}}
            path = "/tools/cancel_pending_order"
        else:
            body, path = {"arguments": {"order_id": orders[(k * 7 + i) % 50]}}, "/tools/get_order_details"
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()  # the server is gone (after close) or dropped this connection: a new one
            with lock:
                stats["refused"] += 1
            time.sleep(0.002)
            continue
        try:
            payload = json.loads(raw)
            ok = isinstance(payload, dict) and ("output" in payload or "error" in payload)
        except ValueError:
            ok = False
        with lock:
            stats["answers"] += 1
            if not ok:
                stats["not_json"].append([resp.status, raw[:200].decode("utf-8", "replace")])

threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
for t in threads:
    t.start()
def answered():
    with lock:
        return stats["answers"]

for i in range(200):
    env.reset(options={"task_index": i % 50})
    seen, t0 = answered(), time.monotonic()
    while answered() < seen + 4 and time.monotonic() - t0 < 2:  # let requests land between resets
        time.sleep(0.001)
seen, t0 = answered(), time.monotonic()
while answered() < seen + 8 and time.monotonic() - t0 < 2:
    time.sleep(0.001)
env.close()
time.sleep(0.2)  # clients keep knocking on the closed port for a moment
stop.set()
for t in threads:
    t.join(timeout=30)
mine = {t.ident for t in threads}
left = [t.name for t in threading.enumerate() if t.ident not in baseline | mine and t.is_alive()]
left += [t.name for t in threading.enumerate() if t.ident in baseline and t is not threading.main_thread()
         and t.is_alive()]
print(json.dumps({"answers": stats["answers"], "refused": stats["refused"], "not_json": stats["not_json"][:5], "port": port,
                  "threads_left": left}))
"""


def test_resets_and_close_under_concurrent_clients_do_not_crash():
    """8 client threads hammer the server through 200 resets and a close: no crash, every answer JSON,
    no thread of the environment left, the port free again."""
    proc = run_child(HAMMER)
    assert proc.returncode == 0, f"child exited with {proc.returncode}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["answers"] >= 200, report
    assert report["not_json"] == [], report
    assert report["threads_left"] == [], report
    assert port_is_free(report["port"])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


KEEP_ALIVE = """
import http.client, json, threading
import gymnasium as gym
import sinkflex_core

env = gym.make("sinkflex/RetailHTTP-v0", split="train")
env.reset(options={"task_index": 0})
host, port = env.unwrapped.backend.server.server_address[:2]
conn = http.client.HTTPConnection(host, port, timeout=10)
conn.request("POST", "/tools/list_all_product_types", body="{}", headers={"Content-Type": "application/json"})
first = conn.getresponse()
first.read()
env.close()  # the client still holds its keep-alive connection
alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
try:
    conn.request("POST", "/tools/list_all_product_types", body="{}", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    second = [resp.status, json.loads(resp.read())]
except (OSError, http.client.HTTPException) as err:
    second = type(err).__name__
print(json.dumps({"first": first.status, "second": second, "alive": alive}))
"""


def test_close_ends_keep_alive_connections():
    """After close() no request thread is left to touch the closed database: a keep-alive client's
    next request gets no answer (or a JSON refusal), and the server prints no traceback."""
    proc = run_child(KEEP_ALIVE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["first"] == 200 and report["alive"] == [], report
    second = report["second"]
    assert isinstance(second, str) or (second[0] == 503 and "error" in second[1]), report
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_an_env_dropped_without_close_stops_its_server():
    before = {t.ident for t in threading.enumerate()}
    env = gym.make("sinkflex/RetailHTTP-v0", split="train")
    env.reset(options={"task_index": 0})
    port = env.unwrapped.backend.server.server_address[1]
    env.step(format_tool_call("list_all_product_types", {}))
    assert not port_is_free(port)
    del env
    gc.collect()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [] and port_is_free(port), left


def test_tool_calls_really_go_over_http():
    """The server's own request log shows one POST per tool call the agent makes, answered with the
    status the call deserves; in-process calls would leave the log empty."""
    env = gym.make("sinkflex/RetailHTTP-v0", split="test")
    try:
        env.reset(options={"task_index": 0})
        server = env.unwrapped.backend.server
        order = next(iter(RetailWorld.get(0).data.orders))
        start = len(server.request_log)
        obs, *_ = env.step(format_tool_call("get_order_details", {"order_id": order}))
        assert json.loads(obs)["order_id"] == order
        env.step(format_tool_call("get_order_details", {"order_id": 5}))  # a schema error: 422 from the server
        env.step(format_tool_call("think", {"thought": "hm"}))
        env.step("Hello, how can I help?")  # a message to the customer: no request
        log = list(server.request_log)[start:]
        assert [(m, p, s) for m, p, s in log] == [("POST", "/tools/get_order_details", 200),
                                                  ("POST", "/tools/get_order_details", 422),
                                                  ("POST", "/tools/think", 200)], log
    finally:
        env.close()


def test_the_server_machinery_serves_any_backend():
    """HTTPServedBackend is not tied to the retail store: the bank served over HTTP answers its own
    tools through the server, and refuses the store's tools before any request."""
    from sinkflex_core.envs.bank import BankBackend
    from sinkflex_core.envs.http_server import HTTPServedBackend

    class BankOverHTTP(HTTPServedBackend, BankBackend):
        pass

    before = {t.ident for t in threading.enumerate()}
    backend = BankOverHTTP(0)
    try:
        backend.reset("train", 0)
        out = backend.call_tool("run_sql", {"query": "SELECT 40 + 2"})
        assert json.loads(out.output)["rows"] == [[42]]
        assert backend.call_tool("think", {"thought": "x"}).output == "Error: unknown tool 'think'"
        assert backend.call_tool("run_sql", {"query": 5}).output == "Error: argument 'query' must be a string"
        assert list(backend.server.request_log) == [("POST", "/tools/run_sql", 200), ("POST", "/tools/run_sql", 422)]
    finally:
        backend.close()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []


def test_close_waits_for_the_request_in_flight():
    """Graceful shutdown: a tool call still running when close() starts gets its full answer, and the
    server is gone afterwards."""
    import time

    from sinkflex_core.envs.http_server import RetailHTTPBackend, post_raw

    started = threading.Event()

    class SlowStore(RetailHTTPBackend):
        def _serve_call(self, name, arguments):
            if name == "think":
                started.set()
                time.sleep(0.5)
            return super()._serve_call(name, arguments)

    before = {t.ident for t in threading.enumerate()}
    backend = SlowStore(0)
    backend.reset("train", 0)
    url = backend.url
    answers = []
    client = threading.Thread(target=lambda: answers.append(
        post_raw(f"{url}/tools/think", b'{"arguments": {"thought": "slow"}}', {"Content-Type": "application/json"})))
    client.start()
    assert started.wait(30)
    backend.close()
    client.join(30)
    assert answers == [(200, {"output": "ok", "done": False})]
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    assert port_is_free(int(url.rsplit(":", 1)[1]))


def test_a_late_answer_is_reported_and_the_call_never_sent_twice(monkeypatch):
    """A call whose answer comes after the client stops waiting went out and may have run (a write):
    it is reported as unanswered, not sent again (the order would be cancelled twice and the agent told
    it failed), and the next call gets its own answer on a new connection."""
    import time

    import httpx

    from sinkflex_core.envs import http_server

    monkeypatch.setattr(http_server, "_TIMEOUTS", httpx.Timeout(1.0).as_dict())
    ran = []

    class SlowStore(http_server.RetailHTTPBackend):
        def _serve_call(self, name, arguments):
            ran.append(name)
            if name == "cancel_pending_order" and ran.count(name) == 1:
                time.sleep(2.5)
            return super()._serve_call(name, arguments)

    backend = SlowStore(0)
    try:
        backend.reset("test", 0)
        order = next(o for o, r in RetailWorld.get(0).data.orders.items() if r["status"] == "pending")
        out = backend.call_tool("cancel_pending_order", {"order_id": order, "reason": "no longer needed"})
        assert out.output == "Error: the tool server did not answer within 1 s"
        time.sleep(2.0)  # the slow call finishes on the server
        details = json.loads(backend.call_tool("get_order_details", {"order_id": order}).output)
        assert details["status"] == "cancelled"  # it ran, once
        assert ran == ["cancel_pending_order", "get_order_details"]
    finally:
        backend.close()


def test_the_openapi_document_has_each_tools_request_model():
    """/openapi.json describes POST /tools/<name> for every tool with a request model generated from the
    tool's JSON schema: same keys, same required keys, same types (nested objects included)."""
    import httpx

    from sinkflex_core.envs.airline_schemas import TOOL_SCHEMAS as AIRLINE_TOOLS
    from sinkflex_core.envs.retail_tools import TOOL_SCHEMAS as RETAIL_TOOLS

    def resolve(doc, node):
        while "$ref" in node:
            node = doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def same_shape(doc, ours, theirs, where):
        ours = resolve(doc, ours)
        if "enum" in theirs:
            assert ours.get("enum") == theirs["enum"], where
            return
        assert ours.get("type") == theirs["type"], (where, ours, theirs)
        if theirs["type"] == "object":
            assert set(ours["properties"]) == set(theirs["properties"]), where
            assert set(ours.get("required", [])) == set(theirs.get("required", [])), where
            for key, sub in theirs["properties"].items():
                same_shape(doc, ours["properties"][key], sub, f"{where}.{key}")
        elif theirs["type"] == "array":
            same_shape(doc, ours["items"], theirs["items"], where + "[]")

    for env_id, schemas in (("sinkflex/RetailHTTP-v0", RETAIL_TOOLS), ("sinkflex/AirlineHTTP-v0", AIRLINE_TOOLS)):
        env = gym.make(env_id)
        try:
            doc = httpx.get(env.unwrapped.backend.url + "/openapi.json", timeout=30, trust_env=False).json()
        finally:
            env.close()
        for tool in schemas:
            fn = tool["function"]
            op = doc["paths"][f"/tools/{fn['name']}"]["post"]
            body = resolve(doc, op["requestBody"]["content"]["application/json"]["schema"])
            same_shape(doc, body["properties"]["arguments"], fn["parameters"], fn["name"])
            assert {"200", "404", "413", "422"} <= set(op["responses"])


def test_the_request_models_accept_every_ground_truth_call_and_refuse_wrong_types():
    import pydantic
    import pytest

    from sinkflex_core.envs.airline_schemas import TOOL_SCHEMAS as AIRLINE_TOOLS
    from sinkflex_core.envs.airline_tasks import get_tasks as airline_tasks
    from sinkflex_core.envs.http_server import call_models
    from sinkflex_core.envs.retail_tasks import get_tasks as retail_tasks
    from sinkflex_core.envs.retail_tools import TOOL_SCHEMAS as RETAIL_TOOLS

    for schemas, tasks in ((RETAIL_TOOLS, retail_tasks(0, "test")), (AIRLINE_TOOLS, airline_tasks(0, "test"))):
        models = call_models(schemas)
        calls = [a for t in tasks for a in t["actions"]]
        assert len(calls) > 20
        for call in calls:
            models[call["name"]].model_validate({"arguments": call["arguments"]})
    models = call_models(RETAIL_TOOLS)
    for bad in ({"order_id": 5}, {}, {"order_id": "#W1", "extra": 1}):
        with pytest.raises(pydantic.ValidationError):
            models["get_order_details"].model_validate({"arguments": bad})
    airline = call_models(AIRLINE_TOOLS)
    with pytest.raises(pydantic.ValidationError):
        airline["send_certificate"].model_validate({"arguments": {"user_id": "x", "amount": 5000}})


def test_a_closed_served_env_refuses_every_call_the_same_way():
    """Over HTTP and over MCP, reset, step and the reward of a closed environment raise the same
    RuntimeError, instead of an AttributeError or a reset that seems to work."""
    for env_id in ("sinkflex/RetailHTTP-v0", "sinkflex/RetailMCP-v0"):
        env = gym.make(env_id, split="test")
        env.reset(options={"task_index": 0})
        backend = env.unwrapped.backend
        env.close()
        for method, args in ((backend.reset, ("test", 0)), (backend.reward, ()),
                             (backend.call_tool, ("think", {"thought": "x"}))):
            try:
                method(*args)
            except RuntimeError as err:
                assert "closed" in str(err), (env_id, err)
            else:
                raise AssertionError(f"{env_id}: a call after close did not raise")
