"""What each world provides, looked up by environment id, so that training, SFT and evaluation code can
take an env id and find that world's tasks and reward version without naming the world.

    >>> world_of("sinkflex/AirlineHTTP-v0").name
    'airline'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """A world's name and the modules (relative to this package) that hold its ``get_tasks(seed,
    split)`` and its ``REWARD_VERSION``. The oracle agent needs no entry: :class:`OracleAgent` picks
    the world's script from the tools it is given."""

    name: str
    tasks_module: str
    reward_module: str

    def get_tasks(self, split: str, seed: int = 0) -> tuple:
        return importlib.import_module(self.tasks_module, __package__).get_tasks(seed, split)

    @property
    def reward_version(self) -> int:
        return importlib.import_module(self.reward_module, __package__).REWARD_VERSION


_RETAIL = World("retail", ".retail_tasks", ".retail")
_AIRLINE = World("airline", ".airline_tasks", ".airline")
WORLDS = {"sinkflex/Retail-v0": _RETAIL, "sinkflex/RetailHTTP-v0": _RETAIL,
          "sinkflex/Airline-v0": _AIRLINE, "sinkflex/AirlineHTTP-v0": _AIRLINE}


def world_of(env_id: str) -> World:
    """The world behind ``env_id``; ``ValueError`` for an id without tasks of this kind."""
    if env_id not in WORLDS:
        raise ValueError(f"no task world is registered for {env_id!r}; known: {sorted(WORLDS)}")
    return WORLDS[env_id]
