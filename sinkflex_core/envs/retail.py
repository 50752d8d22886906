"""The retail backend: a simulated store (SQLite), its tools, its customer and its reward.

Reward (as in the public benchmark): 1.0 when the database after the episode hashes to the same
value as the initial database with the task's ground-truth actions replayed on it, and every required
output (e.g. an order's total) appears in some message the agent sent to the customer (lower-case,
commas removed); 0.0 otherwise. Reads never matter; any path to the same final state passes. One
departure: an order status or "not available" counts only in a message that names no other of
those labels (:func:`sinkflex_core.envs.retail_tasks.answer_given`), since the public benchmark's
outputs are mostly numbers, while here a message listing all four statuses would otherwise answer
about a fifth of the tasks without a single tool call.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from importlib import resources

from .base import ToolResult
from .customer import Customer, ScriptedCustomer
from .retail_tasks import SPLITS, answer_given, get_tasks
from .retail_tools import TOOL_SCHEMAS, RetailTools
from .retail_world import RetailWorld, state_hash


def retail_policy() -> str:
    """The agent's system prompt for the retail store."""
    return resources.files(__package__).joinpath("retail_policy.md").read_text(encoding="utf-8")


_EXPECTED: dict[tuple, str] = {}
_EXPECTED_LOCK = threading.Lock()


def expected_hash(world: RetailWorld, split: str, index: int) -> str:
    """Hash of the initial database with the task's ground-truth actions replayed (cached)."""
    key = (world.seed, split, index)
    with _EXPECTED_LOCK:
        if key in _EXPECTED:
            return _EXPECTED[key]
    task = get_tasks(world.seed, split)[index]
    conn = world.new_episode_db()
    tools = RetailTools(conn)
    for action in task["actions"]:
        out = tools.call(action["name"], action["arguments"]).output
        if out.startswith("Error"):
            raise RuntimeError(f"ground truth of {task['task_id']} fails: {action} -> {out}")
    value = state_hash(conn)
    conn.close()
    with _EXPECTED_LOCK:
        _EXPECTED[key] = value
    return value


# Bumped whenever the same episode can score differently: results cached by reward (task screens)
# are only reused under the version they were made with. 2: a status answer must name no other status.
REWARD_VERSION = 2


def outputs_found(outputs: list[str], agent_messages: list[str]) -> list[bool]:
    """For each required output, whether one of the agent's messages gives it (:func:`answer_given`)."""
    return [any(answer_given(o, m) for m in agent_messages) for o in outputs]


class RetailBackend:
    """The store simulator behind ``sinkflex/Retail-v0``.

    ``customer_factory(task) -> Customer`` builds the customer of each episode (scripted by default;
    an LLM-backed customer plugs in here). Splits: ``"train"`` (GRPO), ``"test"`` (held out, other
    users) and ``"synthetic"`` (the training users again, a separate draw: SFT expert data).
    """

    splits = SPLITS

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = ScriptedCustomer):
        self.world = RetailWorld.get(world_seed)
        self.customer_factory = customer_factory
        self._policy = retail_policy()
        self.conn = None
        self.tools_impl: RetailTools | None = None
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
        self.tools_impl = RetailTools(self.conn)
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
        final = state_hash(self.conn)
        expected = expected_hash(self.world, self.split, self.index)
        found = outputs_found(task["outputs"], self.agent_messages)
        db_match = final == expected
        reward = float(db_match and all(found))
        return reward, {"db_match": db_match, "outputs": list(task["outputs"]), "outputs_found": found,
                        "db_changed": final != self.world.initial_hash}

    def integrity_check(self) -> str:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    def state_hash(self) -> str:
        return state_hash(self.conn)

    def close(self) -> None:
        self.tools_impl = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
