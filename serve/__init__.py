"""edgekv.serve: an OpenAI-compatible HTTP server over the engine, with continuous batching (``edgekv serve``)."""
from .app import ServerState, ServeSettings, create_app
from .server import ServeOptions, run

__all__ = ["ServeOptions", "ServeSettings", "ServerState", "create_app", "run"]
