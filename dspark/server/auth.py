"""The API key's check, before anything reads the request's body.

Pure ASGI middleware (as body_limit.py): a request to a protected route (every `/v1/` route,
/tokenize and /detokenize, and `/metrics` with ServerConfig.require_api_key_for_metrics)
without the key is answered 401 at once, so a client without the key learns that, not what
is wrong with its JSON, and the server parses nothing for it. The header is
`Authorization: Bearer KEY`, the scheme case-insensitive (RFC 7235, section 2.1); a 401
carries `WWW-Authenticate: Bearer` (RFC 6750, section 3). The key is compared in constant time.
"""

from __future__ import annotations

import hmac
import json

from dspark.server.errors import error_body

CHALLENGE = b'Bearer realm="dspark"'


def is_authorised(header: bytes, key: bytes) -> bool:
    """Whether an Authorization header's value carries the key in the Bearer scheme."""
    scheme, _, token = header.partition(b" ")
    is_bearer = scheme.lower() == b"bearer"
    return hmac.compare_digest(token.strip(b" "), key) and is_bearer


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, protect_metrics: bool) -> None:
        self.app = app
        self.key = api_key.encode()
        protected = ("/v1/", "/tokenize", "/detokenize")
        self.protected = (*protected, "/metrics") if protect_metrics else protected

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._is_protected(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"")
            if not is_authorised(header, self.key):
                await _refuse(send)
                return
        await self.app(scope, receive, send)

    def _is_protected(self, path: str) -> bool:
        return any(path.startswith(p) or path == p.rstrip("/") for p in self.protected)


async def _refuse(send) -> None:
    message = "invalid or missing API key (send 'Authorization: Bearer KEY')"
    data = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"www-authenticate", CHALLENGE),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": data})
