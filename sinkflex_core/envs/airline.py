"""The airline backend behind ``sinkflex/Airline-v0``: its world (SQLite), tools, customer and reward.

Reward, as in the retail world: 1.0 when the database after the episode hashes to the same value as
the initial database with the task's ground-truth actions replayed on it, and every required answer
appears in some message the agent sent to the customer (:func:`airline_text.answer_given`: numbers as
whole numbers, labels alone in their group), and the record each answer is about was read in the
episode (the reservation, or the flight's status: :meth:`AirlineBackend.required_reads`); 0.0 otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from .airline_schemas import TOOL_SCHEMAS
from .airline_tasks import SPLITS, get_tasks
from .airline_text import answer_given, identity_text
from .airline_tools import AirlineTools
from .airline_world import AirlineWorld
from .customer import Customer, ScriptedCustomer
from .sqlite_world import SQLiteBackend

# Bumped whenever the same episode can score differently (results cached by reward name it).
# 2: an answer about a reservation or a flight's status counts only once the agent has read it.
REWARD_VERSION = 2


def airline_policy() -> str:
    """The agent's system prompt for the airline."""
    return resources.files(__package__).joinpath("airline_policy.md").read_text(encoding="utf-8")


class AirlineCustomer(ScriptedCustomer):
    """Deterministic customer for one airline task: opens with its first request, gives its user id
    when asked, says "yes" only to a confirmation naming everything its request needs, moves on once
    the request is done or answered, and ends with ``###STOP###`` (or gives up after a few misses);
    the rules of :class:`ScriptedCustomer`, with the airline's way of naming and identifying."""

    def _confirms(self, key: str, agent_text: str) -> bool:
        return key.lower() in agent_text.lower()

    def _answers(self, key: str, agent_text: str) -> bool:
        return answer_given(key, agent_text)

    def _identity(self, low: str) -> str | None:
        return identity_text(self.task["persona"]) if "user id" in low else None


class AirlineBackend(SQLiteBackend):
    """The airline simulator. ``customer_factory(task) -> Customer`` builds each episode's customer
    (scripted by default). Splits: ``"train"``, ``"test"`` (other users) and ``"synthetic"``."""

    splits = SPLITS
    tools_class = AirlineTools
    tool_schemas = TOOL_SCHEMAS
    get_tasks = staticmethod(get_tasks)
    answer_given = staticmethod(answer_given)
    read_tools = {"get_reservation_details": ("reservation_id",), "get_flight_status": ("flight_number", "date")}

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = AirlineCustomer):
        super().__init__(AirlineWorld.get(world_seed), customer_factory, airline_policy())

    def required_reads(self, task: dict) -> list[tuple]:
        """An answer about a reservation (a refusal, a total) needs its ``get_reservation_details``; a
        flight's status its ``get_flight_status`` (a constant "sorry, it is not eligible" would otherwise
        earn about one task in twelve). The cheapest fare, a number found by a search, needs no read."""
        reads = []
        for r in task["requests"]:
            if not r["outputs"]:
                continue
            if r.get("reservation_id"):
                reads.append(("get_reservation_details", r["reservation_id"]))
            elif r["kind"] == "status":
                reads.append(("get_flight_status", r["flight_number"], r["date"]))
        return reads


expected_hash = AirlineBackend.expected_hash
