"""Speed of the tool environments, every form in one run: reset time, tool calls per second and the
latency of one call (p50, p95) in process, over HTTP (FastAPI on uvicorn, httpx's httpcore client)
and over MCP (the official SDK, streamable HTTP or stdio), all on 127.0.0.1.

    python benchmarks/bench_envs.py [--calls 3000] [--mcp-calls 500] [--resets 200]

Targets: reset under 50 ms; over 1,000 tool calls per second in process and over HTTP (both HTTP
forms: the retail store's and the airline's). The in-process
form is measured in the same run as a baseline: on a shared machine every figure moves with the load,
which the header prints.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import gymnasium as gym

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import OracleAgent, RetailWorld, expected_hash, format_tool_call, run_episode
from sinkflex_core.envs.airline_world import AirlineWorld
from sinkflex_core.envs.retail_world import generate_world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_airline import _calls as airline_calls  # noqa: E402  (the airline's tool mix)


def _time(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def _calls(world: RetailWorld, n: int) -> list[str]:
    orders, users = list(world.data.orders), list(world.data.users)
    products = list(world.data.products)
    kinds = [lambda i: format_tool_call("get_order_details", {"order_id": orders[i % len(orders)]}),
             lambda i: format_tool_call("get_user_details", {"user_id": users[i % len(users)]}),
             lambda i: format_tool_call("get_product_details", {"product_id": products[i % len(products)]}),
             lambda i: format_tool_call("find_user_id_by_email", {"email": world.data.users[users[i % 500]]["email"]})]
    return [kinds[i % len(kinds)](i) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--resets", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--mcp-calls", type=int, default=500, help="calls for the MCP forms (slower)")
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# bench_envs  python {platform.python_version()}  {platform.machine()}  gymnasium {gym.__version__}"
          f"  {os.cpu_count()} cores  load average {load}")

    t = time.perf_counter()
    generate_world(12345)
    print(f"world generation (Python data only), cold: {1e3 * (time.perf_counter() - t):.1f} ms")
    t = time.perf_counter()
    world = RetailWorld.get(0)
    print(f"world generation + SQLite master + hash, cold: {1e3 * (time.perf_counter() - t):.1f} ms")

    results = {}
    forms = ("sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/RetailMCP-v0", "sinkflex/Airline-v0",
             "sinkflex/AirlineHTTP-v0", "sinkflex/AirlineMCP-v0", "sinkflex/BankSQL-v0", "sinkflex/MCP-v0")
    for env_id in forms:
        env = gym.make(env_id, split="train", max_turns=10**9)
        n = env.unwrapped.num_tasks
        calls = args.mcp_calls if "MCP" in env_id else args.calls
        resets = _time(lambda i, e=env, n=n: e.reset(options={"task_index": i % n}),
                       min(args.resets, 20) if env_id == "sinkflex/MCP-v0" else args.resets)
        results[env_id] = {"reset_ms": 1e3 * statistics.median(resets), "reset_max_ms": 1e3 * max(resets)}
        env.reset(options={"task_index": 0})
        if "Bank" in env_id:
            actions = [format_tool_call("run_sql", {"query": f"SELECT * FROM accounts WHERE account_id = {1000 + i % 300}"})
                       for i in range(calls)]
        elif "Airline" in env_id:
            actions = airline_calls(AirlineWorld.get(0), calls)
        elif env_id == "sinkflex/MCP-v0":  # the notes store: a search and a read, in turn
            actions = [format_tool_call("search_notes", {"query": "plan"}) if i % 2 else
                       format_tool_call("list_notes", {}) for i in range(calls)]
        else:
            actions = _calls(world, calls)
        steps = _time(lambda i, e=env, a=actions: e.step(a[i]), calls)
        steps.sort()
        results[env_id].update(calls_per_s=calls / sum(steps), p50_ms=1e3 * steps[len(steps) // 2],
                               p95_ms=1e3 * steps[int(len(steps) * 0.95)])
        env.close()

    print(f"\n{'environment':25s} {'reset median':>13s} {'reset max':>10s} {'calls/s (env.step)':>19s} "
          f"{'p50':>9s} {'p95':>9s}")
    for env_id, r in results.items():
        print(f"{env_id:25s} {r['reset_ms']:10.2f} ms {r['reset_max_ms']:7.2f} ms {r['calls_per_s']:19.0f} "
              f"{r['p50_ms']:6.2f} ms {r['p95_ms']:6.2f} ms")

    # the tools alone, without the environment's parsing and bookkeeping
    from sinkflex_core.envs.http_server import RetailHTTPBackend
    from sinkflex_core.envs.mcp_served import RetailMCPBackend
    from sinkflex_core.envs.retail import RetailBackend

    raw = {}
    for cls in (RetailBackend, RetailHTTPBackend, RetailMCPBackend):
        backend = cls(0)
        backend.reset("train", 0)
        orders = list(world.data.orders)
        calls = args.mcp_calls if cls is RetailMCPBackend else args.calls
        t = time.perf_counter()
        for i in range(calls):
            backend.call_tool("get_order_details", {"order_id": orders[i % len(orders)]})
        raw[cls.__name__] = (time.perf_counter() - t) / calls
        backend.close()
    base = raw["RetailBackend"]
    print(f"\nget_order_details: in process {1e6 * base:.0f} us/call")
    for name, label in (("RetailHTTPBackend", "HTTP"), ("RetailMCPBackend", "MCP")):
        print(f"  over {label}: {1e6 * raw[name]:.0f} us/call, adds {1e6 * (raw[name] - base):.0f} us/call "
              f"({raw[name] / base:.1f}x)")

    for env_id in ("sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/RetailMCP-v0"):
        env = gym.make(env_id, split="test")
        for i in range(args.episodes):  # the ground-truth hashes are cached per task: compute them first
            expected_hash(world, "test", i % env.unwrapped.num_tasks)
        t = time.perf_counter()
        steps = 0
        for i in range(args.episodes):
            messages, _, _ = run_episode(env, OracleAgent(), i % env.unwrapped.num_tasks)
            steps += sum(m["role"] == "assistant" for m in messages)
        dt = time.perf_counter() - t
        print(f"oracle episodes {env_id:24s}: {1e3 * dt / args.episodes:.1f} ms/episode, {steps / dt:.0f} steps/s "
              "(includes grading: one state hash)")
        env.close()

    # how long BankSQL's limits take to stop queries that would otherwise run for seconds or forever
    env = gym.make("sinkflex/BankSQL-v0", max_turns=10**9)
    env.reset(options={"task_index": 0})
    runaway = {
        "printf '%.*c' 10**9 (one SQLite call)": "SELECT printf('%.*c', 1000000000, 'x')",
        "recursive printf 10**9 + x": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<100000) "
                                      "SELECT count(printf('%.*c', 1000000000 + x, 'x')) FROM c",
        "endless recursion (step count)": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c",
        # each row costs enough work that the 2 s deadline comes before the step cap, even on a fast machine
        "slow endless recursion (deadline)": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT "
                                             "count(replace(replace(hex(randomblob(4900)), 'A', 'B'), 'C', 'D')) FROM c",
        "5,000 rows x 6 x 9,000 bytes (byte cap)": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE "
                                                   "x<5000) SELECT " + ", ".join(["printf('%.*c', 9000, 'x')"] * 6) + " FROM c",
    }
    print()
    for label, query in runaway.items():
        t = time.perf_counter()
        obs, *_ = env.step(format_tool_call("run_sql", {"query": query}))
        print(f"BankSQL {label:42s} stopped after {1e3 * (time.perf_counter() - t):7.1f} ms: {obs[:70]}")
    env.close()

    reset_ok = all(r["reset_ms"] < 50 for k, r in results.items() if k != "sinkflex/MCP-v0")
    calls_ok = results["sinkflex/Retail-v0"]["calls_per_s"] > 1000
    http_ok = all(results[f]["calls_per_s"] > 1000 for f in ("sinkflex/RetailHTTP-v0", "sinkflex/AirlineHTTP-v0"))
    print(f"\ntarget reset < 50 ms (MCP-v0 aside: its reset is tool calls): {'PASS' if reset_ok else 'FAIL'};  "
          f"target > 1000 calls/s in process: {'PASS' if calls_ok else 'FAIL'};  over HTTP: "
          f"{'PASS' if http_ok else 'FAIL'}  (load average now {', '.join(f'{x:.1f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
