"""Torch tensors over raw memory whose release is observed exactly.

``tensor_at(address, nbytes, device, on_free)`` returns a 1-D uint8 tensor viewing memory the
memory layer owns. It is imported through a DLPack capsule whose deleter runs when torch frees the
*storage*: that is, when the last tensor or view sharing it dies. A finalizer on one Python tensor
object would fire too early, since views share storage (DESIGN §2.4).
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import threading
from collections.abc import Callable

import torch

_DL_CPU = 1
_DL_CUDA = 2
_DL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = (
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
)

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

# Live capsules: address of the managed struct -> (struct, shape array, callback). The structs must
# outlive torch's use of them, so they are owned here until the deleter runs.
_live: dict[int, tuple[_DLManagedTensor, ctypes.Array, Callable[[], None]]] = {}
_live_lock = threading.Lock()


_exiting: list[bool] = []
# A C function that ignores its argument: the deleter of every storage still alive at exit.
_NO_OP = ctypes.cast(ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p), _DELETER)


@atexit.register
def _detach_at_exit() -> None:
    """From here on, frees are left to the process's exit.

    Registered after torch's own exit handlers (torch is imported first), so it runs before
    them. Storages still alive are freed by the interpreter's last garbage collection, when
    calling back into Python segfaults (seen in CI): their deleters become a C no-op, and the
    structs torch will read stay alive.
    """
    _exiting.append(True)
    with _live_lock:
        for managed, _, _ in _live.values():
            managed.deleter = _NO_OP
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_live))


def _make_deleter() -> Callable[..., None]:
    # The callback may run during interpreter teardown, after module globals were cleared, so
    # everything it needs is bound here, in a closure.
    is_finalizing, live, lock, addressof = sys.is_finalizing, _live, _live_lock, ctypes.addressof
    exiting = _exiting

    @_DELETER
    def on_storage_freed(managed: ctypes._Pointer) -> None:
        if exiting or is_finalizing():  # the process and all its memory are going away
            return
        with lock:
            _, _, on_free = live.pop(addressof(managed.contents))
        on_free()

    return on_storage_freed


_on_storage_freed = _make_deleter()


def tensor_at(
    address: int, nbytes: int, device: torch.device, on_free: Callable[[], None]
) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` at ``address``; ``on_free()`` runs once its storage dies.

    Preconditions: the memory is mapped and stays valid until ``on_free`` runs.
    ``on_free`` may run on any thread, when the garbage collector frees the storage.
    """
    if nbytes <= 0:
        raise ValueError(f"a tensor view needs a positive size, got {nbytes}")
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = address
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        managed.dl_tensor.device = _DLDevice(_DL_CUDA, index)
    else:
        managed.dl_tensor.device = _DLDevice(_DL_CPU, 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _on_storage_freed
    key = ctypes.addressof(managed)
    with _live_lock:
        _live[key] = (managed, shape, on_free)
    try:
        capsule = _PyCapsule_New(key, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _live_lock:
            _live.pop(key, None)
        raise
