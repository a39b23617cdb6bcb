"""The HTTP API as one router per resource; `xstage_dit.server.app.create_app` includes them all."""

from xstage_dit.server.routes import health, images, jobs, models, page, videos

ROUTERS = (page.router, health.router, models.router, images.router, videos.router, jobs.router)

__all__ = ["ROUTERS"]
