"""The airline backend behind ``sinkflex/Airline-v0``: its world (SQLite), tools, customer and reward.

Reward, as in the retail world: 1.0 when the database after the episode hashes to the same value as
the initial database with the task's ground-truth actions replayed on it, and every required answer
appears in some message the agent sent to the customer (:func:`airline_text.answer_given`: numbers as
whole numbers, labels alone in their group); 0.0 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from .airline_schemas import TOOL_SCHEMAS
from .airline_tasks import SPLITS, get_tasks
from .airline_text import answer_given, identity_text
from .airline_tools import AirlineTools
from .airline_world import AirlineWorld
from .customer import CONFIRM_MARK, MAX_STRIKES, STOP, Customer
from .sqlite_world import SQLiteBackend

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


class AirlineBackend(SQLiteBackend):
    """The airline simulator. ``customer_factory(task) -> Customer`` builds each episode's customer
    (scripted by default). Splits: ``"train"``, ``"test"`` (other users) and ``"synthetic"``."""

    splits = SPLITS
    tools_class = AirlineTools
    tool_schemas = TOOL_SCHEMAS
    get_tasks = staticmethod(get_tasks)
    answer_given = staticmethod(answer_given)

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = AirlineCustomer):
        super().__init__(AirlineWorld.get(world_seed), customer_factory, airline_policy())


expected_hash = AirlineBackend.expected_hash
