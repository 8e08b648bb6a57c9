"""remnant-serve's API key (`--api-key`, or REMNANT_API_KEY), as SGLang 0.5.18 applies its
own `--api-key` (sglang/srt/utils/auth.py, with no admin key): every route, unknown ones
included, needs `Authorization: Bearer <key>` (the scheme in any case), except paths
starting /health or /metrics, which liveness probes and Prometheus scrapers reach without
a secret, and CORS preflights (OPTIONS). A refused request gets a 401 whose JSON error is
one line saying what was wrong; the key itself is never logged.
"""

from __future__ import annotations

import hmac
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("remnant.serve")

#: Paths (by prefix, as SGLang matches them) served without the key.
OPEN_PREFIXES = ("/health", "/metrics")


def refusal(authorization: bytes | None, key: bytes) -> str | None:
    """Why a request whose Authorization header is `authorization` may not pass (None: it
    may). The comparison takes the same time for every wrong key of a length."""
    if not authorization:
        return "no API key; send the header 'Authorization: Bearer <key>'"
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() != b"bearer" or not token:
        return "the Authorization header is not 'Bearer <key>'"
    if not hmac.compare_digest(token, key):
        return "wrong API key"
    return None


class ApiKeyMiddleware:
    """ASGI middleware that lets through only requests with the key (see the module)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        why = refusal(authorization, self.key)
        if why is None:
            await self.app(scope, receive, send)
            return
        log.info("refused %s %s: %s", scope["method"], scope["path"], why)
        response = JSONResponse({"error": f"Unauthorized: {why}"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
