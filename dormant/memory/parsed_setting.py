"""A manager setting that parses what is assigned to it (``mm.discard_order = "after copies"``).

The parser turns a name (or the value itself) into the setting's type and raises its typed
error for anything else; the setting then keeps its old value. Reading it gives the parsed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ParsedSetting(Generic[T]):
    """A data descriptor: ``__set__`` stores ``parse(value)`` on the instance, as ``_<name>``."""

    def __init__(self, parse: Callable[[Any], T]) -> None:
        self._parse = parse
        self._attribute = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._attribute = f"_{name}"

    def __get__(self, instance: object, owner: type | None = None) -> T:
        return getattr(instance, self._attribute)

    def __set__(self, instance: object, value: object) -> None:
        setattr(instance, self._attribute, self._parse(value))
