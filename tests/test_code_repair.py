"""``sinkflex/CodeRepair-v0``: generated tasks, file tools that never follow links, hidden-case grading
that a module cannot talk its way through."""

from __future__ import annotations

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401
from sinkflex_core.envs import format_tool_call
from sinkflex_core.envs.code_repair_tasks import (
    TEMPLATES,
    _run,
    _scope,
    bug_catalogue,
    code_repair_tasks,
    make_task,
)
from sinkflex_core.envs.sandbox import jail_available

JAIL_OK, JAIL_WHY = jail_available()
jailed = pytest.mark.skipif(not JAIL_OK, reason=f"no namespace jail here: {JAIL_WHY}")


def call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


def test_tasks_are_many_distinct_and_split():
    train, test = code_repair_tasks("train"), code_repair_tasks("test")
    assert len(train) >= 400 and len(test) >= 100
    assert len({t["source"] for t in train}) == len(train)
    assert not {t["source"] for t in train} & {t["source"] for t in test}
    assert {t["template"] for t in train} == set(range(len(TEMPLATES)))
    assert make_task(7) == make_task(7)


def test_every_task_shows_its_bug_and_the_fix_passes():
    bad_snippets = [b for b, _ in bug_catalogue()]
    for task in code_repair_tasks("test"):
        bad, good = _scope(task["source"]), _scope(task["fixed_source"])
        hidden = task["hidden"]
        assert all(_run(good, c["function"], tuple(c["args"])) == c["expected"] for c in hidden)
        failing = [c for c in hidden if _run(bad, c["function"], tuple(c["args"])) != c["expected"]]
        assert len(failing) >= 2 and all(c["function"] == task["function"] for c in failing)
        assert any(c in failing for c in task["visible"])
        assert sum(s in task["source"] for s in bad_snippets) >= 1
        assert not any(s in task["fixed_source"] for s in bad_snippets)


@pytest.fixture(scope="module")
def env():
    e = gym.make("sinkflex/CodeRepair-v0", split="test", judge=None)
    yield e
    e.close()


def _start(env, i=0):
    obs, info = env.reset(options={"task_index": i})
    task = env.unwrapped.backend.task
    return task, f"{task['module']}.py"


@jailed
def test_fix_scores_one_and_no_change_scores_the_share_of_passing_cases(env):
    task, path = _start(env, 0)
    share = sum(_run(_scope(task["source"]), c["function"], tuple(c["args"])) == c["expected"]
                for c in task["hidden"]) / len(task["hidden"])
    *_, reward, _, _, info = env.step(call("submit"))
    assert reward == pytest.approx(share) and 0.0 < reward < 1.0, info
    _start(env, 0)
    env.step(call("write_file", path=path, content=task["fixed_source"]))
    obs, *_ = env.step(call("run_tests"))
    assert obs.startswith("exit code: 0") and "0 failed" in obs
    *_, reward, _, _, info = env.step(call("submit"))
    assert reward == 1.0, info


@jailed
@pytest.mark.parametrize("module_text", [
    "import sys\nprint('@@case 0 [\"ok\", 0]')\nsys.exit(0)\n",  # forged result lines, then a clean exit
    "import os\nfor i in range(40):\n    os.write(1, ('@@case %d [\"ok\", 1]\\n' % i).encode())\n",
    "raise SystemExit(0)\n",
    "while True:\n    pass\n",
    "def __getattr__(name):\n    return lambda *a: __import__('os')._exit(0)\n",
    "import os\nos.kill(os.getppid(), 9)\n",
    "syntax error here(\n",
])
def test_forged_results_escapes_and_crashes_earn_nothing(env, module_text):
    """Forged result lines, early exits, hangs and crashes earn exactly what the module's own
    functions earn: none of these modules defines a working ``span``, so every hidden case fails
    (task 3's expected values are never the forged 0 or 1)."""
    task, path = _start(env, 3)
    assert not {0, 1} & {c["expected"] for c in task["hidden"]}
    env.step(call("write_file", path=path, content=module_text))
    *_, reward, terminated, _, info = env.step(call("submit"))
    assert terminated and reward == 0.0, (module_text, info["reward_info"])
    assert info["reward_info"]["passed"] == 0, (module_text, info["reward_info"])


@jailed
def test_file_tools_refuse_links_paths_and_special_files(env, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-only\n")
    task, path = _start(env, 1)
    maker = ("import os\nos.symlink('/etc/passwd', '/sandbox/leak.txt')\n"
             f"os.symlink({str(secret)!r}, '/sandbox/leak2.txt')\nos.mkfifo('/sandbox/pipe')\n")
    env.step(call("write_file", path="maker.py", content=maker))
    env.step(call("write_file", path=f"test_{task['module']}.py", content="import maker\n"))
    obs, *_ = env.step(call("run_tests"))
    assert obs.startswith("exit code: 0"), obs
    for action, message in [
        (call("read_file", path="leak.txt"), "a link"),
        (call("write_file", path="leak2.txt", content="pwned"), "a link"),
        (call("patch_file", path="leak2.txt", old="host", new="pwned"), "a link"),
        (call("read_file", path="pipe"), "not a regular file"),
        (call("read_file", path="../secret.txt"), "plain file name"),
        (call("read_file", path=str(secret)), "plain file name"),
        (call("write_file", path="a/b.py", content="x"), "plain file name"),
        (call("read_file", path="missing.py"), "no file named"),
        (call("patch_file", path=path, old="def ", new="def "), "exactly once"),
        (call("write_file", path=path, content="x" * 30_000), "too long"),
        (call("read_file", path=path, extra="x"), "unexpected argument"),
    ]:
        obs, *_ = env.step(action)
        assert obs.startswith("Error") and message in obs, (action, obs)
    assert secret.read_text() == "host-only\n"
    obs, *_ = env.step(call("list_files"))
    assert {"leak.txt", "pipe", path}.issubset(obs.split())


@jailed
def test_visible_tests_run_under_the_limits(env):
    task, path = _start(env, 2)
    env.step(call("write_file", path=path, content="print('x' * 10**6)\nimport os\nwhile True:\n    os.fork()\n"))
    obs, reward, terminated, truncated, info = env.step(call("run_tests"))
    assert obs.startswith("exit code:") and "[output cut]" in obs and len(obs) < 9_000
    assert not terminated
