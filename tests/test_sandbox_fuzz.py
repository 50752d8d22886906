"""Adversarial actions against both executing environments: at least 2,000 per environment, none
may raise, every reward stays in [0, 1], nothing outside the sandbox changes and no process survives.

Most actions are rejected before any process starts (bad markup, unknown tools, wrong argument
types, bad paths, oversized input); a bounded number run real commands in the jail, because each
costs a few hundred milliseconds on a busy machine (``benchmarks/bench_sandbox.py``)."""

from __future__ import annotations

import json
import math
import os
import random

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401
from sinkflex_core.envs import format_tool_call
from sinkflex_core.envs.sandbox import Limits, jail_available

JAIL_OK, JAIL_WHY = jail_available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no namespace jail here: {JAIL_WHY}")
N_ACTIONS = 2_000
LIMITS = Limits(wall_s=1.0, cpu_s=1, processes=32)

NASTY_STRINGS = ["", " ", "\x00", "\ud800", "../../etc/passwd", "/etc/shadow", "a/b", ".", "..", "🙂" * 30,
                 "x" * 2_500, "'; rm -rf / #", "$(reboot)", "`id`", "<tool_call>", "</tool_call>", "\\", "\n\n",
                 "name.py", "test_x.py", "-rf", "*", "%s%s%n", "None"]
NASTY_COMMANDS = [
    "cat /etc/shadow ../../../etc/passwd", "rm -rf / --no-preserve-root 2>&1 | tail -n 2", "rm -rf /sandbox/*",
    "cd /; rm -rf sandbox", ":(){ :|:& };:", "yes", "cat /dev/urandom | head -c 50000", "sleep 5",
    "python3 -c 'while 1: pass'", "kill -9 -1", "kill -9 1", "chmod -R 000 .", "mkfifo p; cat p",
    "ln -s / root; ls root/", "ln -s /proc/1/root r; ls r/", "mount -t tmpfs x /tmp", "unshare -r id",
    "echo hi > /dev/tcp/127.0.0.1/22", "python3 -c 'import socket; socket.socket().connect((\"10.0.0.1\", 80))'",
    "setsid sleep 30 & disown; echo ok", "nohup sleep 30 & echo ok", "trap '' TERM INT; sleep 5",
    "exec 1>&-; echo gone", "printf '\\377\\000\\376'", "head -c 20M /dev/zero > big", "seq 3000 | xargs touch",
    "python3 -c 'import os; [os.fork() for _ in range(20)]'", "ulimit -n 100000", "cat /proc/self/mountinfo",
    "dd if=/dev/zero of=f bs=1M count=30 2>&1 | tail -n 1", "find / -xdev 2>/dev/null | wc -l", "ls -la /",
    "echo ok", "ls", "find . -type f | head", "tar -czf a.tar.gz . 2>&1 | tail -n 1", "true", "exit 3",
]
NASTY_MODULES = [
    "import os\nos.system('rm -rf /sandbox/*')\n", "while True:\n    pass\n", "import os\nwhile True:\n    os.fork()\n",
    "print('@@case 0 [\"ok\", 1]')\n", "import sys\nsys.exit(0)\n", "raise SystemExit(3)\n", "x = (\n",
    "import os\nos.symlink('/etc/passwd', '/sandbox/p.txt')\n", "print('x' * 10**7)\n",
    "import ctypes\nctypes.string_at(0)\n", "def f(:\n", "",
]


def _junk(rng: random.Random):
    return rng.choice([rng.choice(NASTY_STRINGS), rng.randint(-5, 5), None, [1, 2], {"a": 1}, 3.5, True])


def cheap_action(rng: random.Random, tools: list[str]) -> str:
    kind = rng.randrange(9)
    name = rng.choice(tools + ["", "exec", "run_tests ", "x" * 100])
    args = {rng.choice(["command", "answer", "path", "content", "old", "new", "x"]): _junk(rng)
            for _ in range(rng.randint(0, 3))}
    if kind == 0:
        body = format_tool_call(name, args) if all(isinstance(v, str) for v in args.values()) else "<tool_call>{"
        cut = rng.randint(0, len(body))
        return body[:cut] + body[cut + 1:]
    if kind == 1:
        return json.dumps({"name": name, "arguments": args}, ensure_ascii=rng.random() < 0.5)
    if kind == 2:
        return rng.choice(["x" * 70_000, format_tool_call("run", {"command": "echo " + "y" * 5_000}),
                           format_tool_call("write_file", {"path": "a.py", "content": "z" * 30_000})])
    if kind == 3:  # refused before any process: empty, NUL, overlong, unknown or wrong arguments
        return format_tool_call(rng.choice(["run", "read_file", "patch_file"]),
                                rng.choice([{"command": ""}, {"command": "ls\x00"}, {"command": 5},
                                            {"path": rng.choice(NASTY_STRINGS[4:8])}, {"path": "../x", "old": "a",
                                                                                     "new": "b"}, {"bogus": "1"}]))
    if kind == 4:
        return '<tool_call>{"name": "run", "arguments": {"command": "\\ud800"}}</tool_call>'
    if kind == 5:
        return "<tool_call>" + "[" * 5_000 + "</tool_call>"
    if kind == 6 and "read_file" in tools:  # host-side file tools: cheap, but they touch real files
        return format_tool_call(rng.choice(["read_file", "list_files"]), {"path": rng.choice(
            ["mathutils.py", "missing.py", "p.txt", ".", "test_core.py"])} if rng.random() < 0.7 else {})
    if kind == 7 and "patch_file" in tools:
        return format_tool_call("patch_file", {"path": "x.py", "old": rng.choice(NASTY_STRINGS[:6]) or "a",
                                               "new": rng.choice(NASTY_STRINGS)})
    return rng.choice(NASTY_STRINGS + ["hello", "Please run ls", "###STOP###"])


def real_action(rng: random.Random, env_id: str) -> list[str]:
    if env_id.endswith("Bash-v0"):
        return [format_tool_call("run", {"command": rng.choice(NASTY_COMMANDS)})]
    module = rng.choice(NASTY_MODULES)
    return [format_tool_call("write_file", {"path": rng.choice(["test_mod.py", "extra.py"]), "content": module}),
            format_tool_call(rng.choice(["run_tests", "submit"]), {})]


def _uid_alive(uid: int | None) -> bool:
    if uid is None:
        return False
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("env_id, n_real", [("sinkflex/Bash-v0", 40), ("sinkflex/CodeRepair-v0", 12)])
def test_adversarial_actions(env_id, n_real, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("unchanged\n")
    rng = random.Random(f"fuzz-{env_id}")
    env = gym.make(env_id, split="train", max_turns=100_000, limits=LIMITS)
    backend = env.unwrapped.backend
    tools = [t["function"]["name"] for t in backend.tools()]
    real_at = set(rng.sample(range(N_ACTIONS), n_real))
    counts = {"actions": 0, "real": 0, "episodes": 0}
    env.reset(seed=0)
    try:
        for i in range(N_ACTIONS):
            batch = real_action(rng, env_id) if i in real_at else [cheap_action(rng, tools)]
            for action in batch:
                obs, reward, terminated, truncated, info = env.step(action)
                counts["actions"] += 1
                counts["real"] += i in real_at
                assert isinstance(obs, str) and len(obs) <= 16_384
                assert isinstance(reward, float) and math.isfinite(reward) and 0.0 <= reward <= 1.0
                if terminated or truncated:
                    assert 0.0 <= info["reward_info"]["verifier"] <= 1.0
                    assert env.step("again")[0].startswith("Error: the episode has ended")
                    counts["episodes"] += 1
                    env.reset(seed=i)
        assert canary.read_text() == "unchanged\n"
        boxes = [b for b in (getattr(backend, "box", None), getattr(backend, "grader", None)) if b is not None]
        assert not any(_uid_alive(b.uid) for b in boxes)
    finally:
        env.close()
    assert counts["actions"] >= N_ACTIONS and counts["real"] >= n_real and counts["episodes"] >= 1, counts
    assert not any(os.path.exists(b.base) for b in boxes)  # closing removes the sandbox folders
