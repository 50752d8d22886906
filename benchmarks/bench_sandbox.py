"""Per-command cost of the shell jail (``sinkflex_core.envs.sandbox``), to size rollouts and tests.

    python benchmarks/bench_sandbox.py --repeats 30

Prints, for the namespace jail and the unjailed fallback, the wall time of ``true``, of
``python3 -c pass`` and of a ``Bash-v0`` step that runs a ``find | wc`` command; plus the cost of a
``CodeRepair-v0`` grading (hidden cases run in a fresh jail). Median and 90th percentile, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _time(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up (first probe, page cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()

    import gymnasium as gym

    import sinkflex_core  # noqa: F401  (registers the environments)
    from sinkflex_core.envs.base import format_tool_call
    from sinkflex_core.envs.sandbox import Sandbox, jail_available

    ok, why = jail_available()
    print(f"jail: {ok} ({why})")
    modes = ([("namespaces", True)] if ok else []) + [("unjailed", False)]
    for label, jail in modes:
        box = Sandbox(jail=jail, allow_unjailed=True)
        try:
            for what, cmd in (("true", "true"), ("python3 -c pass", "python3 -c pass")):
                med, p90 = _time(lambda c=cmd, b=box: b.run(c), args.repeats)
                print(f"{label:>10} {what:<24} median {med:7.1f} ms   p90 {p90:7.1f} ms")
        finally:
            box.close()
    if ok:
        env = gym.make("sinkflex/Bash-v0", split="test")
        env.reset(seed=0, options={"task_index": 0})
        action = format_tool_call("run", {"command": "find . -type f | wc -l"})
        med, p90 = _time(lambda: env.step(action), args.repeats)
        print(f"{'Bash-v0':>10} {'step (run find | wc)':<24} median {med:7.1f} ms   p90 {p90:7.1f} ms")
        env.close()
        env = gym.make("sinkflex/CodeRepair-v0", split="test")
        env.reset(seed=0, options={"task_index": 0})
        backend = env.unwrapped.backend
        source = backend.task["source"]
        med, p90 = _time(lambda: backend.grade(source), max(5, args.repeats // 3))
        print(f"{'CodeRepair':>10} {'grade (hidden cases)':<24} median {med:7.1f} ms   p90 {p90:7.1f} ms")
        env.close()


if __name__ == "__main__":
    main()
