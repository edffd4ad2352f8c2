"""An OpenAI-compatible HTTP server with sleep-mode endpoints (``dormant serve``); outside the
engine's core, built on the public ``LLM``."""

from dormant.server.app import DormantServer
from dormant.server.engine_loop import EngineLoop, EngineStoppedError
from dormant.server.protocol import BadRequestError

__all__ = ["BadRequestError", "DormantServer", "EngineLoop", "EngineStoppedError"]
