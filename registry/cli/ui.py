"""``registry ui``: looking at a run in a browser instead of reading tables."""

from __future__ import annotations

import click

from registry.cli.common import State, command
from registry.cli.types import Count


@click.command("ui")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Anything but loopback needs --token.")
@click.option("--port", type=Count(minimum=0, maximum=65535), default=8765, show_default=True, help="Port to bind.")
@click.option("--token", envvar="REGISTRY_UI_TOKEN", show_envvar=True, default=None,
              help="Access token every request must carry (open http://HOST:PORT/?token=TOKEN once).")
@click.pass_obj
@command
def ui(state: State, host: str, port: int, token: str | None) -> None:
    """Serve a read-only web view of the runs, their curves, checkpoints and retention previews.

    Needs the ui extra (pip install -e '.[ui]' in a checkout). The
    catalog is opened read-only; training never depends on this server.

    \b
    Examples:
        registry ui
        registry ui --host 0.0.0.0 --port 8080 --token "$TOKEN"
    """
    from registry.cli.terminal import require
    require("starlette", "registry ui")
    require("uvicorn", "registry ui")
    from registry.web import check_bind, create_app, listen, serve
    check_bind(host, token)
    state.read_only = True
    reg = state.registry()
    sock = listen(host, port)  # before the banner: a taken port is one error line, not a banner then a traceback
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"registry ui: http://{shown}:{sock.getsockname()[1]}/{'?token=...' if token else ''} "
               "(read-only; Ctrl-C stops)", err=True)
    serve(create_app(reg, token=token), sock=sock)


__all__ = ["ui"]
