"""Tools served by a real HTTP server on 127.0.0.1 (``sinkflex/RetailHTTP-v0``).

API (JSON in, JSON out; every answer, errors included, is a JSON object):

- ``GET /tools`` -> ``200 {"tools": [schemas]}``
- ``POST /tools/<name>`` with body ``{"arguments": {...}}`` -> ``200 {"output": "...", "done": bool}``
  (a tool's refusal is a normal ``"Error: ..."`` output), ``400`` malformed JSON or body, ``404``
  unknown path or tool, ``411`` no Content-Length, ``413`` body too large, ``414`` request line too
  long, ``415`` not JSON, ``422`` arguments that do not fit the tool's schema, ``405`` other methods,
  ``503`` the environment is closing.

The server binds to loopback only, on a port the OS picks. :class:`ToolHTTPServer` serves any tool
set; :class:`HTTPServedBackend` puts it in front of any backend (mix it in before the backend class,
as :class:`RetailHTTPBackend` does): the environment's own tool calls then travel over HTTP like an
agent framework's would, resets and closes wait for the request in flight, and ``close()`` (or the
garbage collector, for an environment nobody closed) stops every thread and frees the port.
"""

from __future__ import annotations

import collections
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote

from .base import ToolResult
from .retail import RetailBackend
from .retail_tools import ToolError, check_arguments, check_tool_name

MAX_BODY = 64 * 1024
# How long close() waits for a request that is running a tool; tools answer in milliseconds.
JOIN_SECONDS = 10.0


class _Handler(BaseHTTPRequestHandler):
    server_version = "sinkflex-tools/1"
    disable_nagle_algorithm = True  # header and body go out as two writes: no 40 ms delayed-ACK stall
    timeout = 5  # a client that sends less than its Content-Length cannot hold a thread forever
    protocol_version = "HTTP/1.1"
    server: ToolHTTPServer

    def log_message(self, format, *args):  # noqa: A002 - keep the test output clean
        pass

    # A connection is busy from the moment its request line is parsed (or an error answer starts)
    # until the answer is out; stop() ends idle connections at once and lets busy ones finish, so
    # that no client ever gets half an answer.
    def handle_one_request(self):
        try:
            super().handle_one_request()
        finally:
            if self.server.mark_connection(self.connection, busy=False):
                self.close_connection = True

    def parse_request(self):
        closing = self.server.mark_connection(self.connection, busy=True)
        ok = super().parse_request()
        if closing:
            self.close_connection = True
        return ok

    def send_error(self, code, message=None, explain=None):
        # The base class answers with an HTML page; clients of this API read JSON only. An unknown
        # method (501) and a bad HTTP version (505) are the client's fault, so they become 4xx.
        code = {501: 405, 505: 400}.get(code, code)
        if self.request_version == "HTTP/0.9":  # not parsed yet: answer with a full status line anyway
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        reason = message or self.responses.get(code, ("error",))[0]
        self._send(code, {"error": reason})

    def _send(self, code: int, payload: dict) -> None:
        self.server.mark_connection(self.connection, busy=True)
        # logged before the answer leaves, so that a client that has its answer also sees the entry
        self.server.log_request_done(str(self.command), getattr(self, "path", ""), code)
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):
        if self.path == "/tools":
            self._send(200, {"tools": self.server.schemas})
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
        except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: also a 5,000-digit integer
            return self._send(400, {"error": "body is not valid JSON (or nested too deeply, or a number too long)"})
        if not isinstance(body, dict) or not isinstance(body.get("arguments", {}), dict):
            return self._send(400, {"error": "body must be {\"arguments\": {...}}"})
        arguments = body.get("arguments", {})
        try:
            check_arguments(name, arguments, self.server.schemas_by_name)
        except ToolError as err:
            return self._send(422 if name in self.server.schemas_by_name else 404, {"error": str(err)})
        try:
            result = self.server.call_tool(name, arguments)
        except Exception as err:  # noqa: BLE001 - a tool's bug must still answer the client in JSON
            return self._send(500, {"error": f"the tool failed: {type(err).__name__}"})
        if result is None:
            self.close_connection = True
            return self._send(503, {"error": "the environment is closing"})
        self._send(200, {"output": result.output, "done": result.done})

    def _reject(self):
        self._send(405, {"error": "method not allowed"})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = _reject


class ToolHTTPServer(ThreadingHTTPServer):
    """Serves ``call_tool(name, arguments) -> ToolResult`` for the tools in ``schemas`` on 127.0.0.1.

    Tool calls run one at a time under :attr:`lock`; whoever changes or closes what the tools work on
    (a reset replacing the database) takes the same lock. Every connection runs in a thread the server
    tracks, so :meth:`stop` can end keep-alive connections and wait for the request in flight.
    :attr:`request_log` keeps ``(method, path, status)`` of the latest answered requests.
    """

    daemon_threads = True

    def __init__(self, schemas: list[dict], call_tool: Callable[[str, dict], ToolResult]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.schemas = schemas
        self.schemas_by_name = {t["function"]["name"]: t["function"]["parameters"] for t in schemas}
        self._call = call_tool
        self.lock = threading.Lock()
        self.request_log: collections.deque = collections.deque(maxlen=1000)
        self._closing = False
        self._conns: dict[socket.socket, list] = {}  # socket -> [thread, busy]
        self._conns_lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="sinkflex-tools-server")
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request, client_address):
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address), daemon=True,
                                  name="sinkflex-tools-request")
        with self._conns_lock:
            if self._closing:
                self.shutdown_request(request)
                return
            self._conns[request] = [thread, False]
        thread.start()

    def mark_connection(self, sock: socket.socket, busy: bool) -> bool:
        """Record whether ``sock`` is in the middle of a request; return whether the server is closing."""
        with self._conns_lock:
            entry = self._conns.get(sock)
            if entry is not None:
                entry[1] = busy
            return self._closing

    def _serve_connection(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except (OSError, ValueError):  # the client went away, or stop() shut the socket under the handler
            pass
        finally:
            with self._conns_lock:
                self._conns.pop(request, None)
            self.shutdown_request(request)

    def handle_error(self, request, client_address):  # only reached for errors outside _serve_connection
        pass

    def log_request_done(self, method: str, path: str, status: int) -> None:
        self.request_log.append((method, path[:200], status))

    def call_tool(self, name: str, arguments: dict) -> ToolResult | None:
        """Run one tool call under the lock; ``None`` once the server is closing."""
        with self.lock:
            if self._closing:
                return None
            return self._call(name, arguments)

    def stop(self) -> None:
        """Stop accepting, end every open connection, wait for their threads, free the port. Idempotent."""
        with self._conns_lock:
            if self._closing and self.socket.fileno() == -1:
                return
            self._closing = True
        me = threading.current_thread()
        if me is not self._thread:
            self.shutdown()  # serve_forever returns (it cannot wait for itself)
        self.server_close()
        with self._conns_lock:
            threads = [thread for thread, _ in self._conns.values()]
            idle = [sock for sock, (_, busy) in self._conns.items() if not busy]
            for sock in idle:  # a keep-alive handler waiting for its next request reads end-of-file
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in threads:  # busy ones finish their answer, then see the server closing
            if thread is not me:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._conns_lock:  # a client still trickling its request in after that is cut off
            late = [(sock, thread) for sock, (thread, _) in self._conns.items() if thread is not me]
        for sock, thread in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            thread.join(timeout=1.0)
        if me is not self._thread:
            self._thread.join(timeout=JOIN_SECONDS)


def _weak_call(method) -> Callable[[str, dict], ToolResult]:
    """``method`` called through a weak reference: the server thread must not keep its backend alive,
    or a dropped environment would never be collected (and its finaliser never run)."""
    ref = weakref.WeakMethod(method)

    def call(name: str, arguments: dict) -> ToolResult:
        bound = ref()
        if bound is None:
            return ToolResult("Error: the environment is closed")
        return bound(name, arguments)

    return call


def _shut(server: ToolHTTPServer, client: http.client.HTTPConnection) -> None:
    client.close()
    if threading.current_thread().name == "sinkflex-tools-request":  # collected inside a request thread
        threading.Thread(target=server.stop, daemon=True).start()
    else:
        server.stop()


class HTTPServedBackend:
    """Mixin that serves a backend's tools over HTTP: ``class XHTTPBackend(HTTPServedBackend, XBackend)``.

    The backend's own ``call_tool`` becomes an HTTP client of the server: the tool name is checked
    before any request (an unknown or oversized name never reaches the network), and any answer that is
    not the expected JSON, or no answer at all, becomes an ``Error: ...`` observation. ``reset``,
    ``reward`` and ``close`` hold the server's lock, so no request runs while the state is replaced,
    read for grading or closed.
    """

    server: ToolHTTPServer | None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._schemas = self.tools()
        self._names = {t["function"]["name"]: t["function"]["parameters"] for t in self._schemas}
        self.server = ToolHTTPServer(self._schemas, _weak_call(self._serve_call))
        host, port = self.server.server_address[:2]
        # keep-alive connection reused across calls, like an agent framework's HTTP client would
        self._client = http.client.HTTPConnection(host, port, timeout=10)
        self._finalizer = weakref.finalize(self, _shut, self.server, self._client)

    def _serve_call(self, name: str, arguments: dict) -> ToolResult:
        """What the server runs for a request: the backend's in-process tool call."""
        return super().call_tool(name, arguments)

    @property
    def url(self) -> str:
        return self.server.url

    def reset(self, split: str, task_index: int):
        with self.server.lock:
            return super().reset(split, task_index)

    def reward(self):
        with self.server.lock:
            return super().reward()

    def call_tool(self, name: str, arguments: dict) -> ToolResult:
        if self.server is None:
            raise RuntimeError("the environment is closed")
        try:
            check_tool_name(name, self._names)
            body = json.dumps({"arguments": arguments}).encode()
        except ToolError as err:
            return ToolResult(f"Error: {err}")
        except (ValueError, TypeError, RecursionError):
            return ToolResult("Error: the arguments cannot be written as JSON")
        if len(body) > MAX_BODY:
            return ToolResult(f"Error: the arguments are larger than {MAX_BODY} bytes")
        path = "/tools/" + quote(name, safe="")
        status, raw = None, b""
        for attempt in range(2):
            try:
                self._client.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                resp = self._client.getresponse()
                status, raw = resp.status, resp.read()
                break
            except (http.client.HTTPException, OSError) as err:
                self._client.close()  # the server closed a kept-alive connection: reconnect once
                if attempt:
                    return ToolResult(f"Error: the tool server did not answer ({type(err).__name__})")
        return _result_from_answer(status, raw)

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self._finalizer()  # stops the server and its threads, once
            with self.server.lock:
                super().close()
            self.server = None
        else:
            super().close()


def _result_from_answer(status: int, raw: bytes) -> ToolResult:
    """The observation for one HTTP answer: the tool's output, or an error for anything unexpected."""
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return ToolResult(f"Error: the tool server answered HTTP {status} with something that is not JSON")
    if not isinstance(payload, dict):
        return ToolResult(f"Error: the tool server answered HTTP {status} with an unexpected JSON value")
    if status == 200 and isinstance(payload.get("output"), str):
        return ToolResult(payload["output"], bool(payload.get("done")))
    error = payload.get("error")
    return ToolResult(f"Error: {error}" if isinstance(error, str) else f"Error: HTTP {status}")


class RetailHTTPBackend(HTTPServedBackend, RetailBackend):
    """The retail store with every tool call going through the HTTP server (a real round trip)."""


def post_raw(url: str, data: bytes, headers: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """Send one raw request (for tests and demos); return ``(status, json body)``."""
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
