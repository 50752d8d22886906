"""``sinkflex/AirlineHTTP-v0``: the airline with every tool call going through the project's HTTP
tool server on 127.0.0.1 (:mod:`.http_server`), served with the airline's tool schemas."""

from __future__ import annotations

import http.client

from .airline import AirlineBackend
from .airline_schemas import TOOL_SCHEMAS, check_arguments
from .http_server import RetailHTTPBackend, ToolHTTPServer


class AirlineHTTPBackend(AirlineBackend):
    """The airline behind a real HTTP round trip; the server runs from construction to ``close()``."""

    def __init__(self, world_seed: int = 0, **kwargs):
        super().__init__(world_seed, **kwargs)
        self.server = ToolHTTPServer(self._local_call, TOOL_SCHEMAS, check_arguments)
        host, port = self.server.server_address[:2]
        self._client = http.client.HTTPConnection(host, port, timeout=10)  # kept alive across calls

    # The client side of the round trip is the one the retail store uses, so both worlds speak the
    # same protocol with the same error handling.
    _local_call = RetailHTTPBackend._local_call
    call_tool = RetailHTTPBackend.call_tool
    url = RetailHTTPBackend.url

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self._client.close()
            self.server.stop()
            self.server = None
        super().close()
