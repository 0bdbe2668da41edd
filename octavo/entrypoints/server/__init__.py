"""The OpenAI-compatible server (`octavo serve`): see app.py for the routes and lifecycle."""

from octavo.entrypoints.server.app import ServerConfig, build_app, make_server_app, run_server

__all__ = ["ServerConfig", "build_app", "make_server_app", "run_server"]
