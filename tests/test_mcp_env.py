"""``sinkflex/MCP-v0`` over the shipped notes server (FastMCP, SQLite, started over stdio and over
streamable HTTP): tools listed from the server, calls forwarded, rewards from Python and command
verifiers, and nothing left running after close."""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import threading
import time

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import DoNothingAgent, format_tool_call, run_episode
from sinkflex_core.envs.examples.notes_mcp import SERVER_MODULE, TASKS_FILE
from sinkflex_core.envs.examples.notes_mcp.expert import NotesExpert
from sinkflex_core.envs.mcp_client import MCPConnection, MCPError
from sinkflex_core.envs.mcp_env import load_tasks, resolve_checker

TASKS, _ = load_tasks(TASKS_FILE)


@pytest.fixture(scope="module")
def env():
    env = gym.make("sinkflex/MCP-v0", split="test")
    yield env
    env.close()


def test_the_tools_come_from_the_server(env):
    obs, info = env.reset(options={"task_index": 0})
    assert obs == TASKS["test"][0]["instruction"]
    names = [t["function"]["name"] for t in info["tools"]]
    assert names == ["add_note", "list_notes", "search_notes", "get_note", "update_note", "delete_note"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in info["tools"]}
    assert params["get_note"]["properties"]["note_id"]["type"] == "integer"  # the server's own schema


def test_the_expert_solves_every_task_and_doing_nothing_solves_none(env):
    for i in range(env.unwrapped.num_tasks):
        messages, reward, info = run_episode(env, NotesExpert(), i)
        assert reward == 1.0, (i, info["reward_info"], messages)
        messages, reward, info = run_episode(env, DoNothingAgent(), i)
        assert reward == 0.0, (i, info["reward_info"])


def test_episodes_do_not_see_each_other(env):
    env.reset(options={"task_index": 0})
    env.step(format_tool_call("add_note", {"title": "stray", "body": "x"}))
    obs, _ = env.reset(options={"task_index": 4})
    listed = json.loads(env.step(format_tool_call("list_notes", {}))[0])
    assert [n["title"] for n in listed] == ["A", "B", "C", "D"]  # the task's setup, nothing else


def test_bad_calls_are_observations(env):
    env.reset(options={"task_index": 1})
    for action, expected in [
        (format_tool_call("get_note", {"note_id": "abc"}), "valid integer"),
        (format_tool_call("get_note", {"note_id": 99}), "no note with id 99"),
        (format_tool_call("reset_store", {}), "unknown tool 'reset_store'"),  # hidden from the agent
        (format_tool_call("nope", {}), "unknown tool 'nope'"),
        (format_tool_call("add_note", {"title": "t", "body": "b" * 3000}), "longer than 2000"),
        ('<tool_call>{"name": "search_notes", "arguments": {"query": "a\\ud800"}}</tool_call>', "lone surrogate"),
        (format_tool_call("get_note", {"note_id": 77}), "no note with id 77"),  # the session survived that
    ]:
        obs, reward, terminated, truncated, info = env.step(action)
        assert obs.startswith("Error") and expected in obs and not terminated, (action, obs)
    # a wrong answer, and the state unchanged by the refusals: the checker scores it 0
    *_, reward, terminated, _, info = env.step("hunter2")
    assert terminated and reward == 0.0


def test_a_python_checker_and_a_failing_checker(tmp_path):
    tasks = [{"instruction": "Say hi.", "expect": "hi"}]
    env = gym.make("sinkflex/MCP-v0", command=[sys.executable, "-m", SERVER_MODULE], tasks=tasks,
                   checker=lambda task, ep: float(ep["answer"] == task["expect"]))
    try:
        for answer, want in (("hi", 1.0), ("hello", 0.0)):
            env.reset(options={"task_index": 0})
            assert env.step(answer)[1] == want
        env.unwrapped.backend._default_checker = "sinkflex_core.envs.examples.notes_mcp.checks:nope"
        env.reset(options={"task_index": 0})
        *_, reward, terminated, _, info = env.step("hi")
        assert reward == 0.0 and "AttributeError" in info["reward_info"]["checker_error"]
    finally:
        env.close()
    with pytest.raises(ValueError, match="checker"):
        resolve_checker(42)


def test_a_command_checker_reads_the_episode_on_stdin():
    check = resolve_checker({"command": ["{python}", "-m", "sinkflex_core.envs.examples.notes_mcp.checks"]})
    task = TASKS["test"][4]
    state = json.dumps([{"title": a["arguments"]["title"], "body": a["arguments"]["body"],
                         "tags": a["arguments"]["tags"]} for a in task["setup"]])
    assert check(task, {"answer": "3", "state": state})[0] == 1.0
    assert check(task, {"answer": "13", "state": state})[0] == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_given_by_url():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # up to 60 s for Python and the SDK to load on a busy machine
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.1)
        env = gym.make("sinkflex/MCP-v0", url=f"http://127.0.0.1:{port}/mcp", tasks=TASKS_FILE, split="test")
        try:
            for i in range(env.unwrapped.num_tasks):
                assert run_episode(env, NotesExpert(), i)[1] == 1.0
        finally:
            env.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _children() -> set[str] | None:
    """Process ids of this process's children (Linux), or None where /proc cannot tell.

    A thread can end between listing /proc/self/task and reading its ``children`` file; such a
    thread has no children left to report, so it is skipped rather than failing the whole read.
    None when no thread's file could be read (a kernel without them): the pid checks are then skipped.
    """
    import os

    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    pids: set[str] = set()
    read = False
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                pids.update(f.read().split())
            read = True
        except OSError:  # the thread ended meanwhile (ENOENT or ESRCH): it has no children to report
            continue
    return pids if read else None


def test_close_ends_the_server_process_and_threads():
    before = {t.ident for t in threading.enumerate()}
    children = _children()
    conn = MCPConnection(command=[sys.executable, "-m", SERVER_MODULE])
    assert conn.call("add_note", {"title": "a", "body": "b"}) == ('{"id": 1}', False)
    server: set[str] = set()
    if children is not None:
        server = _children() - children
        assert len(server) == 1
    conn.close()
    if children is not None:
        assert not server & _children()  # the server process is gone (children of other tests may end too)
    conn.close()
    with pytest.raises(MCPError, match="closed"):
        conn.call("list_notes", {})
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    env = gym.make("sinkflex/MCP-v0")
    env.reset(options={"task_index": 0})
    del env
    gc.collect()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    if children is not None:
        assert not _children() - children  # the env's server ended with the env


def test_a_server_that_does_not_start_is_a_clear_error():
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(MCPError, match="did not start"):
        MCPConnection(command=[sys.executable, "-c", "import sys; sys.exit(3)"], timeout=20)
    with pytest.raises(ValueError, match="exactly one"):
        MCPConnection()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []


def _gone(pids: set[str], seconds: float = 10.0) -> bool:
    """Whether every process of ``pids`` has exited (or is a zombie) within ``seconds``."""

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = set()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.add(pid)
            except OSError:
                continue
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_a_server_that_never_answers_its_start_is_ended_with_the_error():
    before = {t.ident for t in threading.enumerate()}
    children = _children()
    started = time.monotonic()
    with pytest.raises(MCPError, match="did not answer start within 2 s"):
        MCPConnection(command=[sys.executable, "-c", "import time; time.sleep(120)"], timeout=2)
    assert time.monotonic() - started < 15
    if children is not None:
        assert _gone(_children() - children), "the server that never started is still running"
    assert _threads_left(before) == []


def _threads_left(before: set[int], seconds: float = 5.0) -> list[str]:
    """The names of threads started since ``before`` (their idents) still alive after ``seconds``: asyncio's
    child watcher ends its thread only once it has reaped the exited server, a moment after the exit."""
    deadline = time.monotonic() + seconds
    while True:
        left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def test_a_closed_env_is_not_restarted_and_a_failed_reset_ends_the_episode(tmp_path):
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({
        "reset_call": {"name": "reset_store", "arguments": {}}, "state_call": {"name": "list_notes", "arguments": {}},
        "tasks": [{"instruction": "Say a.", "answer": "a"},
                  {"instruction": "Say b.", "answer": "b", "setup": [{"name": "get_note", "arguments": {"note_id": 5}}]}]}))
    env = gym.make("sinkflex/MCP-v0", command=[sys.executable, "-m", SERVER_MODULE], tasks=str(tasks),
                   checker=lambda task, episode: float(episode["answer"] == task["answer"]))
    children = _children()
    try:
        env.reset(options={"task_index": 0})
        with pytest.raises(RuntimeError, match="setup of task"):
            env.reset(options={"task_index": 1})  # its setup reads a note that does not exist
        with pytest.raises(RuntimeError, match="call reset"):
            env.step("a")  # the episode before is over: it is not graded against task 1
        _, info = env.reset(options={"task_index": 0})
        assert info["task_index"] == 0 and env.step("a")[1] == 1.0
    finally:
        env.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.reset(options={"task_index": 0})
    if children is not None:
        assert not _children() - children  # nothing was started by the reset after close


def test_a_server_that_dies_mid_episode_is_an_error_then_restarted():
    import os
    import signal

    children = _children()
    if children is None:
        pytest.skip("needs /proc to find the server process")
    env = gym.make("sinkflex/MCP-v0")
    try:
        env.reset(options={"task_index": 0})
        server = _children() - children
        assert len(server) == 1
        os.kill(int(next(iter(server))), signal.SIGKILL)
        assert _gone(server)
        obs, reward, terminated, *_ = env.step(format_tool_call("list_notes", {}))
        assert obs.startswith("Error: the MCP server has exited or closed the connection"), obs
        _, reward, terminated, _, info = env.step("My answer.")
        assert terminated and reward == 0.0 and "exited" in info["reward_info"]["state_error"]
        env.reset(options={"task_index": 0})  # a new server for the next episode
        obs, *_ = env.step(format_tool_call("list_notes", {}))
        assert not obs.startswith("Error"), obs
    finally:
        env.close()


@pytest.mark.parametrize("data, message", [
    ({"reset_call": "reset_store", "tasks": [{"instruction": "x"}]}, "'reset_call' must be a tool call"),
    ({"state_call": {"name": "s", "arguments": []}, "tasks": [{"instruction": "x"}]}, "'state_call' must be a tool call"),
    ({"tasks": [{"instruction": "x", "setup": [{"arguments": {}}]}]}, "a setup call of task 0"),
    ({"tasks": [{"instruction": "x", "setup": {"name": "a"}}]}, "'setup' must be a list"),
    ({"tasks": [{"instruction": 3}]}, "no 'instruction' string"),
])
def test_a_malformed_task_file_is_refused_before_any_server_starts(data, message):
    with pytest.raises(ValueError, match=message):
        load_tasks(data)
    children = _children()
    with pytest.raises(ValueError, match=message):
        gym.make("sinkflex/MCP-v0", tasks=data)
    if children is not None:
        assert not _children() - children
