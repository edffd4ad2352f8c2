"""The HTTP server (``dormant serve``): FastAPI routes over one ``AsyncLLM``, served by uvicorn;
outside the engine's core. Needs the ``serve`` extra (``pip install 'dormant[serve]'``)."""

from dormant.server.app import ServerThread, build_app, uvicorn_config
from dormant.server.settings import ServerSettings

__all__ = ["ServerSettings", "ServerThread", "build_app", "uvicorn_config"]
