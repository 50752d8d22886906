"""A bounded soak: every environment takes a seeded stream of hostile actions (numbers too long to
read, huge non-ASCII tool names, runaway and oversized SQL, wrong answers that contain the right one)
while raw HTTP clients throw malformed requests at the retail server through resets and a close.

It runs in a child process, so a crash (the server once died with SIGSEGV under this load) or a hang
(one BankSQL query once ran past 30 s) fails the test instead of ending pytest. A few seconds on a
laptop, under 60 s on a busy 2-core machine; the child's time limit only turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SOAK = r"""
import http.client, json, random, socket, sys, threading, time
import gymnasium as gym
import sinkflex_core
from sinkflex_core.envs import ENV_IDS, RetailWorld, format_tool_call

rng = random.Random(1234)
world = RetailWorld.get(0)
orders = list(world.data.orders)[:40]
BIG = "7" * 5000
SQL = ["SELECT printf('%.*c', 1000000000, 'x')",
       "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<100000) "
       "SELECT count(printf('%.*c', 1000000000 + x, 'x')) FROM c",
       "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
       "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<5000) "
       "SELECT " + ", ".join(["printf('%.*c', 9000, 'x')"] * 6) + " FROM c",
       "SELECT zeroblob(1000000000)", "SELECT 'a' LIKE '%" + "a" * 300 + "'",
       "SELECT * FROM accounts", "SELECT count(*) FROM customers", "DELETE FROM loans"]

def text(n):
    return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1F64F)]))
                   for _ in range(n))

def action(env_id):
    k = rng.randrange(9)
    if k == 0:
        return '<tool_call>\n{"name": "think", "arguments": {"thought": ' + BIG + '}}\n</tool_call>'
    if k == 1:
        return '<tool_call>\n{"name": "run_sql", "arguments": "{\\"query\\": ' + BIG + '}"}\n</tool_call>'
    if k == 2:  # a tool name from a few characters to a URL well past 64 KiB
        return '<tool_call>\n{"name": "' + text(rng.choice([3, 200, 12000])).replace('"', "").replace("\\", "") + '", "arguments": {}}\n</tool_call>'
    if k == 3:
        return format_tool_call(rng.choice(["run_sql", "submit_answer"]), {"query": rng.choice(SQL)})
    if k == 4:
        return format_tool_call("get_order_details", {"order_id": rng.choice(orders)})
    if k == 5:
        return format_tool_call("cancel_pending_order", {"order_id": rng.choice(orders), "reason": "no longer needed"})
    if k == 6:
        return "The total is 1" + str(rng.randint(100, 999)) + ".45 and your order is #W" + str(rng.randint(10**7, 10**8))
    if k == 7:
        return '{"name": "x", "arguments": {"n": ' + BIG + '}}'
    return text(rng.randint(0, 300))

# each known way in first, then a seeded random stream
FIRST = ['<tool_call>\n{"name": "think", "arguments": {"thought": ' + BIG + '}}\n</tool_call>',
         '<tool_call>\n{"name": "' + "\u00e9" * 12000 + '", "arguments": {}}\n</tool_call>',
         *(format_tool_call("run_sql", {"query": q}) for q in SQL[:4]),
         format_tool_call("submit_answer", {"query": SQL[3]})]
steps = 0
for env_id in ENV_IDS:
    env = gym.make(env_id, split="train", max_turns=25)
    env.reset(options={"task_index": 0})
    for i in range(120):
        obs, reward, terminated, truncated, info = env.step(FIRST[i] if i < len(FIRST) else action(env_id))
        assert isinstance(obs, str) and 0.0 <= reward <= 1.0, (env_id, obs[:200])
        steps += 1
        if terminated or truncated:
            env.reset(options={"task_index": rng.randrange(50)})
    assert env.unwrapped.backend.integrity_check() == "ok"
    env.close()

# the HTTP server under malformed traffic, resets and a close
env = gym.make("sinkflex/RetailHTTP-v0", split="train", max_turns=10**6)
env.reset(options={"task_index": 0})
host, port = env.unwrapped.backend.server.server_address[:2]
before = {t.ident for t in threading.enumerate()}
stop = threading.Event()
lock = threading.Lock()
seen = {"answers": 0, "not_json": []}

def raw_request(r):
    k = r.randrange(7)
    if k == 0:
        return b"POST /tools/" + ("\u00e9" * 40000).encode() + b" HTTP/1.1\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
    if k == 1:
        body = b'{"arguments": {"thought": ' + BIG.encode() + b"}}"
        return b"POST /tools/think HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    if k == 2:
        return bytes(r.randrange(256) for _ in range(r.randrange(1, 300))) + b"\r\n\r\n"
    if k == 3:
        return b"POST /tools/get_order_details HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n{}"
    body = json.dumps({"arguments": {"order_id": r.choice(orders)}}).encode()
    name = r.choice([b"get_order_details", b"cancel_pending_order", b"nope"])
    return b"POST /tools/" + name + b" HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body

def client(seed):
    r = random.Random(seed)
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=8) as s:
                s.sendall(raw_request(r))
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
        except OSError:
            time.sleep(0.005)
            continue
        if not reply:
            continue
        head, _, body = reply.partition(b"\r\n\r\n")
        try:
            json.loads(body)
            ok = b"application/json" in head
        except ValueError:
            ok = False
        with lock:
            seen["answers"] += 1
            if not ok:
                seen["not_json"].append(reply[:200].decode("latin-1"))

threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for i in range(60):
    env.reset(options={"task_index": i % 40})
    for _ in range(3):
        obs, *_ = env.step(action("sinkflex/RetailHTTP-v0"))
        assert isinstance(obs, str)
        steps += 1
env.close()
stop.set()
for t in threads:
    t.join(timeout=30)
mine = {t.ident for t in threads}
left = [t.name for t in threading.enumerate() if t.ident not in before | mine and t.is_alive()]
print(json.dumps({"steps": steps, "answers": seen["answers"], "not_json": seen["not_json"][:3], "left": left}))
"""


def test_soak_all_environments_with_hostile_input():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONFAULTHANDLER"] = "1"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SOAK)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, f"child exited with {proc.returncode}\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["steps"] == 3 * 120 + 60 * 3, report
    assert report["answers"] >= 20 and report["not_json"] == [], report
    assert report["left"] == [], report
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
