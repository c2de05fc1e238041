"""An exception no handler maps is a 500 `internal_error` in the contract's body, with the request
id, logged with its traceback, and the connection it came on keeps serving: the client's next
request on it is answered (it used to be closed, and the next request failed as if the server
were gone). Real server, in process; the route that raises is the test's own, added to the real
app, since every route of sigmaflight's maps its errors."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.routing import Route

from tests.servers import InProcessServer


async def _boom(request: Request) -> None:
    raise ZeroDivisionError("a bug in a route")


def test_an_unmapped_exception_is_a_500_and_the_connection_keeps_serving() -> None:
    with InProcessServer() as server:
        server.app.router.routes.insert(0, Route("/boom", _boom))
        url = urlsplit(server.rest_url)
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
        try:
            conn.request("GET", "/boom", headers={"x-request-id": "req-boom"})
            sock = conn.sock
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 500
            assert body["error"] == {"type": "internal_error", "message": "ZeroDivisionError: a bug in a route", "details": None}
            conn.request("GET", "/healthz")  # the same connection
            assert conn.sock is sock
            again = conn.getresponse()
            assert again.status == 200, again.read()
            again.read()
            assert r.getheader("x-request-id") == "req-boom"  # and it was counted, below
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        assert 'sigmaflight_http_responses_total{code="500",method="GET"} 1.0' in text
        assert "unhandled error" in server.log_text and "ZeroDivisionError: a bug in a route" in server.log_text
