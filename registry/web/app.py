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
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from registry import views
from registry.errors import CheckpointNotFoundError, InvalidNameError, InvalidQueryError, RegistryError
from registry.format.numbers import parse_int, shown
from registry.format.refs import MAX_STEP
from registry.records import HAS_PAYLOAD
from registry.web import data, pages
from registry.web.server import is_loopback

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


def host_name(header: str) -> str | None:
    """The name in a ``Host`` header without its port (``[::1]:8765`` -> ``::1``); None when malformed."""
    name, port = header, ""
    if header.startswith("["):
        name, bracket, port = header[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return None
        port = port[1:]
    elif ":" in header:
        name, _, port = header.partition(":")
    if port and not (port.isascii() and port.isdigit()):
        return None
    return name.lower() or None


class LoopbackHostGate:
    """Serve only requests addressed to a loopback name: a page whose name rebinds to 127.0.0.1 reads nothing.

    A browser sends the name it looked up as ``Host``; a DNS-rebinding page
    sends its own. Without a token, only ``localhost``, 127.0.0.0/8 and
    ``[::1]`` are answered; with one, the token is the guard and any name is.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            name = host_name(header)
            if name is None or not is_loopback(name):
                response = PlainTextResponse(
                    f"400: this registry view answers only to localhost, 127.0.0.1 or [::1], not Host "
                    f"{shown(header)}; serve it with --token to reach it by another name", status_code=400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(reg: Registry, *, token: str | None = None) -> Starlette:
    """The web view of ``reg`` (open it read-only: nothing here writes).

    ``token`` gates every request; without one, only requests addressed to
    a loopback name are served (:class:`LoopbackHostGate`).
    """

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

    def number(request: Request, name: str, *, default: int, minimum: int = 0, maximum: int = MAX_STEP) -> int:
        """A whole-number query parameter (``default`` when absent); a malformed one is a 400."""
        text = request.query_params.get(name, "")
        return parse_int(text, what=name, minimum=minimum, maximum=maximum) if text else default

    def points(request: Request) -> int:
        asked = number(request, "points", default=views.DEFAULT_CURVE_POINTS, minimum=1)
        return min(MAX_CURVE_POINTS, max(10, asked))

    def step_of(request: Request) -> int:
        return parse_int(str(request.path_params["step"]), what="step", maximum=MAX_STEP)

    run_page = page(lambda r: pages.run_page(run_of(r), reg.catalog.metric_keys(run_of(r)),
                                             policy=data.policy_doc(reg, run_of(r))))

    def run_or_ref(request: Request) -> Response:
        """A run's page; a whole ref in the run's place (``/runs/toy@release``) goes to the step it names,
        and a malformed or misspelt one answers its one-line error."""
        if "@" not in run_of(request):
            return run_page(request)
        try:
            info = reg.resolve(run_of(request))
        except RegistryError as exc:
            return HTMLResponse(pages.error_page(str(exc)), status_code=_status_of(exc))
        return RedirectResponse(step_url(info.run, info.step), status_code=303)

    routes = [
        Route("/", page(lambda r: runs_page(reg, r))),
        Route("/runs/{run}", run_or_ref),
        Route("/runs/{run}/steps/{step}", page(lambda r: step_page(reg, r, step_of(r)))),
        Route("/compare", page(lambda r: pages.compare_page(
            r.query_params.getlist("run"), r.query_params.getlist("key"),
            data.compare_config(reg, r.query_params.getlist("run")) if r.query_params.getlist("run") else None))),
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
        Route("/api/table", api(lambda r: data.table_doc(reg, **table_query(r)))),
        Route("/api/compare/config", api(lambda r: data.compare_config(reg, r.query_params.getlist("run")))),
        Route("/api/runs/{run}/stamp", api(lambda r: data.stamp_doc(reg, run_of(r)))),
        Route("/api/runs/{run}/timeline", api(lambda r: data.events_in_words(reg.events(run_of(r))))),
        Route("/api/runs/{run}/steps/{step}/contents", api(lambda r: data.step_contents(
            views.step_view(reg, f"{run_of(r)}@{step_of(r)}").info))),
        Route("/api/diff", api(lambda r: data.diff_of(reg, r.query_params.get("a", ""),
                                                      r.query_params.get("b", "")).to_json())),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [Middleware(TokenGate, token=token)] if token else [Middleware(LoopbackHostGate)]
    return Starlette(routes=routes, middleware=middleware)


def table_query(request: Request) -> dict[str, Any]:
    """The runs table's ``columns``, ``where`` and ``sort`` as the URL writes them (``metric``: one column)."""
    query = request.query_params
    columns = query.getlist("columns") or query.getlist("metric")
    return {"columns": [c for c in columns if c.strip()], "where": [w for w in query.getlist("where") if w.strip()],
            "sort": query.get("sort") or None}


def runs_page(reg: Registry, request: Request) -> str:
    """The runs table as asked; a malformed column, condition or sort is said above the table as it is
    unasked, so the form to fix it stays at hand."""
    asked = table_query(request)
    text = {"columns": ", ".join(asked["columns"]), "where": ", ".join(asked["where"])}
    try:
        return pages.runs_page(data.table_doc(reg, **asked), **text)
    except (InvalidNameError, InvalidQueryError) as exc:
        return pages.runs_page(data.table_doc(reg), error=str(exc), **text)


def step_page(reg: Registry, request: Request, step: int) -> str:
    """One step's page: what ``show`` says, its tensors and config, how to load it (or what to do instead)."""
    view = views.step_view(reg, f"{request.path_params['run']}@{step}")
    others = [m[0] for m in reg.catalog.checkpoint_marks(view.info.run) if m[1] in HAS_PAYLOAD and m[0] != step]
    nearest = sorted(sorted(others, key=lambda s: abs(s - step))[:DIFF_CHOICES])  # what a diff is usually against
    return pages.step_page(view, lineage=lineage_of(reg, request), contents=data.step_contents(view.info),
                           root=reg.root_url, url=reg.url, durable=reg.root.reopen().get("durable"),
                           others=nearest)


def lineage_of(reg: Registry, request: Request) -> Any:
    """What ``reg.lineage(ref)`` records for the step (None when it has none: a catalog without it)."""
    ref = f"{request.path_params['run']}@{request.path_params['step']}"
    try:
        return reg.lineage(ref)
    except RegistryError:
        return None


def step_url(run: str, step: int) -> str:
    return f"/runs/{quote(run)}/steps/{step}"


__all__ = ["create_app", "runs_page", "step_url", "table_query"]
