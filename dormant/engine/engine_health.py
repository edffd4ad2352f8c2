"""vLLM's ``EngineClient`` health checks for ``AsyncLLM``: whether its loop stopped (shut down,
or failed by itself), and the error every request and call got then."""

from __future__ import annotations

from dormant.core.errors import EngineDeadError
from dormant.engine.engine_loop import EngineLoop


class EngineClientHealth:
    """Mixed into ``AsyncLLM``, which sets ``_engine_loop``."""

    _engine_loop: EngineLoop

    @property
    def errored(self) -> bool:
        """Whether the engine stopped: shut down, or its loop failed (then every request and
        call got ``dead_error``)."""
        return self._engine_loop.is_stopped

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        return self._engine_loop.dead_error or EngineDeadError("the engine is running")

    async def check_health(self) -> None:
        """Raises ``dead_error`` once the engine stopped."""
        if self.errored:
            raise self.dead_error
