"""``sinkflex/AirlineHTTP-v0``: the airline with every tool call going through the project's HTTP
tool server on 127.0.0.1 (:mod:`.http_server`), served with the airline's tool schemas."""

from __future__ import annotations

from .airline import AirlineBackend
from .http_server import HTTPServedBackend


class AirlineHTTPBackend(HTTPServedBackend, AirlineBackend):
    """The airline behind a real HTTP round trip; the server runs from construction to ``close()``.

    The client side is the one the retail store uses, so both worlds speak the same protocol with the
    same error handling and the same lifecycle guarantees."""
