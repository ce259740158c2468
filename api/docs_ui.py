"""`/docs` (Swagger UI) and `/redoc` from assets an installed wheel ships, never from a CDN.

FastAPI's own pages load their JS and CSS from cdn.jsdelivr.net (and ReDoc Google's fonts),
so on a machine with no internet they are blank. The wheel `fastapi-offline` (MIT) ships
Swagger UI 5 (`swagger-ui-bundle.js`, `swagger-ui.css`; Apache-2.0), ReDoc 2
(`redoc.standalone.js`; MIT) and a favicon in its `static/` folder; only those files are used,
not its app factory. (`swagger-ui-bundle` ships Swagger UI 4.15, which renders no OpenAPI 3.1
document, FastAPI's.) The pages and `ASSETS` are public, as `/openapi.json` is, whatever
`WHISPERFLEET_AUTH` says; every URL is under the request's `root_path`, so the pages work
behind a proxy that mounts the API under a prefix.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
REDOC = "/redoc"
ASSETS = "/docs/assets"
# (package, folder inside it): StaticFiles checks at startup that the folder is there, and
# refuses any path that resolves outside it (`..`, absolute paths, symlinks out)
ASSET_PACKAGE = ("fastapi_offline", "static")


def _root(request: Request) -> str:
    return request.scope.get("root_path", "").rstrip("/")


def install_docs(app: FastAPI) -> None:
    """The pages FastAPI would add with `docs_url` and `redoc_url`, on local assets. The app
    must be made with `docs_url=None, redoc_url=None` and an `openapi_url`."""
    assert app.docs_url is None and app.redoc_url is None and app.openapi_url
    app.mount(ASSETS, StaticFiles(packages=[ASSET_PACKAGE]), name="docs-assets")
    redirect = app.swagger_ui_oauth2_redirect_url

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=root + redirect if redirect else None,
            init_oauth=app.swagger_ui_init_oauth,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    async def swagger_ui_redirect(request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_redoc_html(
            openapi_url=root + app.openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    # add_route, as FastAPI does for its own pages: GET and HEAD, kept out of the schema
    app.add_route(DOCS, swagger_ui, include_in_schema=False)
    if redirect:
        app.add_route(redirect, swagger_ui_redirect, include_in_schema=False)
    app.add_route(REDOC, redoc, include_in_schema=False)
