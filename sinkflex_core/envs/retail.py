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
REWARD_VERSION = 2


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

    def __init__(self, world_seed: int = 0, customer_factory: Callable[[dict], Customer] = ScriptedCustomer):
        super().__init__(RetailWorld.get(world_seed), customer_factory, retail_policy())


expected_hash = RetailBackend.expected_hash
