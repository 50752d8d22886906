"""Speed of the airline environments (reset, tool calls, HTTP overhead, oracle episodes) and, with
``--baselines FILE``, the oracle, random and do-nothing agents on every test task, written with
provenance columns.

    python benchmarks/bench_airline.py                                   # timings, about a minute
    python benchmarks/bench_airline.py --baselines data/airline_baselines.csv --trials 4

Target: reset under 50 ms (median and max are printed; a reset copies the master database with
SQLite's backup API and builds the episode's customer).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import gymnasium as gym

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import AIRLINE_ENV_IDS, OracleAgent, format_tool_call, run_episode
from sinkflex_core.envs.airline import expected_hash
from sinkflex_core.envs.airline_world import AirlineWorld, generate_world


def _calls(world: AirlineWorld, n: int) -> list[str]:
    res, users = list(world.data.reservations), list(world.data.users)
    routes = [(f["origin"], f["destination"]) for f in world.data.flights.values()]
    kinds = [lambda i: format_tool_call("get_reservation_details", {"reservation_id": res[i % len(res)]}),
             lambda i: format_tool_call("get_user_details", {"user_id": users[i % len(users)]}),
             lambda i: format_tool_call("search_direct_flight", {"origin": routes[i % len(routes)][0],
                                                                 "destination": routes[i % len(routes)][1],
                                                                 "date": f"2024-06-{16 + i % 14}"})]
    return [kinds[i % len(kinds)](i) for i in range(n)]


def timings(calls: int, resets: int, episodes: int) -> None:
    t = time.perf_counter()
    generate_world(12345)
    print(f"world generation (Python data only), cold: {1e3 * (time.perf_counter() - t):.0f} ms")
    t = time.perf_counter()
    world = AirlineWorld.get(0)
    print(f"world generation + SQLite master + hash, cold: {1e3 * (time.perf_counter() - t):.0f} ms")
    rows = {}
    for env_id in AIRLINE_ENV_IDS:
        env = gym.make(env_id, split="train", max_turns=10**9)
        n = env.unwrapped.num_tasks
        env.reset(options={"task_index": 0})  # the tasks are generated on first use
        times = []
        for i in range(resets):
            t = time.perf_counter()
            env.reset(options={"task_index": i % n})
            times.append(time.perf_counter() - t)
        actions = _calls(world, calls)
        t = time.perf_counter()
        for a in actions:
            env.step(a)
        rows[env_id] = (1e3 * statistics.median(times), 1e3 * max(times), calls / (time.perf_counter() - t))
        env.close()
    print(f"\n{'environment':26s} {'reset median':>13s} {'reset max':>10s} {'tool calls/s (env.step)':>24s}")
    for env_id, (med, worst, cps) in rows.items():
        print(f"{env_id:26s} {med:10.2f} ms {worst:7.2f} ms {cps:24.0f}")
    for env_id in AIRLINE_ENV_IDS:
        env = gym.make(env_id, split="test")
        for i in range(episodes):  # the ground-truth hashes are cached per task: compute them first
            expected_hash(world, "test", i % env.unwrapped.num_tasks)
        t = time.perf_counter()
        steps = 0
        for i in range(episodes):
            messages, _, _ = run_episode(env, OracleAgent(), i % env.unwrapped.num_tasks)
            steps += sum(m["role"] == "assistant" for m in messages)
        dt = time.perf_counter() - t
        print(f"oracle episodes {env_id:24s}: {1e3 * dt / episodes:.1f} ms/episode, {steps / dt:.0f} steps/s "
              "(includes grading)")
        env.close()
    ok = all(med < 50 and worst < 50 for med, worst, _ in rows.values())
    print(f"\ntarget reset < 50 ms (median and max): {'PASS' if ok else 'FAIL'}")


def baselines(path: str, trials: int, seed: int) -> None:
    import pandas as pd

    from sinkflex_core.envs import DoNothingAgent, RandomAgent, evaluate_agent, pass_hat_k
    from sinkflex_core.provenance import provenance

    agents = {"oracle": lambda t: OracleAgent(), "random": lambda t: RandomAgent(seed + t),
              "do-nothing": lambda t: DoNothingAgent()}
    env_id = AIRLINE_ENV_IDS[0]
    env = gym.make(env_id, split="test")
    indices = range(env.unwrapped.num_tasks)
    rows = []
    for name, make in agents.items():
        t = time.perf_counter()
        results = evaluate_agent(env, make, indices, trials=trials, seed=seed)
        row = {"env": env_id, "agent": name, "tasks": len(indices), "trials": trials,
               "mean_reward": sum(map(sum, results)) / (len(indices) * trials)}
        row.update({f"pass^{k}": pass_hat_k(results, k) for k in range(1, trials + 1)})
        rows.append(row)
        print(f"{name}: mean reward {row['mean_reward']:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    env.close()
    table = pd.DataFrame(rows)
    for key, value in provenance(seed=seed).items():
        table[key] = value
    table.to_csv(path, index=False)
    print(table.round(3).to_string(index=False))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--resets", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--baselines", default="", help="write the baselines of the test split to this CSV")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"# bench_airline  python {platform.python_version()}  {platform.machine()}  gymnasium {gym.__version__}")
    if args.baselines:
        baselines(args.baselines, args.trials, args.seed)
    else:
        timings(args.calls, args.resets, args.episodes)


if __name__ == "__main__":
    main()
