"""The retail tools served by a real HTTP server on 127.0.0.1 (``sinkflex/RetailHTTP-v0``).

API (JSON in, JSON out):

- ``GET /tools`` -> ``200 {"tools": [schemas]}``
- ``POST /tools/<name>`` with body ``{"arguments": {...}}`` -> ``200 {"output": "..."}`` (a tool's
  refusal is a normal ``"Error: ..."`` output), ``400`` malformed JSON or body, ``404`` unknown path or
  tool, ``411`` no Content-Length, ``413`` body too large, ``415`` not JSON, ``422`` arguments that do
  not fit the tool's schema, ``405`` other methods.

The server binds to loopback only, on a port the OS picks; the environment starts it when it is
created and stops it on ``close()``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from .base import ToolResult
from .retail import RetailBackend
from .retail_tools import TOOL_SCHEMAS, ToolError, check_arguments

MAX_BODY = 64 * 1024


class _Handler(BaseHTTPRequestHandler):
    server_version = "sinkflex-tools/1"
    disable_nagle_algorithm = True  # header and body go out as two writes: no 40 ms delayed-ACK stall
    timeout = 5  # a client that sends less than its Content-Length cannot hold a thread forever
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - keep the test output clean
        pass

    def send_error(self, code, message=None, explain=None):
        # The base class answers an unknown method with 501 and a bad HTTP version with 505; both are
        # the client's fault, so they become 4xx like every other malformed request.
        code = {501: 405, 505: 400}.get(code, code)
        super().send_error(code, message, explain)

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/tools":
            self._send(200, {"tools": self.server.tool_schemas})
        elif self.path == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        if not self.path.startswith("/tools/"):
            return self._send(404, {"error": "not found"})
        name = unquote(self.path[len("/tools/"):])
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            return self._send(411, {"error": "Content-Length required"})
        try:
            length = int(length)
        except ValueError:
            self.close_connection = True
            return self._send(400, {"error": "bad Content-Length"})
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            return self._send(413, {"error": f"body larger than {MAX_BODY} bytes"})
        raw = self.rfile.read(length)
        ctype = self.headers.get("Content-Type", "")
        if not ctype.startswith("application/json"):
            return self._send(415, {"error": "Content-Type must be application/json"})
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return self._send(400, {"error": "body is not valid JSON (or nested too deeply)"})
        if not isinstance(body, dict) or not isinstance(body.get("arguments", {}), dict):
            return self._send(400, {"error": "body must be {\"arguments\": {...}}"})
        arguments = body.get("arguments", {})
        try:
            self.server.check_arguments(name, arguments)
        except ToolError as err:
            return self._send(422 if name in self.server.tool_names else 404, {"error": str(err)})
        result = self.server.call_tool(name, arguments)
        self._send(200, {"output": result.output, "done": result.done})

    def _reject(self):
        self._send(405, {"error": "method not allowed"})

    do_PUT = do_DELETE = do_PATCH = _reject


class ToolHTTPServer(ThreadingHTTPServer):
    """Serves ``call_tool`` (set per episode) on 127.0.0.1, one request at a time per database.

    ``tool_schemas`` and ``check_arguments`` describe the world's tools (the retail store's by default)."""

    daemon_threads = True

    def __init__(self, call_tool, tool_schemas: list[dict] = TOOL_SCHEMAS, check_arguments=check_arguments):
        super().__init__(("127.0.0.1", 0), _Handler)
        self._call = call_tool
        self.tool_schemas, self.check_arguments = tool_schemas, check_arguments
        self.tool_names = {t["function"]["name"] for t in tool_schemas}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        with self._lock:  # one SQLite connection: serialise the tool calls
            return self._call(name, arguments)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class RetailHTTPBackend(RetailBackend):
    """The retail store with every tool call going through the HTTP server (a real round trip)."""

    def __init__(self, world_seed: int = 0, **kwargs):
        super().__init__(world_seed, **kwargs)
        self.server = ToolHTTPServer(self._local_call)
        # keep-alive connection reused across calls, like an agent framework's HTTP client would
        import http.client

        host, port = self.server.server_address[:2]
        self._client = http.client.HTTPConnection(host, port, timeout=10)

    def _local_call(self, name: str, arguments: dict) -> ToolResult:
        if self.tools_impl is None:
            return ToolResult("Error: no episode is running")
        return self.tools_impl.call(name, arguments)

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        import http.client
        from urllib.parse import quote

        body = json.dumps({"arguments": arguments}).encode()
        if len(body) > MAX_BODY:
            return ToolResult(f"Error: the arguments are larger than {MAX_BODY} bytes")
        path = "/tools/" + quote(name, safe="")
        for attempt in range(2):
            try:
                self._client.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                resp = self._client.getresponse()
                payload = json.loads(resp.read().decode("utf-8"))
                break
            except (http.client.HTTPException, OSError):
                self._client.close()  # the server closed the connection: reconnect once
                if attempt:
                    raise
        if resp.status == 200:
            return ToolResult(payload["output"], bool(payload.get("done")))
        return ToolResult(f"Error: {payload.get('error', f'HTTP {resp.status}')}")

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self._client.close()
            self.server.stop()
            self.server = None
        super().close()


def post_raw(url: str, data: bytes, headers: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """Send one raw request (for tests and demos); return ``(status, json body)``."""
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
