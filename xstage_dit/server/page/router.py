"""`GET /`: the single-page web UI shipped in `xstage_dit/server/static`."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> HTMLResponse:
    page = resources.files("xstage_dit.server").joinpath("static/index.html")
    return HTMLResponse(page.read_text(encoding="utf-8"))
