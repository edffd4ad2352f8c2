"""vLLM's weight-transfer engine (``weight_transfer_config={"backend": "nccl"}``): the RL
refit API of ``LLM``, ``AsyncLLM`` and vLLM's server, on dormant's weight-update group.

    call                                   what the engine does
    ─────────────────────────────────────  ──────────────────────────────────────────────────
    init_weight_transfer_engine(init_info) every rank joins the trainer's group (rank
                                           ``rank_offset + tp_rank``); ``packed`` and its
                                           buffer size are the group's for every update
    start_weight_update()                  opens a session (checkpoint names only)
    update_weights({"update_info": ...})   receives ``names``' tensors as the trainer
                                           broadcasts them (one by one, or packed in uint8
                                           chunks as vLLM packs them) and writes them
    finish_weight_update(weight_version)   closes the session; names the weights

Each update is one ``update_weights_from_distributed`` request, so what a refusal or a failure
leaves (the weights, the trainer's broadcasts, the group) is that table's
(``worker/update_group.py``); the prefix cache is dropped by the engine on any weight change.
dormant is stricter than vLLM in two places, each with a ``WeightTransferSessionError`` that
says what to do: calls out of that order, and the formats it does not take (kernel-format or
sparse updates; backends other than NCCL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dormant.engine.refits import WeightRefits
from dormant.errors import EngineError
from dormant.vllm_weight_transfer import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    GROUP_NAME,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from dormant.worker.devices import memory_device

_INIT_KEYS = {"master_address", "master_port", "rank_offset", "world_size"}
_INIT_OPTIONAL = {"packed", "packed_buffer_size_bytes", "packed_num_buffers", "backend"}
_UPDATE_KEYS = {"names", "dtype_names", "shapes"}
_UPDATE_OPTIONAL = {
    "packed", "packed_buffer_size_bytes", "packed_num_buffers", "is_checkpoint_format",
}  # fmt: skip


class WeightTransferSessionError(EngineError, ValueError):
    """A weight-transfer call out of order, unconfigured, or with info dormant does not take;
    nothing was received or written."""


@dataclass
class _Group:
    packed: bool
    buffer_bytes: int


def is_update_request(value: Any) -> bool:
    """Whether ``value`` is vLLM's update request (and not a state dict or tensor pairs)."""
    if isinstance(value, WeightTransferUpdateRequest):
        return True
    return (
        isinstance(value, Mapping)
        and set(value) == {"update_info"}
        and isinstance(value["update_info"], Mapping)
    )


class WeightTransfer:
    """The engine's weight-transfer session, over ``refits`` (every rank)."""

    def __init__(self, refits: WeightRefits, config: dict[str, Any] | None, device: str) -> None:
        self._refits, self.config = refits, config
        self._backend = "gloo" if memory_device(device, 0) == "host" else "nccl"
        self._group: _Group | None = None
        self._in_session = False

    def init(self, request: WeightTransferInitRequest | Mapping[str, Any]) -> None:
        if self.config is None:
            raise WeightTransferSessionError(
                "weight transfer is not configured: start the engine with "
                'weight_transfer_config={"backend": "nccl"} (the server: '
                '--weight-transfer-config \'{"backend": "nccl"}\')'
            )
        info = _fields(request, "init_info", WeightTransferInitRequest, _INIT_KEYS, _INIT_OPTIONAL)
        backend = info.get("backend", self._backend)
        if backend != self._backend:
            raise WeightTransferSessionError(
                f"init_info backend={backend!r}, but this engine's ranks use {self._backend!r}"
            )
        group = _Group(
            _flag(info, "packed", False),
            _size(info, "packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES),
        )
        port, offset, world_size = (
            _size(info, k) for k in ("master_port", "rank_offset", "world_size")
        )
        if self._group is not None:
            self._destroy()
        self._refits.init_weights_update_group(
            str(info["master_address"]), port, offset, world_size, GROUP_NAME, backend
        )
        self._group = group

    def start(self, is_checkpoint_format: bool = True) -> None:
        self._check_group()
        if self._in_session:
            raise WeightTransferSessionError(
                "start_weight_update while a weight update is open: call finish_weight_update first"
            )
        if not is_checkpoint_format:
            raise WeightTransferSessionError(
                "is_checkpoint_format=False (weights in the engine's kernel layout) is not "
                "supported: send the checkpoint's names and layout"
            )
        self._in_session = True

    def update(self, request: WeightTransferUpdateRequest | Mapping[str, Any]) -> None:
        """Receives and writes one update; a failure ends the session (as vLLM's), and a
        refusal destroys the group, so the trainer's broadcasts beside it fail, not wait."""
        group = self._check_group()
        try:
            info = _fields(
                request, "update_info", WeightTransferUpdateRequest, _UPDATE_KEYS, _UPDATE_OPTIONAL
            )
            if not self._in_session:
                raise WeightTransferSessionError(
                    "update_weights before start_weight_update: open the session first (and "
                    "finish_weight_update after the last update)"
                )
            if _flag(info, "is_checkpoint_format", True) is not True:
                raise WeightTransferSessionError(
                    "is_checkpoint_format must be true: send the checkpoint's names and layout"
                )
            _check_lists(info)
            packed = _flag(info, "packed", group.packed)
            buffer_bytes = _size(info, "packed_buffer_size_bytes", group.buffer_bytes)
        except WeightTransferSessionError as refusal:
            self._destroy()
            raise WeightTransferSessionError(
                f"{refusal}. Nothing was received or written, and the weight-transfer group "
                "was destroyed so that the trainer's broadcast beside this call fails instead "
                "of waiting: call init_weight_transfer_engine again, beside the trainer's "
                "trainer_init"
            ) from None
        try:
            self._refits.update_weights_from_distributed(
                info["names"], info["dtype_names"], info["shapes"], GROUP_NAME,
                load_format="packed" if packed else None, packed_bytes=buffer_bytes,
            )  # fmt: skip
        except BaseException:
            self._in_session = False
            raise

    def finish(self, weight_version: str | None = None) -> None:
        self._check_group()
        if not self._in_session:
            raise WeightTransferSessionError(
                "finish_weight_update without start_weight_update: nothing to finish"
            )
        self._in_session = False
        if weight_version is not None:
            self._refits.weight_version = weight_version

    def _destroy(self) -> None:
        self._group, self._in_session = None, False
        self._refits.destroy_weights_update_group(GROUP_NAME)

    def _check_group(self) -> _Group:
        if self._group is None:
            raise WeightTransferSessionError(
                "no weight-transfer group: call init_weight_transfer_engine (with the "
                "trainer's trainer_init beside it) first"
            )
        return self._group


def _fields(
    request: Any, key: str, kind: type, required: set[str], optional: set[str]
) -> dict[str, Any]:
    """``request``'s info dict (a vLLM request object, or ``{key: {...}}``); raises for a
    missing or unknown field."""
    if isinstance(request, kind):
        info = getattr(request, key)
    elif isinstance(request, Mapping) and set(request) == {key}:
        info = request[key]
    else:
        raise WeightTransferSessionError(f"expected {kind.__name__} or {{{key!r}: {{...}}}}")
    if not isinstance(info, Mapping):
        raise WeightTransferSessionError(f"{key} must be a dict, got {type(info).__name__}")
    missing, unknown = required - set(info), set(info) - required - optional
    if missing or unknown:
        raise WeightTransferSessionError(
            f"{key}: missing {sorted(missing)}, unknown {sorted(unknown)}; dormant takes "
            f"{sorted(required)} and optionally {sorted(optional)}"
        )
    return dict(info)


def _size(info: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``info[key]`` as an int >= 0 (``default`` when absent); raises for anything else."""
    value = info.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WeightTransferSessionError(f"{key}={value!r}: expected an int >= 0")
    return value


def _flag(info: Mapping[str, Any], key: str, default: bool) -> bool:
    value = info.get(key, default)
    if not isinstance(value, bool):
        raise WeightTransferSessionError(f"{key}={value!r}: expected true or false")
    return value


def _check_lists(info: Mapping[str, Any]) -> None:
    """``names`` and ``dtype_names`` lists of strings and ``shapes`` a list of int lists, of one
    length (what the group must know to receive; values are the worker's to check)."""
    names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
    is_strs = all(
        isinstance(x, list) and all(isinstance(s, str) for s in x) for x in (names, dtypes)
    )
    is_shapes = isinstance(shapes, list) and all(
        isinstance(shape, list | tuple)
        and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        for shape in shapes
    )
    if not (is_strs and is_shapes and len(names) == len(dtypes) == len(shapes)):
        raise WeightTransferSessionError(
            "update_info needs names and dtype_names as lists of strings and shapes as a list "
            "of int lists, all of one length"
        )
