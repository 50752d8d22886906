"""A synchronous client of one Model Context Protocol server, for environments that step synchronously.

The official SDK (``mcp``) is asyncio; a Gymnasium environment is not. :class:`MCPConnection` runs
the SDK's ``ClientSession`` on a private event loop in a thread of its own and hands each request to
it with ``asyncio.run_coroutine_threadsafe``, waiting at most ``timeout`` seconds for the answer. The
server is a command speaking MCP over stdio (started here, ended by :meth:`MCPConnection.close`) or
the URL of a streamable-HTTP endpoint.

    with MCPConnection(command=["python", "-m", "my_server"]) as mcp:
        schemas = mcp.tools()                    # OpenAI function schemas, as ToolBackend.tools() gives
        text, is_error = mcp.call("add_note", {"title": "x", "body": "y"})
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shlex
import threading
from contextlib import AsyncExitStack
from datetime import timedelta

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

# The longest any single request (start, list, call, close) may take before the caller gets an error.
TIMEOUT_SECONDS = 30.0


class MCPError(RuntimeError):
    """The server could not be reached, did not answer in time, or broke the protocol."""


def check_sendable(arguments) -> None:
    """Raise :class:`MCPError` unless ``arguments`` can be written as UTF-8 JSON."""
    try:
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise MCPError("the arguments are not valid Unicode text (a lone surrogate)") from err
    except (ValueError, TypeError, RecursionError) as err:
        raise MCPError("the arguments cannot be written as JSON") from err


def _text_of(content) -> str:
    """The text of a tool result's content blocks (non-text blocks are named, not dropped silently)."""
    parts = []
    for block in content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    return "\n".join(parts)


class MCPConnection:
    """One initialised MCP client session on a private event loop.

    ``command`` (a list, or a string split like a shell would) starts a stdio server, with ``env``
    added to its environment and its stderr sent to ``errlog`` (discarded by default); ``url`` joins a
    streamable-HTTP server instead. Every public method is synchronous and thread-safe.
    """

    def __init__(self, command: list[str] | str | None = None, url: str | None = None, env: dict | None = None,
                 cwd: str | None = None, timeout: float = TIMEOUT_SECONDS, errlog=None):
        if (command is None) == (url is None):
            raise ValueError("give exactly one of command (a stdio server) or url (a streamable-HTTP server)")
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None and not command:
            raise ValueError("command is empty")
        self.command, self.url, self.timeout = command, url, float(timeout)
        self._env = env
        self._cwd = cwd
        self._own_errlog = errlog is None
        self._errlog = open(os.devnull, "w") if errlog is None else errlog  # noqa: SIM115 - closed in close()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sinkflex-mcp-client")
        self._thread.start()
        self._closed = False
        self._stop: asyncio.Event | None = None
        self._ready: asyncio.Future | None = None
        self._session: ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._broken = False  # the server's end of the session is gone (it exited)
        try:
            self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
            self._wait(asyncio.run_coroutine_threadsafe(self._started(), self._loop), "start")
        except BaseException:
            self.close()
            raise

    # ---- the session's life, all of it in one task (the SDK's cancel scopes require that) ----

    async def _run(self) -> None:
        self._task = asyncio.current_task()
        self._stop = asyncio.Event()
        self._ready = self._loop.create_future()
        try:
            async with AsyncExitStack() as stack:
                if self.command is not None:
                    env = {**os.environ, **(self._env or {})}
                    params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=env,
                                                   cwd=self._cwd)
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=self._errlog))
                else:
                    read, write, _ = await stack.enter_async_context(streamable_http_client(self.url))
                session = await stack.enter_async_context(
                    ClientSession(read, write, read_timeout_seconds=timedelta(seconds=self.timeout)))
                await session.initialize()
                self._session = session
                self._ready.set_result(True)
                await self._stop.wait()
        except BaseException as err:  # noqa: BLE001 - reported to whoever waits for the start
            if not self._ready.done():
                self._ready.set_exception(MCPError(f"the MCP server did not start: {type(err).__name__}: {err}"))
            if not isinstance(err, Exception):
                raise
        finally:
            self._session = None
            if not self._ready.done():
                self._ready.set_exception(MCPError("the MCP server closed the session"))

    async def _started(self) -> None:
        while self._ready is None:
            await asyncio.sleep(0)
        await self._ready

    def _wait(self, future, what: str):
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError as err:  # not the built-in TimeoutError before Python 3.11
            future.cancel()
            raise MCPError(f"the MCP server did not answer {what} within {self.timeout:g} s") from err

    @property
    def alive(self) -> bool:
        """Whether the session is up (not closed, and the server has not ended it)."""
        return not self._closed and self._session is not None and not self._broken

    def _request(self, coro_factory, what: str):
        import anyio

        if self._closed:
            raise MCPError("the MCP connection is closed")
        if self._session is None:
            raise MCPError("the MCP session has ended")
        session = self._session
        try:
            return self._wait(asyncio.run_coroutine_threadsafe(coro_factory(session), self._loop), what)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            self._broken = True
            raise MCPError(f"the MCP server has exited or closed the connection ({what})") from None

    # ---- what the environment uses ----

    def tools(self) -> list[dict]:
        """Every tool of the server (all pages) as OpenAI function schemas."""
        out, cursor = [], None
        for _ in range(1000):  # bounded: a server that pages forever is a broken server
            page = self._request(lambda s, c=cursor: s.list_tools(cursor=c), "tools/list")
            for tool in page.tools:
                out.append({"type": "function", "function": {
                    "name": tool.name, "description": tool.description or "",
                    "parameters": tool.inputSchema or {"type": "object", "properties": {}}}})
            cursor = page.nextCursor
            if not cursor:
                return out
        raise MCPError("the MCP server listed more than 1,000 pages of tools")

    def call_result(self, name: str, arguments: dict):
        """Call one tool; return the SDK's ``CallToolResult`` (``McpError`` for a protocol error).

        Arguments that cannot be sent (text that is not valid Unicode, values that are not JSON) are
        refused here: inside the SDK they would end the session instead of this one call."""
        check_sendable(arguments)
        return self._request(lambda s: s.call_tool(name, arguments), f"the call of {name!r}")

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """Call one tool; return its text and whether the server marked the result as an error.

        A protocol error from the server (an unknown tool, arguments refused before the tool ran)
        comes back as ``(message, True)`` too: for an agent both are refusals it can read."""
        from mcp.shared.exceptions import McpError
        from mcp.types import CONNECTION_CLOSED

        try:
            result = self.call_result(name, arguments)
        except McpError as err:
            if err.error.code == CONNECTION_CLOSED:  # not a refusal: the server is gone
                self._broken = True
                raise MCPError(f"the MCP server has exited or closed the connection (the call of {name!r})") from None
            return str(err.error.message), True
        return _text_of(result.content), bool(result.isError)

    def close(self) -> None:
        """End the session (and the server process it started), stop the loop and its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        main = getattr(self, "_main", None)
        if main is not None:
            if self._session is None:  # the session never started (or has ended): nothing to wait for
                self._cancel_run()
            else:
                try:
                    main.result(timeout=self.timeout)
                except Exception:  # noqa: BLE001 - closing anyway
                    self._cancel_run()
            main.cancel()  # if it never ran
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.timeout)
        if not self._thread.is_alive():
            self._loop.close()
        if self._own_errlog:
            self._errlog.close()

    def _cancel_run(self) -> None:
        """Cancel the session's task and wait for it to unwind: its exit stack ends the server process
        (stopping the loop at once would leave that process running)."""
        task = self._task
        if task is None or task.done() or not self._loop.is_running():
            return

        async def cancel() -> None:
            task.cancel()
            await asyncio.wait([task], timeout=self.timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout=self.timeout + 1)
        except Exception:  # noqa: BLE001 - closing anyway
            pass

    def __enter__(self) -> MCPConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
