"""One error root for the engine (issue #11): every error ``dormant.engine`` exports derives from
``EngineError``, so ``except EngineError`` catches whatever the engine raises on purpose."""

from __future__ import annotations

import dormant.engine
from dormant.engine import EngineError


def test_every_exported_error_derives_from_engine_error() -> None:
    errors = [name for name in dormant.engine.__all__ if name.endswith("Error")]
    assert len(errors) >= 15
    strays = [name for name in errors if not issubclass(getattr(dormant.engine, name), EngineError)]
    assert not strays, f"not EngineErrors: {strays}"
