"""``sinkflex/RetailMCP-v0`` and ``sinkflex/AirlineMCP-v0``: a world's tools served by an MCP server (the official SDK's low-level
server over streamable HTTP, on 127.0.0.1 in a thread of the environment) and called by the
environment as an MCP client (:class:`~sinkflex_core.envs.mcp_client.MCPConnection`).

The server lists the world's own tool schemas unchanged and runs the world's own argument checks,
so an episode gives the same transcript and reward as in process. A tool result that ends the
episode (a transfer to a human) says so in the result's ``_meta`` (``sinkflex/done``), which MCP
leaves to each server; a refusal is marked ``isError`` and keeps its ``Error: ...`` text.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable

import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

from .airline import AirlineBackend
from .base import ToolResult
from .http_server import UvicornThread, _weak_call
from .mcp_client import MCPConnection, MCPError, check_sendable
from .retail import RetailBackend
from .retail_tools import ToolError, check_tool_name

DONE_KEY = "sinkflex/done"


def build_mcp_app(schemas: list[dict], call_tool: Callable[[str, dict], ToolResult | None]):
    """The ASGI application of an MCP server (streamable HTTP at ``/mcp``) for ``schemas``.

    ``call_tool`` returns ``None`` once the environment is closing (answered as an error)."""
    server = Server("sinkflex-tools")
    tools = [types.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                        inputSchema=t["function"]["parameters"]) for t in schemas]

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return tools

    # The world checks arguments itself, with the error text its agents are trained on.
    @server.call_tool(validate_input=False)
    async def call(name: str, arguments: dict) -> types.CallToolResult:
        try:
            result = call_tool(name, arguments or {})
        except Exception as err:  # noqa: BLE001 - a tool's bug is an error result, not a dead session
            result = ToolResult(f"Error: the tool failed: {type(err).__name__}")
        if result is None:
            result = ToolResult("Error: the environment is closing")
        return types.CallToolResult(content=[types.TextContent(type="text", text=result.output)],
                                    isError=result.output.startswith("Error"),
                                    _meta={DONE_KEY: True} if result.done else None)

    manager = StreamableHTTPSessionManager(server, json_response=True, stateless=True)

    async def handle(scope, receive, send):
        await manager.handle_request(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with manager.run():
            yield

    from starlette.applications import Starlette
    from starlette.routing import Mount

    return Starlette(routes=[Mount("/mcp", app=handle)], lifespan=lifespan)


def _shut(server: UvicornThread, client: MCPConnection) -> None:
    client.close()
    server.stop()


class MCPServedBackend:
    """Mixin that serves a backend's tools over MCP: ``class XMCPBackend(MCPServedBackend, XBackend)``.

    As :class:`~sinkflex_core.envs.http_server.HTTPServedBackend` does for HTTP: the backend's
    ``call_tool`` becomes an MCP client call, the tool name is checked before any request, and
    ``reset``, ``reward`` and ``close`` hold :attr:`lock` so that no call runs while the state is
    replaced, graded or closed. ``close()`` (or the garbage collector) ends the session, the server
    and both threads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schemas = self.tools()
        self._names = {t["function"]["name"]: t["function"]["parameters"] for t in self._schemas}
        self.lock = threading.Lock()
        self._closing = False
        # (tool, thread) of each call the server ran: proof that calls cross the protocol
        self.served_calls: collections.deque = collections.deque(maxlen=1000)
        self.server = UvicornThread(build_mcp_app(self._schemas, _weak_call(self._serve_call)), lifespan="on",
                                    name="sinkflex-mcp-server")
        try:
            self.client = MCPConnection(url=self.server.url + "/mcp/")
        except BaseException:
            self.server.stop()
            raise
        self._finalizer = weakref.finalize(self, _shut, self.server, self.client)

    def _serve_call(self, name: str, arguments: dict) -> ToolResult | None:
        self.served_calls.append((name, threading.current_thread().name))
        with self.lock:
            if self._closing:
                return None
            return super().call_tool(name, arguments)

    @property
    def url(self) -> str:
        return self.server.url + "/mcp/"

    def reset(self, split: str, task_index: int):
        if self._closing:
            raise RuntimeError("the environment is closed")
        with self.lock:
            return super().reset(split, task_index)

    def reward(self):
        if self._closing:
            raise RuntimeError("the environment is closed")
        with self.lock:
            return super().reward()

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        if self._closing:
            raise RuntimeError("the environment is closed")
        try:
            check_tool_name(name, self._names)
        except ToolError as err:
            return ToolResult(f"Error: {err}")
        try:
            check_sendable(arguments)
        except MCPError:
            # what cannot travel over MCP (a lone surrogate) the world's own check refuses in process,
            # with the words the server would have used
            with self.lock:
                return super().call_tool(name, arguments)
        try:
            result = self.client.call_result(name, arguments)
        except MCPError as err:
            return ToolResult(f"Error: {err}")
        except Exception as err:  # noqa: BLE001 - whatever the session raises, the agent reads an error
            message = getattr(getattr(err, "error", None), "message", None) or type(err).__name__
            return ToolResult(f"Error: the MCP server refused the call ({message})")
        text = "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")
        done = bool((result.meta or {}).get(DONE_KEY))
        return ToolResult(text, done)

    def close(self) -> None:
        if not self._closing:
            with self.lock:
                self._closing = True
            self._finalizer()
            with self.lock:
                super().close()
        else:
            super().close()


class RetailMCPBackend(MCPServedBackend, RetailBackend):
    """The retail store with every tool call going through an MCP server (a real round trip)."""


class AirlineMCPBackend(MCPServedBackend, AirlineBackend):
    """The airline with every tool call going through an MCP server (``sinkflex/AirlineMCP-v0``)."""
