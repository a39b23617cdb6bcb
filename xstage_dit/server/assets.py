"""What the server ships so that nothing it serves needs the internet: the API docs at `/docs` (Swagger
UI from the local files of the pinned `fastapi-offline` package instead of FastAPI's default CDN, which
leaves `/docs` blank on an offline machine) and the page's favicon."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

#: Where the Swagger UI files are mounted.
DOCS_STATIC_URL = "/static/docs"
SWAGGER_STATIC = Path(fastapi_offline.__file__).parent / "static"
FAVICON = resources.files("xstage_dit.server").joinpath("static/favicon.ico")


def install_offline_docs(app: FastAPI) -> None:
    """`/docs` (Swagger UI, local assets) and `/favicon.ico` on `app`, built with `docs_url=None`."""
    if app.docs_url is not None:
        raise ValueError(f"expected an app built with docs_url=None (its own /docs loads a CDN), got {app.docs_url!r}")
    for name in ("swagger-ui-bundle.js", "swagger-ui.css"):
        if not (SWAGGER_STATIC / name).is_file():
            raise RuntimeError(f"expected {name} in {SWAGGER_STATIC} (package fastapi-offline), got none")
    app.mount(DOCS_STATIC_URL, StaticFiles(directory=SWAGGER_STATIC), name="docs-static")
    redirect_url = app.swagger_ui_oauth2_redirect_url

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - API docs",
                                   oauth2_redirect_url=redirect_url,
                                   swagger_js_url=f"{DOCS_STATIC_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_STATIC_URL}/swagger-ui.css",
                                   swagger_favicon_url="/favicon.ico")

    @app.get(redirect_url, include_in_schema=False)
    async def docs_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(FAVICON.read_bytes(), media_type="image/x-icon",
                        headers={"Cache-Control": "public, max-age=86400"})
