"""``sinkflex/MCP-v0``: any MCP server as a tool environment, with tasks and a verifier from a file.

The tools are the server's own (listed at start); each tool call is forwarded to the server and its
text comes back as the observation (a result the server marks as an error starts with ``Error:``).
The first observation is the task's instruction; the agent's first plain-text message is its
answer and ends the episode, which the verifier then grades.

A task file is JSON: ``{"tasks": [...]}`` (the same tasks for every split) or ``{"train": [...],
"test": [...]}``, with optional top-level ``checker``, ``state_call`` and ``reset_call``. A task has ``instruction``,
optional ``setup`` (tool calls made at reset, before the agent's first turn), optional ``checker``
(overrides the file's) and anything its checker reads. A checker is either

- a Python callable ``"package.module:function"`` called as ``function(task, episode)``, or
- a command ``{"command": [...]}`` (``"{python}"`` stands for this interpreter) that reads
  ``{"task": ..., "episode": ...}`` as JSON on stdin and prints the reward on its last line.

``episode`` holds ``answer`` (the final message, ``""`` when the episode was cut), ``messages``,
``tool_calls`` (name, arguments, output) and ``state``: the output of ``state_call`` made after the
episode (``None`` without one). A Python checker also gets ``episode["call_tool"](name, arguments)``
to look at the server. A checker returns a reward in [0, 1], or ``(reward, details)``.

Between episodes the server must forget the last one. With a ``reset_call`` (a tool call made at
every ``reset()``; its tool is hidden from the agent and refused if called) the server is kept;
without one, a server started by command is started afresh at every ``reset()`` (seconds: Python
and the SDK load again), and a server given by URL is shared as it is.
"""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

from .base import ToolResult
from .mcp_client import TIMEOUT_SECONDS, MCPConnection, MCPError

CHECK_SECONDS = 60.0

POLICY = """You are an assistant that completes the user's task with the tools you are given.
Call one tool per turn. When the task is done, reply with your final answer in plain text: that
message ends the conversation."""


def load_tasks(source: str | Path | dict | list) -> tuple[dict[str, list[dict]], dict]:
    """The tasks per split and the file's defaults (``checker``, ``state_call``)."""
    data = source
    if isinstance(source, (str, Path)):
        data = json.loads(Path(source).read_text(encoding="utf-8"))
    if isinstance(data, list):
        data = {"tasks": data}
    if not isinstance(data, dict):
        raise ValueError("a task file holds a JSON object or a list of tasks")
    defaults = {k: data[k] for k in ("checker", "state_call", "reset_call") if k in data}
    if "tasks" in data:
        splits = {"train": data["tasks"], "test": data["tasks"]}
    else:
        splits = {k: v for k, v in data.items() if isinstance(v, list)}
    if not splits or any(not tasks for tasks in splits.values()):
        raise ValueError("the task file has no tasks")
    for key in ("state_call", "reset_call"):
        if key in defaults:
            _check_call(defaults[key], f"the task file's {key!r}")
    for split, tasks in splits.items():
        for i, task in enumerate(tasks):
            if not isinstance(task, dict) or not isinstance(task.get("instruction"), str):
                raise ValueError(f"task {i} of split {split!r} has no 'instruction' string")
            setup = task.get("setup", [])
            if not isinstance(setup, list):
                raise ValueError(f"task {i} of split {split!r}: 'setup' must be a list of tool calls")
            for call in setup:
                _check_call(call, f"a setup call of task {i} of split {split!r}")
    return splits, defaults


def _check_call(call, where: str) -> None:
    """A tool call as task files write it: ``{"name": "...", "arguments": {...}}`` (arguments optional)."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments", {}), dict)):
        raise ValueError(f"{where} must be a tool call {{\"name\": \"...\", \"arguments\": {{...}}}}, got {call!r}")


def resolve_checker(spec) -> Callable[[dict, dict], object]:
    """A verifier from its description: a callable, ``"module:function"``, or ``{"command": [...]}``."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        module, _, name = spec.partition(":")
        return getattr(importlib.import_module(module), name)
    if isinstance(spec, dict) and "python" in spec:
        return resolve_checker(spec["python"])
    if isinstance(spec, dict) and "command" in spec:
        return _command_checker(spec["command"])
    raise ValueError(f"a checker is a callable, 'module:function' or {{'command': [...]}}, got {spec!r}")


def _command_checker(command: list[str] | str) -> Callable[[dict, dict], tuple[float, dict]]:
    argv = command.split() if isinstance(command, str) else list(command)
    argv = [sys.executable if a == "{python}" else a for a in argv]

    def check(task: dict, episode: dict) -> tuple[float, dict]:
        payload = json.dumps({"task": task, "episode": {k: v for k, v in episode.items() if k != "call_tool"}})
        proc = subprocess.run(argv, input=payload, capture_output=True, text=True, timeout=CHECK_SECONDS)
        if proc.returncode != 0:
            raise RuntimeError(f"the checker exited with {proc.returncode}: {proc.stderr[-300:]}")
        lines = proc.stdout.strip().splitlines()
        return float(lines[-1]) if lines else 0.0, {"checker_output": proc.stdout[-300:]}

    return check


def _close(holder: dict) -> None:
    conn = holder.pop("conn", None)
    if conn is not None:
        conn.close()


class MCPBackend:
    """A :class:`~sinkflex_core.envs.base.ToolBackend` over one MCP server (see the module docstring)."""

    def __init__(self, command: list[str] | str | None = None, url: str | None = None,
                 tasks: str | Path | dict | list | None = None, checker=None, fresh_server: bool | None = None,
                 env: dict | None = None, timeout: float = TIMEOUT_SECONDS, policy: str = POLICY):
        if command is None and url is None:  # the shipped example
            from .examples.notes_mcp import SERVER_MODULE, TASKS_FILE

            command = [sys.executable, "-m", SERVER_MODULE]
            tasks = TASKS_FILE if tasks is None else tasks
        if tasks is None:
            raise ValueError("give the tasks (a task file, or a list of tasks)")
        self._tasks, defaults = load_tasks(tasks)
        self.splits = tuple(self._tasks)
        self._default_checker = checker if checker is not None else defaults.get("checker")
        self._state_call = defaults.get("state_call")
        self._reset_call = defaults.get("reset_call")
        self._connect = lambda: MCPConnection(command=command, url=url, env=env, timeout=timeout)
        if fresh_server is None:
            fresh_server = self._reset_call is None
        self.fresh_server = bool(fresh_server) and command is not None
        self._command = command is not None
        self._policy = policy
        self._holder: dict = {"conn": self._connect()}
        self._finalizer = weakref.finalize(self, _close, self._holder)
        hidden = {self._reset_call["name"]} if self._reset_call else set()
        self._schemas = [t for t in self._holder["conn"].tools() if t["function"]["name"] not in hidden]
        self._names = {t["function"]["name"] for t in self._schemas}
        self._started = False
        self.split, self.index = self.splits[0], 0
        self.tool_calls: list[dict] = []
        self.agent_messages: list[str] = []

    @property
    def conn(self) -> MCPConnection:
        conn = self._holder.get("conn")
        if conn is None:
            raise RuntimeError("the environment is closed")
        return conn

    def num_tasks(self, split: str) -> int:
        return len(self._tasks[split])

    def task(self, split: str, index: int) -> dict:
        return self._tasks[split][index]

    def tools(self) -> list[dict]:
        return copy.deepcopy(self._schemas)

    def policy(self) -> str:
        return self._policy

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        if not self._finalizer.alive:
            raise RuntimeError("the environment is closed")
        # a fresh server per episode, or a new one for a server started here that has exited
        if (self.fresh_server and self._started) or (self._command and not self.conn.alive):
            old = self._holder.pop("conn", None)
            if old is not None:
                old.close()
            self._holder["conn"] = self._connect()
        self._started = True
        task = self.task(split, task_index)
        self.tool_calls, self.agent_messages = [], []
        for call in ([self._reset_call] if self._reset_call else []) + task.get("setup", []):
            text, is_error = self.conn.call(call["name"], call.get("arguments", {}))
            if is_error:
                raise RuntimeError(f"the setup of task {task.get('id', task_index)} failed: {call} -> {text[:200]}")
        self.split, self.index = split, task_index  # only for a task whose setup went through
        return task["instruction"], task

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        if name not in self._names:
            shown = name if len(name) <= 60 else name[:60] + "..."
            return ToolResult(f"Error: unknown tool {shown!r}")
        try:
            text, is_error = self.conn.call(name, arguments)
        except MCPError as err:
            text, is_error = str(err), True
        except Exception as err:  # noqa: BLE001 - a broken server or session is an observation, not a crash
            text, is_error = f"the MCP server failed ({type(err).__name__})", True
        if is_error and not text.startswith("Error"):
            text = "Error: " + text
        self.tool_calls.append({"name": name, "arguments": arguments, "output": text})
        return ToolResult(text)

    def respond(self, text: str) -> ToolResult:
        self.agent_messages.append(text)
        return ToolResult("Thank you, that is my answer.", done=True)

    def reward(self) -> tuple[float, dict]:
        task = self.task(self.split, self.index)
        state = None
        if self._state_call is not None:
            try:
                state, _ = self.conn.call(self._state_call["name"], self._state_call.get("arguments", {}))
            except MCPError as err:  # no state to grade: the episode scores 0 and says why
                return 0.0, {"state_error": str(err)}
        episode = {"answer": self.agent_messages[-1] if self.agent_messages else "",
                   "messages": list(self.agent_messages), "tool_calls": copy.deepcopy(self.tool_calls),
                   "state": state, "call_tool": lambda n, a: self.conn.call(n, a)[0]}
        spec = task.get("checker", self._default_checker)
        if spec is None:
            raise ValueError("no checker: give one in the task file or as checker=")
        try:
            out = resolve_checker(spec)(copy.deepcopy(task), episode)
        except Exception as err:  # noqa: BLE001 - a failing checker scores 0 and says why
            return 0.0, {"checker_error": f"{type(err).__name__}: {str(err)[:300]}"}
        reward, details = out if isinstance(out, tuple) else (out, {})
        return min(1.0, max(0.0, float(reward))), dict(details)

    def state_hash(self) -> str:
        return "" if self._state_call is None else self.conn.call(self._state_call["name"], {})[0]

    def close(self) -> None:
        self._finalizer()
