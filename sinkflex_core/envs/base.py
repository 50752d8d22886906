"""One Gymnasium interface for every tool environment.

A *backend* is the world (a simulator, a database, an API server): it lists its tools, runs a tool
call, answers a plain-text message (the customer or the task giver), resets itself to a task, renders
its policy and grades the episode. :class:`ToolEnv` wraps any backend into a ``gymnasium.Env`` whose
actions and observations are text, so that a chat model plugs in unchanged. Adding an environment
means writing one backend class (see :class:`ToolBackend`) and one ``register`` call.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Space

# Observations longer than this are cut (and say so); it bounds the shared-memory buffers that
# `make_vec(..., vectorization_mode="async")` allocates per environment.
MAX_TEXT_CHARS = 16_384
# Tool-call payloads larger than this are refused before JSON parsing.
MAX_ACTION_CHARS = 65_536


class AnyText(Space[str]):
    """A space holding any Python string of at most ``max_length`` characters.

    ``gymnasium.spaces.Text`` only accepts characters from a fixed alphabet (letters and digits by
    default); chat text needs every character, JSON punctuation and newlines included.
    """

    def __init__(self, max_length: int = MAX_TEXT_CHARS, seed: int | np.random.Generator | None = None):
        self.max_length = int(max_length)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Random text: printable noise, sometimes shaped like a tool call (exercises both paths)."""
        rng = self.np_random
        n = int(rng.integers(0, 40))
        alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789{}[]\":,#_-.?!\n'"
        noise = "".join(alphabet[i] for i in rng.integers(0, len(alphabet), n))
        if rng.random() < 0.3:
            return '<tool_call>\n{"name": "' + noise.replace('"', "") + '", "arguments": {}}\n</tool_call>'
        return noise

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length


class _SharedTexts(Sequence):
    """A live view of the strings that async workers write into shared memory.

    ``AsyncVectorEnv`` reads its shared buffer once and then returns ``deepcopy`` of that object at
    every step; a snapshot tuple would stay frozen, so the view decodes the buffer on access and a
    deep copy yields a plain tuple of the current strings.
    """

    def __init__(self, shared, n: int, width: int):
        self._shared, self._n, self._width = shared, n, width

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._n)))
        if not -self._n <= i < self._n:
            raise IndexError(i)
        i %= self._n
        buf = np.frombuffer(self._shared.get_obj(), dtype=np.uint8)
        row = buf[i * self._width:(i + 1) * self._width]
        length = int.from_bytes(row[:4].tobytes(), "little")
        return row[4:4 + length].tobytes().decode("utf-8", errors="replace")

    def __deepcopy__(self, memo) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return repr(tuple(self))


def _register_vector_support() -> None:
    """Teach gymnasium's vector utilities to move AnyText through shared memory (async mode)."""
    import multiprocessing as mp

    from gymnasium.vector.utils import shared_memory as shm

    def width(space: AnyText) -> int:
        return 4 * space.max_length + 4  # UTF-8 worst case, plus 4 bytes of length

    def create(space: AnyText, n: int = 1, ctx=mp):
        return ctx.Array("B", n * width(space))

    def read(space: AnyText, shared, n: int = 1):
        return _SharedTexts(shared, n, width(space))

    def write(space: AnyText, index: int, value: str, shared) -> None:
        w = width(space)
        data = value.encode("utf-8")[: w - 4]
        buf = np.frombuffer(shared.get_obj(), dtype=np.uint8)
        row = buf[index * w:(index + 1) * w]
        row[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
        row[4:4 + len(data)] = np.frombuffer(data, dtype=np.uint8)

    shm.create_shared_memory.register(AnyText)(create)
    shm.read_from_shared_memory.register(AnyText)(read)
    shm.write_to_shared_memory.register(AnyText)(write)


_register_vector_support()


# ----------------------------------------------------------------------------------------------
# Parsing what the agent wrote
# ----------------------------------------------------------------------------------------------

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Action:
    """One parsed agent turn.

    ``kind`` is ``"tool"`` (``name`` and ``arguments`` set), ``"message"`` (``content`` is the text
    for the customer) or ``"invalid"`` (``error`` says why; it looked like a tool call but is not one).
    """

    kind: str
    name: str = ""
    arguments: dict = field(default_factory=dict)
    content: str = ""
    error: str = ""


def _short(err: Exception) -> str:
    text = str(err).split(";")[0]
    return text if len(text) <= 120 else text[:120] + "..."


def _tool_from_obj(obj: Any) -> Action:
    if not isinstance(obj, dict):
        return Action("invalid", error="a tool call must be a JSON object with 'name' and 'arguments'")
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI-style wrapper
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Action("invalid", error="the tool call has no 'name' string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return Action("invalid", name=name, error=f"'arguments' is not valid JSON ({err.msg})")
        except RecursionError:
            return Action("invalid", name=name, error="'arguments' is nested too deeply")
        except ValueError as err:  # an integer longer than Python's int-to-string limit
            return Action("invalid", name=name, error=f"'arguments' cannot be read ({_short(err)})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return Action("invalid", name=name, error="'arguments' must be a JSON object")
    return Action("tool", name=name, arguments=args)


def parse_action(text: str) -> Action:
    """Parse an agent turn: a Hermes/Qwen2.5 ``<tool_call>{json}</tool_call>`` block, a bare JSON
    object with ``name`` and ``arguments``, or plain text for the customer.

    >>> parse_action('<tool_call>\\n{"name": "think", "arguments": {"thought": "hi"}}\\n</tool_call>').name
    'think'
    """
    if not isinstance(text, str):
        raise TypeError(f"an action must be a str, got {type(text).__name__}")
    if len(text) > MAX_ACTION_CHARS:
        return Action("invalid", error=f"the action is {len(text)} characters long (limit {MAX_ACTION_CHARS})")
    if "<tool_call>" in text:
        blocks = _TOOL_CALL_RE.findall(text)
        if len(blocks) > 1:
            return Action("invalid", error="one tool call per turn")
        body = blocks[0].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            return Action("invalid", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})")
        except RecursionError:
            return Action("invalid", error="the tool call is nested too deeply")
        except ValueError as err:  # an integer longer than Python's int-to-string limit
            return Action("invalid", error=f"the tool call cannot be read ({_short(err)})")
        return _tool_from_obj(obj)
    stripped = text.strip()
    if stripped.startswith("```"):
        stripped = stripped.strip("`").removeprefix("json").strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            obj = json.loads(stripped)
        except (ValueError, RecursionError):  # not a tool call (JSONDecodeError is a ValueError): a message
            obj = None
        if isinstance(obj, dict) and "name" in obj and ("arguments" in obj or "parameters" in obj):
            return _tool_from_obj(obj)
    return Action("message", content=text)


def format_tool_call(name: str, arguments: dict) -> str:
    """The action text for a tool call, exactly as a Qwen2.5 chat template renders it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedExpert:
    """An expert (oracle) written as a generator: ``_script(first observation)`` yields each action and
    receives the environment's answer to it; once the script is over, ``act`` returns ``fallback``.

    ``reset(observation, info)``, then each turn ``act()`` and ``observe(answer)``, as every agent."""

    fallback = ""

    def _script(self, observation: str) -> Generator[str, str, None]:
        raise NotImplementedError

    def reset(self, observation: str, info: dict | None = None) -> None:
        self._gen = self._script(observation)
        self._next = next(self._gen)

    def act(self, observation: str | None = None, role: str = "user") -> str:
        """The action for the latest observation (the first call returns the reply to the opening)."""
        return self.fallback if self._next is None else self._next

    def observe(self, observation: str) -> None:
        try:
            self._next = self._gen.send(observation)
        except StopIteration:
            self._next = None


# ----------------------------------------------------------------------------------------------
# Backend protocol and the environment
# ----------------------------------------------------------------------------------------------


@dataclass
class ToolResult:
    """A tool's output (``"Error: ..."`` for refusals and bad calls) and whether it ends the episode."""

    output: str
    done: bool = False


@runtime_checkable
class ToolBackend(Protocol):
    """What an environment must provide; one class per world.

    A backend may list its task splits in a ``splits`` attribute (default ``("train", "test")``)."""

    def num_tasks(self, split: str) -> int: ...

    def tools(self) -> list[dict]:
        """OpenAI function schemas ``{"type": "function", "function": {name, description, parameters}}``."""

    def policy(self) -> str:
        """The agent's system prompt."""

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        """Start a task; return the first user message and the task (a JSON-able dict)."""

    def call_tool(self, name: str, arguments: dict) -> ToolResult: ...

    def respond(self, text: str) -> ToolResult:
        """The user's reply to a plain-text agent message (``done`` when the user ends the talk)."""

    def reward(self) -> tuple[float, dict]:
        """The episode's reward in [0, 1] and the details of how it was computed."""

    def close(self) -> None: ...


def _clip(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    note = " ...[cut]"
    return text[: MAX_TEXT_CHARS - len(note)] + note


class ToolEnv(gym.Env):
    """A text-in, text-out Gymnasium environment over a :class:`ToolBackend`.

    The reward is 0.0 on every step but the last one (``terminated`` when the user ends the
    conversation or a tool ends it, ``truncated`` when ``max_turns`` agent turns have been used).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, backend: ToolBackend, split: str = "train", max_turns: int = 30,
                 render_mode: str | None = None):
        splits = tuple(getattr(backend, "splits", ("train", "test")))
        if split not in splits:
            raise ValueError(f"split must be one of {splits}, got {split!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.backend = backend
        self.split = split
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = AnyText()
        self.action_space = AnyText(MAX_ACTION_CHARS)
        self._started = False
        self._done = True
        self._turns = 0
        self._transcript: list[tuple[str, str]] = []
        self.task: dict | None = None

    @property
    def num_tasks(self) -> int:
        return self.backend.num_tasks(self.split)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        options = options or {}
        n = self.num_tasks
        if "task_index" in options and options["task_index"] is not None:
            index = options["task_index"]
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n:
                raise ValueError(f"options['task_index'] must be an int in [0, {n}), got {index!r}")
            index = int(index)
        else:
            index = int(self.np_random.integers(n))
        # from here the episode before is over, also when the backend's reset fails half way (it may
        # have changed the world already): step() then asks for a reset rather than play on
        self._started = False
        obs, task = self.backend.reset(self.split, index)
        self.task = task
        self._started, self._done, self._turns = True, False, 0
        self._transcript = [("user", obs)]
        info = {"task": copy.deepcopy(task), "task_index": index, "tools": self.backend.tools(),
                "policy": self.backend.policy(), "obs_role": "user"}
        return _clip(obs), info

    def step(self, action: str):
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"an action must be a str, got {type(action).__name__}")
        if self._done:
            return ("Error: the episode has ended; call reset() to start a new one", 0.0, True, False,
                    {"obs_role": "tool", "turn": self._turns})
        self._turns += 1
        parsed = parse_action(action)
        self._transcript.append(("assistant", action))
        if parsed.kind == "tool":
            result = self.backend.call_tool(parsed.name, parsed.arguments)
            role = "tool"
        elif parsed.kind == "invalid":
            result, role = ToolResult("Error: " + parsed.error), "tool"
        else:
            result = self.backend.respond(parsed.content)
            role = "user"
        obs = _clip(result.output)
        self._transcript.append((role, obs))
        terminated = bool(result.done)
        truncated = not terminated and self._turns >= self.max_turns
        info: dict[str, Any] = {"obs_role": role, "turn": self._turns, "action_kind": parsed.kind}
        reward = 0.0
        if terminated or truncated:
            self._done = True
            reward, details = self.backend.reward()
            info["reward_info"] = details
        return obs, float(reward), terminated, truncated, info

    def render(self):
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{role}] {text}" for role, text in self._transcript)

    def close(self):
        self.backend.close()
        super().close()


def env_around(backend, env_class: type[ToolEnv] = ToolEnv, **kwargs) -> ToolEnv:
    """``env_class(backend, **kwargs)``, closing the backend if that fails: a bad argument then stops
    the backend's server or removes its sandbox folder instead of leaving a thread, process, socket
    or folder behind."""
    try:
        return env_class(backend, **kwargs)
    except BaseException:
        backend.close()
        raise
