"""The retail backend: a simulated store (SQLite), its tools, its customer and its reward.

Reward (as in the public benchmark): 1.0 when the database after the episode hashes to the same
value as the initial database with the task's ground-truth actions replayed on it, and every required
output (e.g. an order's total) appears in some message the agent sent to the customer (lower-case,
commas removed); 0.0 otherwise. Any path to the same final state passes. Two departures, both
because the public benchmark's outputs are mostly numbers while most answers here are one of five
labels (an order's status, or "not available"): such a label counts only in a message that names
no other of them (:func:`sinkflex_core.envs.retail_tasks.answer_given`; a message listing all four
statuses would otherwise answer about a fifth of the tasks), and an answer about an order counts only
once the agent has looked that order up (``get_order_details``; a customer-service agent that never
reads the order and always says "the order is delivered" would otherwise earn about one task in nine,
the policy's "never invent facts" broken).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from .customer import Customer, ScriptedCustomer
from .retail_tasks import SPLITS, answer_given, get_tasks
from .retail_tools import TOOL_SCHEMAS, RetailTools
from .retail_world import RetailWorld
from .sqlite_world import SQLiteBackend


def retail_policy() -> str:
    """The agent's system prompt for the retail store."""
    return resources.files(__package__).joinpath("retail_policy.md").read_text(encoding="utf-8")


# Bumped whenever the same episode can score differently: results cached by reward (task screens)
# are only reused under the version they were made with. 2: a status answer must name no other status.
# 3: an answer about an order counts only once the agent has looked that order up.
REWARD_VERSION = 3


class RetailBackend(SQLiteBackend):
    """The store simulator behind ``sinkflex/Retail-v0``.

    ``customer_factory(task) -> Customer`` builds the customer of each episode (scripted by default;
    an LLM-backed customer plugs in here). Splits: ``"train"`` (GRPO), ``"test"`` (held out, other
    users) and ``"synthetic"`` (the training users again, a separate draw: SFT expert data).
    """

    splits = SPLITS
    tools_class = RetailTools
    tool_schemas = TOOL_SCHEMAS
    get_tasks = staticmethod(get_tasks)
    answer_given = staticmethod(answer_given)
    read_tools = {"get_order_details": ("order_id",)}

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = ScriptedCustomer):
        super().__init__(RetailWorld.get(world_seed), customer_factory, retail_policy())

    def required_reads(self, task: dict) -> list[tuple]:
        """Every request answered in words (a status, a total, a refusal) is about an order: that order's
        ``get_order_details``."""
        return [("get_order_details", r["order_id"]) for r in task["requests"] if r["outputs"] and r.get("order_id")]


expected_hash = RetailBackend.expected_hash
