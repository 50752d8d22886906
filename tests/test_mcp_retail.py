"""``sinkflex/RetailMCP-v0``: the store's tools behind an MCP server (official SDK), called by the
environment as an MCP client; the same episodes give the same transcripts and rewards as in process."""

from __future__ import annotations

import gc
import threading

import gymnasium as gym
import pytest

import sinkflex_core  # noqa: F401  (registers the environments)
from sinkflex_core.envs import OracleAgent, RandomAgent, RetailWorld, format_tool_call, run_episode
from sinkflex_core.envs.retail_tools import TOOL_SCHEMAS

WORLD = RetailWorld.get(0)


def _threads():
    return {t.ident for t in threading.enumerate()}


@pytest.fixture(scope="module")
def pair():
    remote = gym.make("sinkflex/RetailMCP-v0", split="test")
    local = gym.make("sinkflex/Retail-v0", split="test")
    yield remote, local
    remote.close()
    local.close()


@pytest.mark.parametrize("task_index", [0, 1, 2, 5, 8])
def test_oracle_episodes_match_in_process(pair, task_index):
    remote, local = pair
    messages_mcp, reward_mcp, info_mcp = run_episode(remote, OracleAgent(), task_index)
    messages_local, reward_local, info_local = run_episode(local, OracleAgent(), task_index)
    assert messages_mcp == messages_local
    assert reward_mcp == reward_local == 1.0
    assert info_mcp["reward_info"] == info_local["reward_info"]


def test_random_episodes_match_in_process(pair):
    """Wrong calls, refusals and writes give the same observations, rewards and final database."""
    remote, local = pair
    for seed in range(3):
        a, b = RandomAgent(seed=seed), RandomAgent(seed=seed)
        messages_mcp, reward_mcp, _ = run_episode(remote, a, seed, seed=seed)
        messages_local, reward_local, _ = run_episode(local, b, seed, seed=seed)
        assert messages_mcp == messages_local and reward_mcp == reward_local
        assert remote.unwrapped.backend.state_hash() == local.unwrapped.backend.state_hash()


def test_tools_are_listed_and_called_over_mcp(pair):
    remote, local = pair
    backend = remote.unwrapped.backend
    assert backend.client.tools() == TOOL_SCHEMAS  # the agent's schemas, unchanged by the protocol
    remote.reset(options={"task_index": 0})
    start = len(backend.served_calls)
    order = next(iter(WORLD.data.orders))
    remote.step(format_tool_call("get_order_details", {"order_id": order}))
    remote.step(format_tool_call("get_order_details", {"order_id": 5}))
    remote.step(format_tool_call("no_such_tool", {}))  # refused before any request
    remote.step("Hello, how can I help?")
    calls = list(backend.served_calls)[start:]
    assert [name for name, _ in calls] == ["get_order_details", "get_order_details"]
    assert all(thread == "sinkflex-mcp-server" for _, thread in calls), calls


def test_a_transfer_ends_the_episode_as_in_process(pair):
    remote, _ = pair
    remote.reset(options={"task_index": 0})
    obs, reward, terminated, truncated, info = remote.step(format_tool_call("transfer_to_human_agents",
                                                                            {"summary": "help"}))
    assert terminated and obs == "Transfer successful"


def test_close_and_drop_leave_no_thread():
    before = _threads()
    env = gym.make("sinkflex/RetailMCP-v0", split="train")
    env.reset(options={"task_index": 0})
    env.step(format_tool_call("list_all_product_types", {}))
    env.close()
    env.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        env.unwrapped.backend.call_tool("think", {"thought": "x"})
    env = gym.make("sinkflex/RetailMCP-v0", split="train")
    env.reset(options={"task_index": 0})
    del env
    gc.collect()
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    with pytest.raises(ValueError, match="split must be one of"):
        gym.make("sinkflex/RetailMCP-v0", split="bogus")
    assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []


HOSTILE = [
    '<tool_call>\n{"name": "find_user_id_by_email", "arguments": {"email": "a\\ud800@x.com"}}\n</tool_call>',
    '<tool_call>\n{"name": "think", "arguments": {"thought": ' + "[" * 3000 + "]" * 3000 + '}}\n</tool_call>',
    '<tool_call>\n{"name": "' + "é" * 12000 + '", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "think", "arguments": {"thought": ' + "9" * 5000 + '}}\n</tool_call>',
    format_tool_call("think", {"thought": "y" * 60_000}),
    format_tool_call("get_order_details", {"order_id": "#W" * 3000}),
    format_tool_call("get_order_details", {"order_id": "#W1", "x": [1, {"a": None}]}),
    format_tool_call("get_order_details", {"order_id": None}),
    format_tool_call("calculate", {"expression": "1/0"}),
    format_tool_call("think", {"thought": "\x00"}),
]


def test_hostile_calls_give_the_in_process_observations(pair):
    """Including text that is not valid Unicode: it once ended the MCP session (every later call then
    waited 30 s and failed); now the world's own check refuses it, as in process."""
    remote, local = pair
    for env in (remote, local):
        env.reset(options={"task_index": 0})
    for action in HOSTILE:
        assert remote.step(action)[0] == local.step(action)[0], action[:80]
    order = next(iter(WORLD.data.orders))
    call = format_tool_call("get_order_details", {"order_id": order})
    assert remote.step(call)[0] == local.step(call)[0]  # the session is still alive


@pytest.mark.parametrize("task_index", [0, 3, 7])
def test_the_airline_over_mcp_matches_in_process(task_index):
    """The mixin serves any world: the airline's oracle episodes are the same over MCP."""
    remote = gym.make("sinkflex/AirlineMCP-v0", split="test")
    local = gym.make("sinkflex/Airline-v0", split="test")
    try:
        messages_mcp, reward_mcp, _ = run_episode(remote, OracleAgent(), task_index)
        messages_local, reward_local, _ = run_episode(local, OracleAgent(), task_index)
        assert messages_mcp == messages_local and reward_mcp == reward_local == 1.0
        assert remote.unwrapped.backend.state_hash() == local.unwrapped.backend.state_hash()
        assert {name for name, _ in remote.unwrapped.backend.served_calls} <= {
            t["function"]["name"] for t in remote.unwrapped.backend.tools()}
        assert len(remote.unwrapped.backend.served_calls) > 0
    finally:
        remote.close()
        local.close()
