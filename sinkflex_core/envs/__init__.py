"""Tool environments behind one Gymnasium interface.

Importing this package registers ``sinkflex/Retail-v0`` (a store simulator, state in SQLite),
``sinkflex/RetailHTTP-v0`` (the same store, its tools served by an HTTP server on 127.0.0.1),
``sinkflex/BankSQL-v0`` (text-to-SQL over a small bank database), ``sinkflex/Airline-v0`` (an airline's
reservations desk, state in SQLite), ``sinkflex/AirlineHTTP-v0`` (the airline over HTTP), and the
executing environments ``sinkflex/Bash-v0`` (shell tasks) and ``sinkflex/CodeRepair-v0`` (fix a bug;
hidden tests), whose commands run in a jail (:mod:`.sandbox`, :mod:`.sandbox_envs`)::

    env = gymnasium.make("sinkflex/Retail-v0", split="train")
    obs, info = env.reset(seed=0, options={"task_index": 3})
    obs, reward, terminated, truncated, info = env.step('<tool_call>\\n{"name": ...}\\n</tool_call>')
"""

from __future__ import annotations

import gymnasium as gym

from .base import (
    MAX_TEXT_CHARS,
    Action,
    AnyText,
    ToolBackend,
    ToolEnv,
    ToolResult,
    format_tool_call,
    parse_action,
)
from .customer import STOP, Customer, ScriptedCustomer
from .metrics import pass_at_k, pass_hat_k
from .retail import RetailBackend, expected_hash, retail_policy
from .retail_tasks import get_tasks, parse_identity, parse_request
from .retail_tools import TOOL_NAMES, WRITE_TOOLS, RetailTools
from .retail_world import RetailWorld, state_hash

ENV_IDS = ("sinkflex/Retail-v0", "sinkflex/RetailHTTP-v0", "sinkflex/BankSQL-v0")
AIRLINE_ENV_IDS = ("sinkflex/Airline-v0", "sinkflex/AirlineHTTP-v0")


def make_retail_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                    render_mode: str | None = None, customer_factory=None) -> ToolEnv:
    """``sinkflex/Retail-v0``: the store simulator with tools called in process."""
    kwargs = {} if customer_factory is None else {"customer_factory": customer_factory}
    return ToolEnv(RetailBackend(world_seed, **kwargs), split=split, max_turns=max_turns, render_mode=render_mode)


def make_retail_http_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                         render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/RetailHTTP-v0``: the same store, tools served over HTTP on 127.0.0.1."""
    from .http_server import RetailHTTPBackend

    backend = RetailHTTPBackend(world_seed)  # its server is running from here on
    try:
        return ToolEnv(backend, split=split, max_turns=max_turns, render_mode=render_mode)
    except BaseException:  # a bad argument: stop the server instead of leaving its thread and socket behind
        backend.close()
        raise


def make_bank_env(split: str = "train", max_turns: int = 12, db_seed: int = 0,
                  render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/BankSQL-v0``: answer a question about a bank database with read-only SQL."""
    from .bank import BankBackend

    return ToolEnv(BankBackend(db_seed), split=split, max_turns=max_turns, render_mode=render_mode)


def make_airline_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                     render_mode: str | None = None, customer_factory=None) -> ToolEnv:
    """``sinkflex/Airline-v0``: the airline with tools called in process."""
    from .airline import AirlineBackend

    kwargs = {} if customer_factory is None else {"customer_factory": customer_factory}
    return ToolEnv(AirlineBackend(world_seed, **kwargs), split=split, max_turns=max_turns, render_mode=render_mode)


def make_airline_http_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                          render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/AirlineHTTP-v0``: the airline, tools served over HTTP on 127.0.0.1."""
    from .airline_http import AirlineHTTPBackend

    backend = AirlineHTTPBackend(world_seed)
    try:
        return ToolEnv(backend, split=split, max_turns=max_turns, render_mode=render_mode)
    except BaseException:  # a bad argument: stop the server instead of leaving its thread and socket behind
        backend.close()
        raise


def _register() -> None:
    for env_id, entry in zip(ENV_IDS + AIRLINE_ENV_IDS, ("make_retail_env", "make_retail_http_env", "make_bank_env",
                                       "make_airline_env", "make_airline_http_env")):
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=f"{__name__}:{entry}", disable_env_checker=False)


_register()

SANDBOX_ENV_IDS = ("sinkflex/Bash-v0", "sinkflex/CodeRepair-v0")


def _register_sandbox() -> None:
    for env_id, entry in zip(SANDBOX_ENV_IDS, ("make_bash_env", "make_code_repair_env")):
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=f"{__name__}.sandbox_envs:{entry}", disable_env_checker=False)


_register_sandbox()

from .oracle import (  # noqa: E402
    DoNothingAgent,
    OracleAgent,
    RandomAgent,
    evaluate_agent,
    expert_conversation,
    run_episode,
)

__all__ = [
    "AIRLINE_ENV_IDS", "ENV_IDS", "MAX_TEXT_CHARS", "STOP", "DoNothingAgent", "evaluate_agent", "TOOL_NAMES", "WRITE_TOOLS", "Action", "AnyText", "Customer",
    "OracleAgent", "RandomAgent", "RetailBackend", "RetailTools", "RetailWorld", "ScriptedCustomer",
    "ToolBackend", "ToolEnv", "ToolResult", "expected_hash", "expert_conversation", "format_tool_call",
    "get_tasks", "make_airline_env", "make_airline_http_env", "make_bank_env", "make_retail_env", "make_retail_http_env", "parse_action",
    "parse_identity", "parse_request", "pass_at_k", "pass_hat_k", "retail_policy", "run_episode", "state_hash",
]
