"""The pages a person opens: GET / (an index of links) and GET /docs (Swagger UI on /openapi.json,
served from the packaged copy, swagger-ui-bundle-v2).

No CDN: the page loads Swagger UI's own script and stylesheet from /docs/static/, files that the
`swagger_ui_bundle` package ships, and turns off Swagger UI's online validator badge (which would
fetch an image from validator.swagger.io). Only the files this page loads are served (`ASSET_FILES`);
the rest of the bundle, its demo index.html and swagger-initializer.js (which load the petstore
example from petstore.swagger.io), the OAuth2 redirect page and the source maps, are 404. With
--token-file the page and its assets need the bearer header like every route but /healthz; so does
the index.
"""

from __future__ import annotations

import html

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/static"
"""Where the packaged Swagger UI files are served."""

ASSET_FILES = frozenset({"swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png"})
"""The bundle's files that PAGE loads: the only ones served under ASSETS."""

LINKS = {
    "docs": "/docs",
    "openapi": "/openapi.json",
    "rollouts": "/v1/rollouts",
    "models": "/v1/models",
    "healthz": "/healthz",
    "readyz": "/readyz",
    "metrics": "/metrics",
}
"""GET /'s links: the API page, the API's description, and the endpoints worth a first look."""

PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>sigmaflight API</title>
  <link rel="stylesheet" href="{assets}/swagger-ui.css">
  <link rel="icon" type="image/png" href="{assets}/favicon-32x32.png">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="{assets}/swagger-ui-bundle.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{url: "{spec}", dom_id: "#swagger-ui", validatorUrl: null, deepLinking: true}});
  </script>
</body>
</html>
"""


async def docs(request: Request) -> Response:
    root = html.escape(request.scope.get("root_path", ""))
    return HTMLResponse(PAGE.format(assets=root + ASSETS, spec=root + "/openapi.json"))


class PageAssets(StaticFiles):
    """StaticFiles over the bundle that serves ASSET_FILES only (404 for any other path)."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if path not in ASSET_FILES:
            raise HTTPException(status_code=404)
        return await super().get_response(path, scope)


async def index(request: Request) -> Response:
    """A small index instead of a 404 for someone who opens the server's URL."""
    root = request.scope.get("root_path", "")
    return JSONResponse({"service": "sigmaflight", "links": {name: root + path for name, path in LINKS.items()},
                         "try": "sigmaflight submit --url URL -p 'a red cube' --wait"})


def docs_routes() -> list[BaseRoute]:
    """GET / and GET /docs (with Swagger UI's assets)."""
    return [
        Route("/", index, methods=["GET"], name="index"),
        Route("/docs", docs, methods=["GET"], name="docs"),
        Mount(ASSETS, app=PageAssets(directory=swagger_ui_path), name="docs_static"),
    ]
