"""Tools served over HTTP by FastAPI on uvicorn, on 127.0.0.1 (``sinkflex/RetailHTTP-v0``,
``sinkflex/AirlineHTTP-v0``).

API (JSON in, JSON out; every answer, errors included, is a JSON object; ``/openapi.json`` describes it):

- ``GET /tools`` -> ``200 {"tools": [schemas]}``; ``GET /health`` -> ``200 {"ok": true}``
- ``POST /tools/<name>`` with body ``{"arguments": {...}}`` -> ``200 {"output": "...", "done": bool}``
  (a tool's refusal is a normal ``"Error: ..."`` output), ``400`` malformed JSON, body or HTTP,
  ``404`` unknown path or tool, ``405`` other methods, ``408`` body not sent in time, ``411`` no
  Content-Length, ``413`` body too large, ``415`` not JSON, ``422`` arguments that do not fit the
  tool's schema, ``431`` request head too large, ``500`` a bug in a tool or in the server, ``503``
  the environment is closing.

The request body of each tool is a pydantic model generated from the tool's JSON schema (the one the
agent sees), so the OpenAPI document shows exactly what an agent may send. The arguments themselves are
checked by the same checker the in-process environment uses, so that an HTTP environment gives the
agent the same error text, word for word.

:class:`ToolHTTPServer` serves any tool set from a uvicorn server (its httptools protocol, HTTP parsed
in C) running in a thread of its own;
:class:`HTTPServedBackend` puts it in front of any backend (mix it in before the backend class, as
:class:`RetailHTTPBackend` does): the environment's own tool calls then travel over HTTP (one
kept-alive connection of httpx's HTTP engine, httpcore), resets and closes wait for the request in
flight, and ``close()`` (or the garbage collector, for an environment nobody closed) stops the server
thread and frees the port.
"""

from __future__ import annotations

import asyncio
import collections
import http
import inspect
import json
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import Annotated, Any, Literal

import httpcore
import httptools
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .base import ToolResult
from .retail import RetailBackend
from .retail_tools import ToolError, check_arguments, check_tool_name

MAX_BODY = 64 * 1024
# Request line and headers together; a larger head is answered 431.
MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
# A client that sends less body than its Content-Length announces is answered 408 after this long.
READ_SECONDS = 5.0
# How long close() waits for requests in flight; tools answer in milliseconds.
JOIN_SECONDS = 10.0
START_SECONDS = 20.0

# ----------------------------------------------------------------------------------------------
# Models generated from the tool schemas
# ----------------------------------------------------------------------------------------------


class ToolAnswer(BaseModel):
    """What a tool call returns: the observation text and whether it ends the episode."""

    output: str
    done: bool = False


class ErrorAnswer(BaseModel):
    """Every answer other than 200: a sentence saying what was wrong."""

    error: str


class ToolList(BaseModel):
    tools: list[dict[str, Any]]


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", name) if part) or "Tool"


_SCALARS = {"string": str, "integer": int, "number": float, "boolean": bool}


def _annotation(spec: dict, hint: str):
    """The pydantic type for one JSON schema node (``hint`` names nested models)."""
    kind = spec.get("type")
    if "enum" in spec:
        return Literal[tuple(spec["enum"])]
    if kind in _SCALARS:
        bounds = {k: spec[j] for k, j in (("max_length", "maxLength"), ("min_length", "minLength"),
                                          ("ge", "minimum"), ("le", "maximum")) if j in spec}
        return Annotated[_SCALARS[kind], Field(**bounds)] if bounds else _SCALARS[kind]
    if kind == "array":
        item = _annotation(spec.get("items", {}), hint + "Item")
        return Annotated[list[item], Field(max_length=spec["maxItems"])] if "maxItems" in spec else list[item]
    if kind == "object" and "properties" in spec:
        return model_from_schema(hint, spec)
    return Any


def model_from_schema(name: str, spec: dict) -> type[BaseModel]:
    """A pydantic model with the properties, types, bounds and required keys of JSON schema ``spec``.

    Fields carry the schema's key as their alias, so a key that is no Python name (or that a
    ``BaseModel`` attribute already uses) survives unchanged in the model's own JSON schema."""
    required = set(spec.get("required", ()))
    fields = {}
    for i, (key, sub) in enumerate(spec.get("properties", {}).items()):
        ann = _annotation(sub, name + _camel(key))
        default = ... if key in required else None
        fields[f"field_{i}"] = (ann, Field(default, alias=key, description=sub.get("description")))
    return create_model(name, __config__=ConfigDict(extra="forbid", populate_by_name=False), **fields)


@lru_cache(maxsize=16)
def _call_models(schemas_json: str) -> dict[str, type[BaseModel]]:
    models = {}
    for tool in json.loads(schemas_json):
        fn = tool["function"]
        args = model_from_schema(_camel(fn["name"]) + "Arguments", fn["parameters"])
        models[fn["name"]] = create_model(_camel(fn["name"]) + "Call", __config__=ConfigDict(extra="forbid"),
                                          arguments=(args, Field(default_factory=dict)))
    return models


def call_models(schemas: list[dict]) -> dict[str, type[BaseModel]]:
    """For each tool, the model of its request body ``{"arguments": {...}}`` (cached per tool set)."""
    return _call_models(json.dumps(schemas, sort_keys=True))


# ----------------------------------------------------------------------------------------------
# The application
# ----------------------------------------------------------------------------------------------


def _error(status: int, message: str, close: bool = False) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers={"Connection": "close"} if close else None)


# FastAPI's native OpenTelemetry support checks on every request whether a provider is configured;
# these tools export no traces or metrics.
_NO_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                 if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def build_app(server: ToolHTTPServer) -> FastAPI:
    """The FastAPI application that serves ``server``'s tools (one route per tool)."""
    app = FastAPI(title="sinkflex tools", version="1", docs_url=None, redoc_url=None, **_NO_TELEMETRY,
                  description="The tools of one environment; each call acts on the episode that is running.")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        # a request the API does not know ends its connection, as a malformed one does
        return _error(err.status_code, str(err.detail).lower(), close=True)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        return _error(400, "malformed request")

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception):
        # a bug outside the tools (which answer their own 500): still JSON, in place of Starlette's text
        return _error(500, f"internal error: {type(err).__name__}", close=True)

    @app.get("/tools", response_model=ToolList)
    async def list_tools():
        return JSONResponse({"tools": server.schemas})

    @app.get("/health")
    async def health():
        return JSONResponse({"ok": True})

    errors = {code: {"model": ErrorAnswer} for code in (400, 404, 408, 411, 413, 415, 422, 500, 503)}
    models = call_models(server.schemas)
    for tool in server.schemas:
        name = tool["function"]["name"]
        ref = {"$ref": f"#/components/schemas/{models[name].__name__}"}
        app.router.add_api_route(
            f"/tools/{name}", _tool_endpoint(server, name), methods=["POST"], response_model=ToolAnswer,
            route_class_override=_ToolRoute,
            responses=errors, name=name, summary=tool["function"].get("description", ""),
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}})

    async def unknown_tool(request: Request):
        return _error(404, f"unknown tool {request.path_params['name'][:60]!r}")

    app.add_api_route("/tools/{name:path}", unknown_tool, methods=["POST"], include_in_schema=False)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models.values():
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
    return _guarded(app, server)


async def _body_within(request: Request, seconds: float) -> bytes:
    """The request body, or ``TimeoutError`` when it has not arrived within ``seconds``.

    ``asyncio.wait_for`` would run the read in a task of its own; a timer that cancels this task
    costs next to nothing when the body is already there (the usual case)."""
    task = asyncio.current_task()
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        return await request.body()
    except asyncio.CancelledError:
        if not fired:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this task was cancelled once, by the timer alone
            task.uncancel()
        raise TimeoutError from None
    finally:
        timer.cancel()


class _ToolRoute(APIRoute):
    """A route to a tool: documented like any FastAPI route (its body model, its answers), served by an
    endpoint that reads the request itself. FastAPI's handler would solve dependencies and validate
    the body against the model on every call (more Python calls than the tool itself makes), for a
    check that the argument checker makes anyway (and must make, to give the in-process error text)."""

    def get_route_handler(self):
        return self.endpoint


def _tool_endpoint(server: ToolHTTPServer, name: str):
    async def call(request: Request) -> Response:
        length = request.headers.get("content-length")
        if length is None:
            return _error(411, "Content-Length required", close=True)
        try:
            size = int(length)
        except ValueError:
            return _error(400, "bad Content-Length", close=True)
        if size < 0 or size > MAX_BODY:
            return _error(413, f"body larger than {MAX_BODY} bytes", close=True)
        if not request.headers.get("content-type", "").startswith("application/json"):
            return _error(415, "Content-Type must be application/json")
        try:
            raw = await _body_within(request, READ_SECONDS)
        except TimeoutError:
            return _error(408, f"the body did not arrive within {READ_SECONDS:g} s", close=True)
        except ClientDisconnect:
            return _error(400, "the client went away", close=True)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: also a 5,000-digit integer
            return _error(400, "body is not valid JSON (or nested too deeply, or a number too long)")
        if not isinstance(body, dict) or not isinstance(body.get("arguments", {}), dict) or set(body) - {"arguments"}:
            return _error(400, 'body must be {"arguments": {...}}')
        arguments = body.get("arguments", {})
        try:
            check_arguments(name, arguments, server.schemas_by_name)
        except ToolError as err:
            return _error(422, str(err))
        try:
            result = server.call_tool(name, arguments)
        except Exception as err:  # noqa: BLE001 - a tool's bug must still answer the client in JSON
            return _error(500, f"the tool failed: {type(err).__name__}")
        if result is None:
            return _error(503, "the environment is closing", close=True)
        # the JSON written directly: JSONResponse would build the same bytes through a dict
        return Response(b'{"output":' + json.dumps(result.output, ensure_ascii=False).encode()
                        + (b',"done":true}' if result.done else b',"done":false}'), media_type="application/json")

    call.__name__ = f"call_{name}"
    return call


def _guarded(app: FastAPI, server: ToolHTTPServer):
    """The ASGI application around ``app``: refuses what the parser lets through but this API does not
    speak (other HTTP versions, too many headers, a missing or repeated Host) and logs each answer before
    it leaves, so that a client holding its answer also sees the log entry."""

    async def plain(send, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def guarded(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def logged(message):
            if message["type"] == "http.response.start":
                server.request_log.append((scope["method"], scope["path"][:200], message["status"]))
            await send(message)

        if scope["http_version"] not in ("1.0", "1.1"):
            return await plain(logged, 400, f"HTTP/{scope['http_version'][:10]} is not supported")
        if len(scope["headers"]) > MAX_HEADERS:
            return await plain(logged, 431, f"more than {MAX_HEADERS} header lines")
        hosts = sum(name == b"host" for name, _ in scope["headers"])
        if hosts > 1 or (hosts == 0 and scope["http_version"] == "1.1"):  # RFC 9112, section 3.2
            return await plain(logged, 400, "an HTTP/1.1 request needs exactly one Host header")
        await app(scope, receive, logged)

    guarded.openapi = app.openapi  # reachable for tests and tools that want the document in process
    return guarded


class _OneWriteTransport:
    """A transport that holds an answer's pieces (head, body) and sends them in one write when the
    answer is complete. Each separate write wakes the client, which (in the same process) then
    competes with the server thread for the GIL: one write per answer doubles tool calls per second."""

    def __init__(self, transport):
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._pending.append(data)
        if data.startswith(b"HTTP/1.1 100 ") or sum(map(len, self._pending)) > 65536:  # 100 Continue: now
            self.flush()

    def flush(self) -> None:
        if self._pending:
            data, self._pending = b"".join(self._pending), []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _ParserErrors:
    """The connection's httptools parser, remembering which error its last ``feed_data`` raised (uvicorn
    answers every parser error alike; this API tells an unknown method from a request that is no HTTP)."""

    def __init__(self, parser):
        self._parser = parser
        self.error: Exception | None = None
        self.data = b""

    def feed_data(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self.error, self.data = err, data[:200]
            raise

    def __getattr__(self, name):
        return getattr(self._parser, name)


class _HeadTooLarge(Exception):
    pass


# A request line that is HTTP but for its method: answered 405 like a method FastAPI does not route.
_UNKNOWN_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32} /\S* HTTP/1\.[01]\r?\n")


class _JSONErrorProtocol(HttpToolsProtocol):
    """uvicorn's protocol on the httptools parser (llhttp, in C), with what this API adds: a bound on the
    request head (``MAX_HEAD``, answered 431; httptools has none), JSON answers to requests that are not
    HTTP (uvicorn's are text) and 405 for a method the parser does not know, TCP_NODELAY, and each
    answer leaving in one write (:class:`_OneWriteTransport`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parser = _ParserErrors(self.parser)
        self._head_size = 0  # bytes of the current request's URL and complete headers
        self._head_chunks = 0  # bytes of chunks received wholly inside the current head
        self._in_head = True
        self._began = False

    def connection_made(self, transport):
        super().connection_made(_OneWriteTransport(transport))
        # uvicorn may write an answer's head and body separately: without TCP_NODELAY the body would wait
        # for the client's delayed ACK (40 ms). asyncio sets it only on sockets made with IPPROTO_TCP.
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        inside = self._in_head
        self._began = False
        super().data_received(data)
        if inside and self._in_head and not self._began:  # the whole chunk was part of one head
            self._head_chunks += len(data)
            if self._head_chunks > MAX_HEAD and not self.transport.is_closing():
                self._answer_error(431, "request head too large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = self._head_chunks = 0
        self._in_head = self._began = True

    def _grow_head(self, size: int) -> None:
        self._head_size += size
        if self._head_size > MAX_HEAD:
            raise _HeadTooLarge  # httptools raises it as a parser error: send_400_response answers

    def on_url(self, url: bytes) -> None:
        self._grow_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # The answer leaves when this turn of the event loop is over: the request's task then has
        # finished and the thread is about to wait on its sockets, so the client, woken by the
        # answer, finds the interpreter free instead of waiting for the server thread to let it go.
        self.loop.call_soon(self.transport.flush)
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        err = self.parser.error
        if self._head_size > MAX_HEAD:
            self._answer_error(431, "request head too large")
        elif isinstance(err, httptools.HttpParserInvalidMethodError) and _UNKNOWN_METHOD.match(self.parser.data):
            self._answer_error(405, "method not allowed")
        else:
            self._answer_error(400, "malformed HTTP request")

    def _answer_error(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        reason = http.HTTPStatus(status).phrase.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()


# ----------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------


class UvicornThread:
    """An ASGI application served by uvicorn on 127.0.0.1 (a port the OS picks) in a thread of its own,
    from construction to :meth:`stop`. uvicorn installs no signal handlers outside the main thread."""

    def __init__(self, app, lifespan: str = "off", name: str = "sinkflex-tools-server"):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.server_address = sock.getsockname()[:2]
        config = uvicorn.Config(app, http=_JSONErrorProtocol, lifespan=lifespan, log_config=None,
                                log_level="critical", access_log=False, timeout_graceful_shutdown=JOIN_SECONDS,
                                server_header=False)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True, name=name)
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self._uvicorn.started:
            self.stop()
            raise RuntimeError("the server did not start")

    def _serve(self, sock: socket.socket) -> None:
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            sock.close()

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host}:{port}"

    def stop(self) -> None:
        """Stop accepting, let requests in flight finish (up to ``JOIN_SECONDS``), end the thread. Idempotent."""
        self._uvicorn.should_exit = True
        if threading.current_thread() is not self._thread:  # the server's own thread cannot wait for itself
            self._thread.join(timeout=JOIN_SECONDS + 5)


class ToolHTTPServer:
    """Serves ``call_tool(name, arguments) -> ToolResult`` for the tools in ``schemas`` on 127.0.0.1.

    Tool calls run one at a time under :attr:`lock`; whoever changes or closes what the tools work on
    (a reset replacing the database) takes the same lock. The server runs uvicorn in a thread of its
    own, from construction to :meth:`stop`. :attr:`request_log` keeps ``(method, path, status)`` of
    the latest answered requests.
    """

    def __init__(self, schemas: list[dict], call_tool: Callable[[str, dict], ToolResult]):
        self.schemas = schemas
        self.schemas_by_name = {t["function"]["name"]: t["function"]["parameters"] for t in schemas}
        self._call = call_tool
        self.lock = threading.Lock()
        self.request_log: collections.deque = collections.deque(maxlen=1000)
        self._closing = False
        self.app = build_app(self)
        self._runner = UvicornThread(self.app)
        self.server_address = self._runner.server_address

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host}:{port}"

    def call_tool(self, name: str, arguments: dict) -> ToolResult | None:
        """Run one tool call under the lock; ``None`` once the server is closing."""
        with self.lock:
            if self._closing:
                return None
            return self._call(name, arguments)

    def stop(self) -> None:
        """Refuse new tool calls, let requests in flight finish, stop the thread, free the port. Idempotent.

        Requests that arrive after this point are answered 503 until the listening socket is closed."""
        with self.lock:  # waits for the tool call in flight
            self._closing = True
        self._runner.stop()


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


class _OneWriteStream(httpcore.NetworkStream):
    """A client connection that holds what is written until the answer is read, so that a request's
    head and body leave in one write: the server then wakes once per request instead of twice (in
    the same process each wake-up is also a hand-over of the interpreter between the two threads).
    Above ``MAX_BODY`` the pieces leave at once, as they would without it."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream
        self._pending: list[bytes] = []
        self._size = 0

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._pending.append(buffer)
        self._size += len(buffer)
        if self._size > MAX_BODY:
            self._flush(timeout)

    def _flush(self, timeout: float | None) -> None:
        if self._pending:
            data, self._pending, self._size = b"".join(self._pending), [], 0
            self._stream.write(data, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._flush(timeout)
        return self._stream.read(max_bytes, timeout)

    def close(self) -> None:
        self._pending, self._size = [], 0
        self._stream.close()

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _OneWriteBackend(httpcore.SyncBackend):
    def connect_tcp(self, *args, **kwargs) -> httpcore.NetworkStream:
        return _OneWriteStream(super().connect_tcp(*args, **kwargs))


_SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def _transport() -> httpx.HTTPTransport:
    # httpx writes a request's head and body separately: without TCP_NODELAY the body waits for the
    # server's delayed ACK (40 ms a call on Linux)
    return httpx.HTTPTransport(socket_options=_SOCKET_OPTIONS,
                               limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))


class _ToolConnection:
    """The environment's kept-alive connection to its tool server: one httpcore HTTP/1.1 connection
    (httpx's engine) over the one-write stream above, made again whenever the last one was closed.
    httpcore's pool would check the socket and its own bookkeeping on every call (a fifth of the
    client's work) to share connections that this client never shares."""

    def __init__(self, host: str, port: int):
        self._host, self._port = host, port
        self._origin = httpcore.Origin(b"http", host.encode(), port)
        self._backend = _OneWriteBackend()
        self._conn: httpcore.HTTP11Connection | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._used = 0.0

    def request(self, request: httpcore.Request) -> tuple[int, bytes]:
        """Send ``request``; return the answer's status and body. Any failure closes the connection
        (the next request opens a new one) and raises httpcore's error."""
        with self._lock:
            if self._closed:
                raise httpcore.ConnectError("the client is closed")
            conn = self._conn
            # after a pause the server may have closed the connection (uvicorn: 5 s of silence); a
            # closed socket reads as ready, so look before sending rather than fail and send again
            stale = conn is not None and time.monotonic() - self._used > 1.0 and conn.has_expired()
            if conn is None or stale or not conn.is_idle():
                if conn is not None:
                    conn.close()
                stream = self._backend.connect_tcp(self._host, self._port, timeout=JOIN_SECONDS,
                                                   socket_options=_SOCKET_OPTIONS)
                conn = self._conn = httpcore.HTTP11Connection(origin=self._origin, stream=stream)
            try:
                resp = conn.handle_request(request)
                try:
                    return resp.status, resp.read()
                finally:
                    resp.close()
                    self._used = time.monotonic()
            except BaseException:
                conn.close()
                self._conn = None
                raise

    def close(self) -> None:
        """Close the connection now, without waiting for a request in flight (which then fails)."""
        self._closed = True
        conn = self._conn
        if conn is not None:
            conn.close()


_TIMEOUTS = httpx.Timeout(JOIN_SECONDS).as_dict()


def _shut(server: ToolHTTPServer, client: httpx.Client, connection: _ToolConnection) -> None:
    connection.close()
    client.close()
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
        # The environment's tool calls go to httpx's HTTP engine (httpcore) directly, on one kept-alive
        # connection like an agent framework's: httpx.Client's cookie, redirect and event-hook handling
        # and its request and response wrappers cost more than the tool itself, and none of it applies
        # here. ``http`` is an httpx client of the server for anything else.
        host, port = self.server.server_address
        self._connection = _ToolConnection(host, port)
        self.http = httpx.Client(base_url=self.server.url, timeout=JOIN_SECONDS, trust_env=False, transport=_transport())
        self._host = [(b"Host", f"{host}:{port}".encode()), (b"Content-Type", b"application/json")]
        self._call_url = {name: httpcore.URL(scheme=b"http", host=host.encode(), port=port,
                                             target=f"/tools/{name}".encode()) for name in self._names}
        self._finalizer = weakref.finalize(self, _shut, self.server, self.http, self._connection)

    def _serve_call(self, name: str, arguments: dict) -> ToolResult:
        """What the server runs for a request: the backend's in-process tool call."""
        return super().call_tool(name, arguments)

    @property
    def url(self) -> str:
        return self.server.url

    def reset(self, split: str, task_index: int):
        if self.server is None:
            raise RuntimeError("the environment is closed")
        with self.server.lock:
            return super().reset(split, task_index)

    def reward(self):
        if self.server is None:
            raise RuntimeError("the environment is closed")
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
        for attempt in range(2):
            try:
                headers = [*self._host, (b"Content-Length", str(len(body)).encode())]
                request = httpcore.Request(b"POST", self._call_url[name], headers=headers, content=body,
                                           extensions={"timeout": _TIMEOUTS})
                return _result_from_answer(*self._connection.request(request))
            except httpcore.ReadTimeout:
                # the request went out and may have run (a write): sending it again could run it twice
                return ToolResult(f"Error: the tool server did not answer within {_TIMEOUTS['read']:.0f} s")
            except (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError) as err:
                # the server closed a kept-alive connection before reading the request: once more
                if attempt:
                    return ToolResult(f"Error: the tool server did not answer ({type(err).__name__})")
        raise AssertionError("unreachable")

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self._finalizer()  # stops the server and its thread, once
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


def post_raw(url: str, data: bytes | None, headers: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    """Send one raw request (for tests and demos); return ``(status, json body)``."""
    with httpx.Client(timeout=10, trust_env=False, transport=_transport()) as client:
        resp = client.request(method, url, content=data, headers=headers or {})
    return resp.status_code, json.loads(resp.content or b"{}")
