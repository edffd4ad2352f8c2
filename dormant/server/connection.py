"""uvicorn's h11 protocol with a deadline on the request head.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and the number of
connections (``limit_concurrency``), but a client that opens a connection and sends half a
request head is waited for forever. Here every request head (the first on a connection and
each later one) must be complete within ``header_timeout_s``, or the connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    class HeaderTimeoutProtocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_deadline is None and self._is_between_requests():
                self._arm()  # the first bytes of a later request on a kept-alive connection
            super().data_received(data)
            if not self._is_between_requests():
                self._disarm()  # the head is in: the body has its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _is_between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_deadline = self.loop.call_later(header_timeout_s, self._on_deadline)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _on_deadline(self) -> None:
            self._head_deadline = None
            if self._is_between_requests() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
