"""ASGI middleware that answers before a route runs, in the OpenAI error shape:
`HostCheck` (the Host header must name this server: DNS rebinding) and `BearerAuth` (the
API key on /v1 routes)."""
from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse

from hybridserve.protocol import APIError


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class HostCheck:
    """Every HTTP request's Host header (port aside) must be one of `names` (400 otherwise): a
    page on another site whose name was re-pointed at this address cannot talk to it."""

    def __init__(self, app, names: frozenset[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(given) not in self.names:
                err = APIError(400, "Host header: this server does not answer to that name (see --allowed-hosts)",
                               code="invalid_host")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(header: str) -> str:
    """The name of a Host header, lower case, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


GUARDED = ("/v1", "/debug/")  # path prefixes that need the key (/v1 itself included)


class BearerAuth:
    """Every /v1 and /debug route needs `Authorization: Bearer <key>` (401 otherwise);
    /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(GUARDED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
