"""The admin portal: a few static files (one HTML page, one script, one style sheet; no build step) served at
``/ui/`` by the REST API process. The page works only through the REST API, with the caller's bearer token
(kept in the browser's sessionStorage, sent as the Authorization header): it holds no secret of its own and
shows only what the caller's RBAC allows.

Every answer carries a Content-Security-Policy that allows scripts, styles and connections from this origin only
(no inline script or style, no framing), ``X-Content-Type-Options: nosniff`` and ``Referrer-Policy:
no-referrer``.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
# the icon too: without one every page load asked for /favicon.ico and logged a 404 in the browser's console
FILES = {"index.html": "text/html", "app.js": "text/javascript", "app.css": "text/css",
         "favicon.svg": "image/svg+xml"}


def _load() -> dict[str, bytes]:
    root = resources.files("scheduler_extender.api") / "static"
    return {name: (root / name).read_bytes() for name in FILES}


class Portal:
    def __init__(self) -> None:
        self.files = _load()

    def _file(self, name: str) -> web.Response:
        cache = "no-cache" if name == "index.html" else "max-age=300"
        return web.Response(body=self.files[name], content_type=FILES[name], charset="utf-8",
                            headers={**SECURITY_HEADERS, "Cache-Control": cache})

    async def index(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/ui/", headers=SECURITY_HEADERS)

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["file"]
        if name not in self.files:
            return web.Response(status=404, text=f"no such portal file: {name[:80]}", headers=SECURITY_HEADERS)
        return self._file(name)

    async def favicon(self, request: web.Request) -> web.Response:
        """``/favicon.ico``, which a browser asks for on any page of this server (an API answer opened in a
        tab, too) without a ``<link rel="icon">``: the portal's icon."""
        raise web.HTTPMovedPermanently("/ui/favicon.svg", headers=SECURITY_HEADERS)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/ui", self.redirect), web.get("/ui/", self.index), web.get("/ui/{file}", self.asset),
                web.get("/favicon.ico", self.favicon)]


def portal_routes() -> list[web.RouteDef]:
    return Portal().routes()
