"""The airline backend behind ``sinkflex/Airline-v0``: its world (SQLite), tools, customer and reward.

Reward, as in the retail world: 1.0 when the database after the episode hashes to the same value as
the initial database with the task's ground-truth actions replayed on it, and every required answer
appears in some message the agent sent to the customer (:func:`airline_text.answer_given`: numbers as
whole numbers, labels alone in their group); 0.0 otherwise.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from importlib import resources

from .airline_schemas import TOOL_SCHEMAS
from .airline_tasks import SPLITS, get_tasks
from .airline_text import answer_given, identity_text
from .airline_tools import AirlineTools
from .airline_world import AirlineWorld, state_hash
from .base import ToolResult
from .customer import CONFIRM_MARK, MAX_STRIKES, STOP, Customer

# Bumped whenever the same episode can score differently (results cached by reward name it).
REWARD_VERSION = 1


def airline_policy() -> str:
    """The agent's system prompt for the airline."""
    return resources.files(__package__).joinpath("airline_policy.md").read_text(encoding="utf-8")


class AirlineCustomer:
    """Deterministic customer for one airline task: opens with its first request, gives its user id
    when asked, says "yes" only to a confirmation naming everything its request needs, moves on once
    the request is done or answered, and ends with ``###STOP###`` (or gives up after a few misses)."""

    def __init__(self, task: dict):
        self.task, self.requests = task, task["requests"]
        self.index, self.confirmed, self.strikes = 0, False, 0

    def opening(self) -> str:
        return "Hi! " + self.requests[0]["text"]

    def _advance(self) -> tuple[str, bool]:
        self.index, self.confirmed, self.strikes = self.index + 1, False, 0
        if self.index >= len(self.requests):
            return f"Thanks, that is all. {STOP}", True
        return "Thanks. Also: " + self.requests[self.index]["text"], False

    def _strike(self, text: str) -> tuple[str, bool]:
        self.strikes += 1
        if self.strikes > MAX_STRIKES:
            return f"I give up. {STOP}", True
        return text, False

    def reply(self, agent_text: str) -> tuple[str, bool]:
        if self.index >= len(self.requests):
            return STOP, True
        req, low = self.requests[self.index], agent_text.lower()
        if CONFIRM_MARK in low:
            if req["confirm_keys"] and not self.confirmed and all(k.lower() in low for k in req["confirm_keys"]):
                self.confirmed = True
                return "yes", False
            return self._strike("No, that is not what I want. " + req["text"])
        if self.confirmed:
            return self._advance()
        if req["answer_keys"] and all(answer_given(k, agent_text) for k in req["answer_keys"]):
            return self._advance()
        if "user id" in low:
            return self._strike(identity_text(self.task["persona"]))
        return self._strike(req["text"])


_EXPECTED: dict[tuple, str] = {}
_EXPECTED_LOCK = threading.Lock()


def expected_hash(world: AirlineWorld, split: str, index: int) -> str:
    """Hash of the initial database with the task's ground-truth actions replayed (cached)."""
    key = (world.seed, split, index)
    with _EXPECTED_LOCK:
        if key in _EXPECTED:
            return _EXPECTED[key]
    task = get_tasks(world.seed, split)[index]
    if not task["actions"]:
        return world.initial_hash
    conn = world.new_episode_db()
    tools = AirlineTools(conn)
    for action in task["actions"]:
        out = tools.call(action["name"], action["arguments"]).output
        if out.startswith("Error"):
            raise RuntimeError(f"ground truth of {task['task_id']} fails: {action} -> {out}")
    value = state_hash(conn)
    conn.close()
    with _EXPECTED_LOCK:
        _EXPECTED[key] = value
    return value


class AirlineBackend:
    """The airline simulator. ``customer_factory(task) -> Customer`` builds each episode's customer
    (scripted by default). Splits: ``"train"``, ``"test"`` (other users) and ``"synthetic"``."""

    splits = SPLITS

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = AirlineCustomer):
        self.world = AirlineWorld.get(world_seed)
        self.customer_factory = customer_factory
        self._policy = airline_policy()
        self.conn = None
        self.tools_impl: AirlineTools | None = None
        self.split, self.index = "train", 0

    def num_tasks(self, split: str) -> int:
        return len(get_tasks(self.world.seed, split))

    def task(self, split: str, index: int) -> dict:
        return get_tasks(self.world.seed, split)[index]

    def tools(self) -> list[dict]:
        return copy.deepcopy(TOOL_SCHEMAS)

    def policy(self) -> str:
        return self._policy

    def reset(self, split: str, task_index: int) -> tuple[str, dict]:
        if self.conn is not None:
            self.conn.close()
        self.conn = self.world.new_episode_db()
        self.tools_impl = AirlineTools(self.conn)
        self.split, self.index = split, task_index
        task = self.task(split, task_index)
        self.customer = self.customer_factory(task)
        self.agent_messages: list[str] = []
        return self.customer.opening(), task

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        if self.tools_impl is None:
            return ToolResult("Error: no episode is running")
        return self.tools_impl.call(name, arguments)

    def respond(self, text: str) -> ToolResult:
        self.agent_messages.append(text)
        reply, done = self.customer.reply(text)
        return ToolResult(reply, done)

    def reward(self) -> tuple[float, dict]:
        task = self.task(self.split, self.index)
        # an episode that wrote nothing needs no dump of the tables (grading is most of an episode's time)
        final = state_hash(self.conn) if self.conn.total_changes else self.world.initial_hash
        db_match = final == expected_hash(self.world, self.split, self.index)
        found = [any(answer_given(o, m) for m in self.agent_messages) for o in task["outputs"]]
        return float(db_match and all(found)), {"db_match": db_match, "outputs": list(task["outputs"]),
                                                 "outputs_found": found, "db_changed": final != self.world.initial_hash}

    def integrity_check(self) -> str:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    def state_hash(self) -> str:
        return state_hash(self.conn)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
