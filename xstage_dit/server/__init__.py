"""The generation server: FastAPI over the multi-rank worker (see `xstage_dit.server.app`, `xstage_dit.server.worker`)."""

from xstage_dit.server.config import ServedModel, ServerConfig

__all__ = ["ServedModel", "ServerConfig", "create_app"]


def create_app(*args, **kwargs):
    from xstage_dit.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
