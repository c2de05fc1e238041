"""The pages a person opens: GET / (an index of links) and GET /docs (Swagger UI on /openapi.json,
served from the packaged copy, swagger-ui-bundle-v2).

No CDN: the page loads Swagger UI's own script and stylesheet from /docs/static/, files that the
`swagger_ui_bundle` package ships, and turns off Swagger UI's online validator badge (which would
fetch an image from validator.swagger.io). With --token-file the page and its assets need the
bearer header like every route but /healthz; so does the index.
"""

from __future__ import annotations

import html

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/static"
"""Where the packaged Swagger UI files are served."""

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
        Mount(ASSETS, app=StaticFiles(directory=swagger_ui_path), name="docs_static"),
    ]
