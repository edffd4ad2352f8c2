"""The server's gate, as one ASGI middleware in front of every route. In order:

| check          | refuses                                                         | status |
|----------------|-----------------------------------------------------------------|--------|
| Host           | a Host header naming another site (DNS rebinding)               | 403    |
| Origin         | a browser request from another origin (cross-site forgery), or  | 403    |
|                | without Origin but ``Sec-Fetch-Site`` naming another site (an   |        |
|                | ``<img>`` or link to a GET route)                               |        |
| API key        | with ``--api-key``: no or a wrong ``Authorization: Bearer``     | 401    |
| admin          | admin routes without ``--admin-token`` on a non-loopback bind    | 403    |
|                | (unless ``--insecure-admin``); with a token, a wrong or no one  | 401    |
| Content-Type   | a POST with a body that is not ``application/json``             | 415    |
| body size      | a body over ``max_body_bytes`` (declared or as it arrives)      | 413    |
| body time      | a body not received within ``body_timeout_s``                   | 408    |
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException as StarletteHTTPException

from dormant.server.errors import error_body
from dormant.server.settings import ServerSettings, is_loopback

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ADMIN_ROUTES = frozenset(
    {
        "/sleep", "/wake_up", "/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
        "/flush_cache", "/pause_generation", "/continue_generation",
        "/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
        "/update_weights_from_tensor", "/init_weights_update_group",
        "/update_weights_from_distributed", "/destroy_weights_update_group",
        "/update_weight_version", "/abort_request", "/init_weight_transfer_engine",
        "/start_weight_update", "/update_weights", "/finish_weight_update",
    }
)  # fmt: skip
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class Refusal(StarletteHTTPException):
    """A refusal with its status and typed name; raised while a route reads its body (size,
    time), FastAPI passes it on to the HTTP error handler as it is."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(status, message)
        self.status, self.kind = status, kind

    def __str__(self) -> str:
        return str(self.detail)


class SecurityMiddleware:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app, self.settings = app, settings
        self._hosts = {h.lower() for h in settings.allowed_hosts} | _LOOPBACK_NAMES
        if not _is_wildcard(settings.host):
            self._hosts.add(settings.host.lower())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_host(headers.get("host", ""))
            self._check_origin(headers.get("origin"), headers.get("sec-fetch-site"))
            self._check_auth(scope["path"], headers.get("authorization"))
            self._check_body(scope["method"], headers)
        except Refusal as refusal:
            await _send_error(send, refusal)
            return
        await self.app(scope, self._limited(receive, send, scope), send)

    # ── checks ───────────────────────────────────────────────────────────────────────────────

    def _is_allowed_host(self, name: str) -> bool:
        name = name.lower().strip("[]")
        if name in self._hosts or "*" in self._hosts:
            return True
        if _is_wildcard(self.settings.host):  # bound everywhere: any address literal
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def _check_host(self, host: str) -> None:
        name = urlsplit(f"//{host}").hostname or ""
        if not self._is_allowed_host(name):
            raise Refusal(
                403,
                "ForbiddenError",
                f"Host {host!r} is not this server's; add it with --allowed-hosts if it "
                "should be (refused to stop DNS-rebinding attacks)",
            )

    def _check_origin(self, origin: str | None, fetch_site: str | None) -> None:
        if origin is None:
            if fetch_site in ("cross-site", "same-site"):  # a browser's no-cors GET
                raise Refusal(
                    403,
                    "ForbiddenError",
                    f"a browser request from another site (Sec-Fetch-Site: {fetch_site}) is "
                    "refused (cross-site request forgery); call this server from a program",
                )
            return
        name = urlsplit(origin).hostname
        if name is None or not self._is_allowed_host(name):
            raise Refusal(
                403,
                "ForbiddenError",
                f"requests from the web origin {origin!r} are refused (cross-site request "
                "forgery); call this server from a program, or add the host with "
                "--allowed-hosts",
            )

    def _check_auth(self, path: str, authorization: str | None) -> None:
        settings = self.settings
        token = None
        if authorization and authorization.lower().startswith("bearer "):
            token = authorization[7:].strip()
        is_admin_token = _same(token, settings.admin_token)
        if settings.api_key is not None and not (_same(token, settings.api_key) or is_admin_token):
            raise Refusal(
                401,
                "UnauthorizedError",
                "this server needs an API key: send 'Authorization: Bearer <key>'",
            )
        if path not in ADMIN_ROUTES:
            return
        if settings.admin_token is not None:
            if not is_admin_token:
                raise Refusal(
                    401,
                    "UnauthorizedError",
                    f"{path} is an admin route: send 'Authorization: Bearer <admin token>' "
                    "(the token given to --admin-token)",
                )
        elif not settings.admin_is_open:
            raise Refusal(
                403,
                "ForbiddenError",
                f"{path} is an admin route and this server listens beyond loopback "
                f"({settings.host}) without an admin token: restart it with --admin-token "
                "(or, knowingly, --insecure-admin)",
            )

    def _check_body(self, method: str, headers: dict[str, str]) -> None:
        length = headers.get("content-length")
        has_body = headers.get("transfer-encoding", "") == "chunked" or (
            length is not None and length.strip() not in ("", "0")
        )
        if method in ("POST", "PUT") and has_body:
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise Refusal(
                    415,
                    "UnsupportedMediaTypeError",
                    f"request bodies must be JSON with 'Content-Type: application/json'; got "
                    f"{media or 'no Content-Type'}",
                )
        if length is not None:
            try:
                declared = int(length)
            except ValueError as error:
                raise Refusal(400, "BadRequestError", "Content-Length is not a number") from error
            if declared > self.settings.max_body_bytes:
                raise _too_large(self.settings.max_body_bytes)

    def _limited(self, receive: Receive, send: Send, scope: Scope) -> Receive:
        """``receive`` with the body's size and arrival time bounded."""
        limit, deadline = self.settings.max_body_bytes, None
        timeout = self.settings.body_timeout_s
        received = 0

        async def limited_receive() -> Message:
            nonlocal received, deadline
            if deadline is None:
                deadline = time.monotonic() + timeout
            if deadline == float("inf"):
                return await receive()
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                message = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                raise _BodyTimeout(timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(limit)
                if not message.get("more_body", False):
                    deadline = float("inf")  # the body is in: later receives wait for disconnect
            return message

        return limited_receive


class _BodyTimeout(Refusal):
    def __init__(self, timeout: float) -> None:
        super().__init__(
            408, "RequestTimeoutError", f"the request body did not arrive within {timeout:g} s"
        )


def _too_large(limit: int) -> Refusal:
    return Refusal(
        413,
        "PayloadTooLargeError",
        f"the request body is larger than this server accepts ({limit} bytes; see "
        "--max-body-bytes)",
    )


def _same(token: str | None, secret: str | None) -> bool:
    if token is None or secret is None:
        return False
    return hmac.compare_digest(token.encode(), secret.encode())


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "") or (not is_loopback(host) and host == "*")


async def _send_error(send: Send, refusal: Refusal) -> None:
    import json

    body = json.dumps(error_body(str(refusal), refusal.kind, refusal.status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
