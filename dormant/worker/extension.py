"""Worker extensions, with vLLM's semantics: ``LLM(..., worker_extension_cls="pkg.mod.Class")``
makes the class's methods methods of every worker, so a framework's own refit code runs inside
the engine's workers and reaches ``self.model_runner.model``, ``self.device`` and ``self.rank``.

vLLM appends the class to the worker's bases in place; dormant builds a subclass per extension
instead, so one engine's extension never leaks into another's workers. As in vLLM, an extension
may not shadow a worker attribute: that raises ``WorkerExtensionError`` when the engine starts.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from dormant.core.commands import PUBLIC_RPC
from dormant.core.errors import UnknownRpcMethodError
from dormant.errors import EngineError


class WorkerExtensionError(EngineError, ValueError):
    """A ``worker_extension_cls`` that cannot be imported, or that conflicts with the worker."""


def resolve_qualname(qualname: str) -> type:
    """The class named ``"package.module.Class"``."""
    module_name, _, class_name = qualname.rpartition(".")
    if not module_name:
        raise WorkerExtensionError(
            f"worker_extension_cls must be a qualified name like 'pkg.module.Class', got "
            f"{qualname!r}"
        )
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise WorkerExtensionError(
            f"cannot import worker_extension_cls {qualname!r}: {error}. It must be importable "
            "in every worker process."
        ) from error
    if not isinstance(found, type):
        raise WorkerExtensionError(f"worker_extension_cls {qualname!r} is not a class")
    return found


@cache
def extended_worker_class(base: type, qualname: str) -> type:
    """``base`` with the extension's methods mixed in; WorkerExtensionError on a conflict."""
    extension = resolve_qualname(qualname)
    conflicts = [  # dir: what the extension inherits counts too, as in vLLM
        name for name in dir(extension) if not name.startswith("__") and hasattr(base, name)
    ]
    if conflicts:
        raise WorkerExtensionError(
            f"worker extension {qualname} defines {conflicts}, which the worker already has; "
            "rename them in the extension"
        )
    name = f"{base.__name__}With{extension.__name__}"
    return type(name, (base, extension), {"extension_cls": extension})


def extension_methods(extension: type | None) -> tuple[str, ...]:
    """The public methods an extension adds (what ``collective_rpc`` may call by name)."""
    if extension is None:
        return ()
    return tuple(
        sorted(
            name
            for klass in extension.__mro__
            if klass is not object
            for name, value in vars(klass).items()
            if not name.startswith("_") and callable(value)
        )
    )


def call_extension(worker: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls the extension method ``name`` on ``worker``; the typed error lists what exists."""
    methods = extension_methods(getattr(worker, "extension_cls", None))
    if name not in methods:
        raise UnknownRpcMethodError(
            f"collective_rpc: the workers have no method {name!r}. Built-in: "
            f"{sorted(PUBLIC_RPC)}; from the worker extension: "
            f"{list(methods) or 'none (no worker_extension_cls)'}; or pass a callable "
            "fn(worker, *args, **kwargs)"
        )
    return getattr(worker, name)(*args, **kwargs)
