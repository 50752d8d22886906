"""Tool environments behind one Gymnasium interface.

Importing this package registers:

- ``sinkflex/Retail-v0``: a store simulator (state in SQLite) with a scripted customer; its tools are
  called in process. ``sinkflex/RetailHTTP-v0`` serves the same tools with FastAPI on 127.0.0.1 and
  ``sinkflex/RetailMCP-v0`` with an MCP server; the agent sees the same episodes in all three.
- ``sinkflex/Airline-v0``: an airline's reservations desk (state in SQLite), with the same two served
  forms ``sinkflex/AirlineHTTP-v0`` and ``sinkflex/AirlineMCP-v0``.
- ``sinkflex/BankSQL-v0``: answer a question about a bank database with read-only SQL.
- ``sinkflex/Bash-v0`` (shell tasks) and ``sinkflex/CodeRepair-v0`` (fix a bug; hidden tests): commands
  run for real, in a jail (:mod:`.sandbox`, :mod:`.sandbox_envs`).
- ``sinkflex/MCP-v0``: any MCP server (a command or a URL), with tasks and a verifier from a task file.

::

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
    env_around,
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
MCP_ENV_IDS = ("sinkflex/RetailMCP-v0", "sinkflex/AirlineMCP-v0", "sinkflex/MCP-v0")
SANDBOX_ENV_IDS = ("sinkflex/Bash-v0", "sinkflex/CodeRepair-v0")


def _env_around(backend, split: str, max_turns: int, render_mode: str | None) -> ToolEnv:
    """The environment around a backend that already runs a server (:func:`.base.env_around`)."""
    return env_around(backend, split=split, max_turns=max_turns, render_mode=render_mode)


def make_retail_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                    render_mode: str | None = None, customer_factory=None) -> ToolEnv:
    """``sinkflex/Retail-v0``: the store simulator with tools called in process."""
    kwargs = {} if customer_factory is None else {"customer_factory": customer_factory}
    return ToolEnv(RetailBackend(world_seed, **kwargs), split=split, max_turns=max_turns, render_mode=render_mode)


def make_retail_http_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                         render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/RetailHTTP-v0``: the same store, tools served over HTTP on 127.0.0.1."""
    from .http_server import RetailHTTPBackend

    return _env_around(RetailHTTPBackend(world_seed), split, max_turns, render_mode)


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

    return _env_around(AirlineHTTPBackend(world_seed), split, max_turns, render_mode)


def make_retail_mcp_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                        render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/RetailMCP-v0``: the same store, its tools served by an MCP server (streamable HTTP on
    127.0.0.1) and called by the environment as an MCP client."""
    from .mcp_served import RetailMCPBackend

    return _env_around(RetailMCPBackend(world_seed), split, max_turns, render_mode)


def make_airline_mcp_env(split: str = "train", max_turns: int = 30, world_seed: int = 0,
                         render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/AirlineMCP-v0``: the airline, its tools served by an MCP server on 127.0.0.1."""
    from .mcp_served import AirlineMCPBackend

    return _env_around(AirlineMCPBackend(world_seed), split, max_turns, render_mode)


def make_mcp_env(command: list[str] | str | None = None, url: str | None = None, tasks=None, checker=None,
                 split: str = "train", max_turns: int = 20, fresh_server: bool | None = None,
                 env: dict | None = None, timeout: float = 30.0, render_mode: str | None = None) -> ToolEnv:
    """``sinkflex/MCP-v0``: any MCP server (``command`` for stdio, ``url`` for streamable HTTP) with the
    tasks and verifier of a task file (:mod:`.mcp_env`); without a server, the shipped notes example."""
    from .mcp_env import MCPBackend

    backend = MCPBackend(command=command, url=url, tasks=tasks, checker=checker, fresh_server=fresh_server,
                         env=env, timeout=timeout)
    return _env_around(backend, split, max_turns, render_mode)


# env id -> entry point (a function of this package, or module:function)
_ENTRY_POINTS = {
    "sinkflex/Retail-v0": "make_retail_env",
    "sinkflex/RetailHTTP-v0": "make_retail_http_env",
    "sinkflex/BankSQL-v0": "make_bank_env",
    "sinkflex/Airline-v0": "make_airline_env",
    "sinkflex/AirlineHTTP-v0": "make_airline_http_env",
    "sinkflex/RetailMCP-v0": "make_retail_mcp_env",
    "sinkflex/AirlineMCP-v0": "make_airline_mcp_env",
    "sinkflex/MCP-v0": "make_mcp_env",
    "sinkflex/Bash-v0": "sandbox_envs:make_bash_env",
    "sinkflex/CodeRepair-v0": "sandbox_envs:make_code_repair_env",
}


def _register() -> None:
    for env_id, entry in _ENTRY_POINTS.items():
        module, _, function = entry.rpartition(":")
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=f"{__name__}{'.' + module if module else ''}:{function}",
                         disable_env_checker=False)


_register()

from .oracle import (  # noqa: E402
    DoNothingAgent,
    OracleAgent,
    RandomAgent,
    evaluate_agent,
    expert_conversation,
    run_episode,
)

__all__ = [
    "AIRLINE_ENV_IDS", "ENV_IDS", "MCP_ENV_IDS", "SANDBOX_ENV_IDS", "make_airline_mcp_env", "make_mcp_env", "make_retail_mcp_env", "MAX_TEXT_CHARS", "STOP", "DoNothingAgent", "evaluate_agent", "TOOL_NAMES", "WRITE_TOOLS", "Action", "AnyText", "Customer",
    "OracleAgent", "RandomAgent", "RetailBackend", "RetailTools", "RetailWorld", "ScriptedCustomer",
    "ToolBackend", "ToolEnv", "ToolResult", "expected_hash", "expert_conversation", "format_tool_call",
    "get_tasks", "make_airline_env", "make_airline_http_env", "make_bank_env", "make_retail_env", "make_retail_http_env", "parse_action",
    "parse_identity", "parse_request", "pass_at_k", "pass_hat_k", "retail_policy", "run_episode", "state_hash",
]
