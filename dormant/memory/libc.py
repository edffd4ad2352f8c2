"""The few libc calls the host backend and the host arena need (Linux constants)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
_libc.memset.restype = ctypes.c_void_p

_MAP_FAILED = ctypes.c_void_p(-1).value
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = 0x01, 0x02, 0x20
MAP_NORESERVE = 0x4000
MAP_FIXED = 0x10
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23


def _raise_errno(call: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{call} failed: {os.strerror(err)}")


def mmap_raw(address: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    """``mmap(2)``; returns the mapped address or raises OSError naming the call."""
    result = _libc.mmap(address or None, size, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        _raise_errno("mmap")
    return int(result)


def munmap(address: int, size: int) -> None:
    if _libc.munmap(address, size) != 0:
        _raise_errno("munmap")


def reserve(size: int) -> int:
    """Reserves ``size`` bytes of address space with no access and no backing."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    return mmap_raw(0, size, PROT_NONE, flags)


def reserve_fixed(address: int, size: int) -> None:
    """Replaces the mapping at ``[address, address + size)`` by an inaccessible reservation."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
    mmap_raw(address, size, PROT_NONE, flags)


def map_shared_fixed(address: int, size: int, fd: int) -> None:
    """Maps ``fd`` read-write at exactly ``address`` (over a reservation we own)."""
    flags = MAP_SHARED | MAP_FIXED
    mmap_raw(address, size, PROT_READ | PROT_WRITE, flags, fd)


def map_anonymous(size: int) -> int:
    """Private read-write anonymous memory (not yet touched)."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS
    return mmap_raw(0, size, PROT_READ | PROT_WRITE, flags)


def populate(address: int, size: int) -> None:
    """Faults in every page of an anonymous range (MADV_POPULATE_WRITE, or a memset fallback)."""
    _libc.madvise(address, size, MADV_HUGEPAGE)  # a hint only: failure is harmless
    if _libc.madvise(address, size, MADV_POPULATE_WRITE) != 0:
        _libc.memset(address, 0, size)


def memset(address: int, value: int, size: int) -> None:
    _libc.memset(address, value, size)
