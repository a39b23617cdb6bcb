"""The generation server: FastAPI over the multi-rank worker (see `server.app`, `server.worker`)."""

from server.config import ServedModel, ServerConfig

__all__ = ["ServedModel", "ServerConfig", "create_app"]


def create_app(*args, **kwargs):
    from server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
