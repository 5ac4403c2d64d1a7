"""The Starlette app: HTML pages and the ``/api/...`` JSON documents, over one read-only registry."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from registry import views
from registry.errors import CheckpointNotFoundError, RegistryError
from registry.web import data, pages

if TYPE_CHECKING:
    from registry.api import Registry

STATIC = Path(__file__).resolve().parent / "static"
MAX_CURVE_POINTS = 20_000
TOKEN_COOKIE = "registry_ui_token"
DIFF_CHOICES = 200  # steps offered to diff a step against: the nearest ones


def _status_of(exc: RegistryError) -> int:
    return 404 if isinstance(exc, CheckpointNotFoundError) else 400


class TokenGate(BaseHTTPMiddleware):
    """Every request must carry the token: ``Authorization: Bearer``, the cookie, or ``?token=`` (sets the cookie)."""

    def __init__(self, app: Any, *, token: str) -> None:
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        header = request.headers.get("authorization", "")
        offered = [header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else "",
                   request.cookies.get(TOKEN_COOKIE, ""), request.query_params.get("token", "")]
        if not any(o and hmac.compare_digest(o.encode(), self.token.encode()) for o in offered):
            return PlainTextResponse("401: this registry view needs its access token (?token=...)", status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        return response


def create_app(reg: Registry, *, token: str | None = None) -> Starlette:
    """The web view of ``reg`` (open it read-only: nothing here writes); ``token`` gates every request."""

    def api(build: Callable[[Request], Any]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                return JSONResponse(build(request))
            except RegistryError as exc:
                return JSONResponse({"error": str(exc)}, status_code=_status_of(exc))
        return endpoint

    def page(build: Callable[[Request], str]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                return HTMLResponse(build(request))
            except RegistryError as exc:
                return HTMLResponse(pages.error_page(str(exc)), status_code=_status_of(exc))
        return endpoint

    def run_of(request: Request) -> str:
        return str(request.path_params["run"])

    def flag(request: Request, name: str) -> bool:
        return request.query_params.get(name, "").lower() in ("1", "true", "yes", "on")

    def points(request: Request) -> int:
        text = request.query_params.get("points", "")
        return min(MAX_CURVE_POINTS, max(10, int(text))) if text.isdigit() else views.DEFAULT_CURVE_POINTS

    routes = [
        Route("/", page(lambda r: pages.runs_page(data.health_doc(reg, sort_by=r.query_params.get("metric") or None),
                                                   metric=r.query_params.get("metric", "")))),
        Route("/runs/{run}", page(lambda r: pages.run_page(run_of(r), reg.catalog.metric_keys(run_of(r))))),
        Route("/runs/{run}/steps/{step:int}", page(lambda r: step_page(reg, r))),
        Route("/compare", page(lambda r: pages.compare_page(r.query_params.getlist("run"),
                                                            r.query_params.getlist("key")))),
        Route("/diff", page(lambda r: pages.diff_page(data.diff_of(reg, r.query_params.get("a", ""),
                                                                   r.query_params.get("b", ""))))),
        Route("/api/runs", api(lambda r: views.runs_doc(reg, sort_by=r.query_params.get("sort_by") or None))),
        Route("/api/runs/{run}/checkpoints", api(lambda r: views.checkpoints_doc(
            reg.checkpoints(run_of(r), include_deleted=flag(r, "all"))))),
        Route("/api/runs/{run}/metrics", api(lambda r: views.metrics_doc(
            reg.metrics(run_of(r), r.query_params.get("key") or None, history=flag(r, "history"))))),
        Route("/api/runs/{run}/events", api(lambda r: views.events_doc(reg.events(run_of(r))))),
        Route("/api/runs/{run}/view", api(lambda r: views.run_view(
            reg, run_of(r), key=r.query_params.get("key") or None, max_points=points(r)))),
        Route("/api/runs/{run}/gc", api(lambda r: views.retention_preview(
            reg, run_of(r), r.query_params.get("policy", ""),
            allow_missing_metric=flag(r, "allow_missing_metric")))),
        Route("/api/show", api(lambda r: views.step_view(reg, r.query_params.get("ref", "")).to_json())),
        Route("/api/health", api(lambda r: data.health_doc(reg, sort_by=r.query_params.get("sort_by") or None))),
        Route("/api/compare", api(lambda r: data.compare_doc(
            reg, r.query_params.getlist("run"), r.query_params.getlist("key"),
            mode=r.query_params.get("mode", "min"), max_points=points(r)))),
        Route("/api/runs/{run}/stamp", api(lambda r: data.stamp_doc(reg, run_of(r)))),
        Route("/api/runs/{run}/timeline", api(lambda r: data.events_in_words(reg.events(run_of(r))))),
        Route("/api/runs/{run}/steps/{step:int}/contents", api(lambda r: data.step_contents(
            views.step_view(reg, f"{run_of(r)}@{r.path_params['step']}").info))),
        Route("/api/diff", api(lambda r: data.diff_of(reg, r.query_params.get("a", ""),
                                                      r.query_params.get("b", "")).to_json())),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [Middleware(TokenGate, token=token)] if token else []
    return Starlette(routes=routes, middleware=middleware)


def step_page(reg: Registry, request: Request) -> str:
    """One step's page: what ``show`` says, its tensors and config, how to load it (or what to do instead)."""
    view = views.step_view(reg, f"{request.path_params['run']}@{request.path_params['step']}")
    from registry.records import HAS_PAYLOAD
    step = view.info.step
    others = [m[0] for m in reg.catalog.checkpoint_marks(view.info.run) if m[1] in HAS_PAYLOAD and m[0] != step]
    nearest = sorted(sorted(others, key=lambda s: abs(s - step))[:DIFF_CHOICES])  # what a diff is usually against
    return pages.step_page(view, lineage=lineage_of(reg, request), contents=data.step_contents(view.info),
                           root=reg.store.root, url=reg.url, others=nearest)


def lineage_of(reg: Registry, request: Request) -> Any:
    """What ``reg.lineage(ref)`` records for the step (None when it has none: a catalog without it)."""
    ref = f"{request.path_params['run']}@{request.path_params['step']}"
    try:
        return reg.lineage(ref)
    except RegistryError:
        return None


def step_url(run: str, step: int) -> str:
    return f"/runs/{quote(run)}/steps/{step}"


__all__ = ["create_app", "step_url"]
