"""What the server is allowed to do and how much it accepts: one frozen record, built by
``dormant serve`` from its flags (or directly, in tests)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 16 << 20  # SGLang's tensor refits send base64 tensors in the body
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5
# Sequences (prompts x n) one request may start: a larger batch waits behind nobody, but every
# other client's requests wait behind it.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 4096
# A token is rarely longer than this many characters, so a prompt longer than
# max_model_len * this cannot fit and is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 32


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds only loopback addresses (``localhost`` included)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """The server's security and limits.

    Attributes:
        served_model_names: names a request's ``model`` may use (the first is reported).
        host, port: where uvicorn binds (port 0 picks a free one).
        api_key: when set, every route needs ``Authorization: Bearer <api_key>``.
        admin_token: when set, admin routes (sleep, wake, pause, refit, collective_rpc,
            weight groups, flush) need ``Authorization: Bearer <admin_token>`` (it also
            passes the API key check).
        insecure_admin: allow admin routes without a token on a non-loopback bind.
        allowed_weight_dirs: roots ``/update_weights_from_disk`` may read below; none refuses
            every path.
        allowed_hosts: extra ``Host`` header names accepted besides loopback and the bind.
        max_body_bytes, max_prompt_chars: request size limits (``max_prompt_chars`` None:
            ``max_model_len * MAX_CHARS_PER_TOKEN``).
        max_sequences_per_request: prompts x ``n`` one request may start.
        max_connections: connections served at once (uvicorn's ``limit_concurrency``).
        header_timeout_s, body_timeout_s, keep_alive_s: how long a client may take to send
            its request head, its body, and how long an idle connection stays open.
        sleep_idle_ttl_s: sleep (level 1) after this many idle seconds; None never does.
        auto_wake: a generation request arriving while asleep at level 1 wakes the engine.
    """

    served_model_names: tuple[str, ...]
    host: str = DEFAULT_HOST
    port: int = 8000
    api_key: str | None = None
    admin_token: str | None = None
    insecure_admin: bool = False
    allowed_weight_dirs: tuple[Path, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S
    sleep_idle_ttl_s: float | None = None
    auto_wake: bool = False
    extra: dict[str, str] = field(default_factory=dict)  # shown by /server_info

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names needs at least one name")
        for name in ("max_body_bytes", "max_connections", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.sleep_idle_ttl_s is not None and not self.sleep_idle_ttl_s > 0:
            raise ValueError(f"sleep_idle_ttl_s must be > 0, got {self.sleep_idle_ttl_s}")

    @property
    def is_loopback_only(self) -> bool:
        return is_loopback(self.host)

    @property
    def admin_is_open(self) -> bool:
        """Admin routes work without a token: on a loopback-only bind with no admin token,
        or when ``insecure_admin`` says so explicitly."""
        return self.admin_token is None and (self.is_loopback_only or self.insecure_admin)
