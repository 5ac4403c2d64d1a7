"""The web view's app through Starlette's TestClient, on both backends: its JSON is the CLI's ``--json``.

One real catalog per backend (``tests/ui_site.py``), opened read-only by the
app as ``registry ui`` opens it. The browser tests are in test_web_browser.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from registry import Registry  # noqa: E402
from registry.cli import main  # noqa: E402
from registry.errors import ReadOnlyError  # noqa: E402
from registry.views import downsample  # noqa: E402
from registry.web import check_bind, create_app, is_loopback  # noqa: E402
from registry.web.server import UnsafeBindError  # noqa: E402
from tests.helpers import pg_schema_url  # noqa: E402
from tests.ui_site import Site, build_site  # noqa: E402


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def site(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Site]:
    tmp = tmp_path_factory.mktemp("site")
    url = (f"sqlite:///{tmp / 'catalog.db'}" if request.param == "sqlite"
           else pg_schema_url(request.getfixturevalue("pg_database")))
    with Registry.open(url=url, root=tmp / "ckpt") as reg:
        built = build_site(reg)
    return url, tmp / "ckpt", built


@pytest.fixture(scope="module")
def ro(site: tuple[str, Path, Site]) -> Iterator[Registry]:
    url, root, _ = site
    with Registry.open(url=url, root=root, read_only=True, create=False) as reg:
        yield reg


@pytest.fixture(scope="module")
def client(ro: Registry) -> TestClient:
    return TestClient(create_app(ro), base_url="http://127.0.0.1:8765")  # without a token, a loopback Host only


def cli_json(site: tuple[str, Path, Site], *args: str) -> Any:
    url, root, _ = site
    result = CliRunner().invoke(main, ["--url", url, "--root", str(root), *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def get(client: TestClient, url: str, status: int = 200) -> Any:
    response = client.get(url)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize(("path", "args"), [
    ("/api/runs", ["runs"]),
    ("/api/runs?sort_by=eval/acc:max", ["runs", "--sort-by", "eval/acc:max"]),
    ("/api/runs/alpha/checkpoints", ["ls", "alpha"]),
    ("/api/runs/alpha/checkpoints?all=1", ["ls", "alpha", "--all"]),
    ("/api/runs/alpha/metrics?key=eval/loss", ["metrics", "alpha", "--key", "eval/loss"]),
    ("/api/show?ref=alpha@release", ["show", "alpha@release"]),
    ("/api/show?ref=alpha@200", ["show", "alpha@200"]),
])
def test_the_api_returns_what_the_cli_prints(client: TestClient, site: tuple[str, Path, Site], path: str,
                                             args: list[str]) -> None:
    assert get(client, path) == cli_json(site, *args)


def test_the_retention_preview_is_gc_dry_run(client: TestClient, site: tuple[str, Path, Site]) -> None:
    doc = get(client, "/api/runs/alpha/gc?policy=keep-last 1, keep-best eval/acc:max 1, max-bytes 1M")
    cli = cli_json(site, "gc", "alpha", "--keep-last", "1", "--keep-best", "eval/acc:max=1", "--max-bytes", "1M",
                   "--dry-run")
    doc.pop("now"), cli.pop("now")
    assert doc == cli
    assert doc["delete"] and doc["dry_run"] and doc["result"] is None


def test_a_bad_policy_or_unknown_run_is_an_error_document(client: TestClient) -> None:
    assert "keep-last N" in get(client, "/api/runs/alpha/gc?policy=keep-most 3", 400)["error"]
    assert "eval/typo" in get(client, "/api/runs/alpha/gc?policy=keep-best eval/typo 2", 400)["error"]
    assert "nope" in get(client, "/api/runs/nope/view", 404)["error"]
    assert client.get("/runs/nope").status_code == 404


def test_runs_sort_by_best_value(client: TestClient) -> None:
    low = [r["name"] for r in get(client, "/api/runs?sort_by=eval/loss")]
    high = [r["name"] for r in get(client, "/api/runs?sort_by=eval/loss:max")]
    assert low == ["alpha", "beta", "gamma"] and high == ["alpha", "gamma", "beta"]  # alpha@400: 0.95
    alpha = get(client, "/api/runs?sort_by=eval/loss")[0]
    assert alpha["latest_verified_step"] == 1600 and alpha["best"]["step"] == 1600


def test_run_view_marks_every_checkpoint_and_downsamples(client: TestClient, site: tuple[str, Path, Site]) -> None:
    view = get(client, "/api/runs/alpha/view?key=train/loss&points=20")
    assert len(view["checkpoints"]) == site[2].checkpoints == 9
    assert {c["status"] for c in view["checkpoints"]} == {"verified", "published", "corrupt", "deleted", "failed"}
    assert {tuple(c["tags"]) for c in view["checkpoints"]} >= {("release",), ("best-eval",)}
    curve = view["curve"]
    full = get(client, "/api/runs/alpha/metrics?key=train/loss")
    assert curve["total_points"] == len(full) == site[2].dense_points and curve["downsampled"]
    assert len(curve["points"]) <= 20 + len(view["checkpoints"])
    steps = {s for s, _ in curve["points"]}
    assert {c["step"] for c in view["checkpoints"] if c["value"] is not None} <= steps
    values = [p["value"] for p in full]
    assert min(values) in {v for _, v in curve["points"]} and max(values) in {v for _, v in curve["points"]}
    assert {e["kind"] for e in view["events"]} >= {"publish", "tag", "corrupt", "delete"}


def test_downsample_keeps_spikes_and_checkpoints() -> None:
    points = [(s, math.sin(s / 50)) for s in range(10_000)]
    points[4321] = (4321, 99.0)
    out = downsample(points, buckets=50, keep_steps=[17, 9999, 123456])
    assert len(out) <= 2 * 50 + 2 and (4321, 99.0) in out and {17, 9999} <= {s for s, _ in out}
    assert out == sorted(out) and downsample(points[:30], buckets=50) == points[:30]


def test_pages_render(client: TestClient) -> None:
    runs = client.get("/?metric=eval/loss").text
    assert all(f'data-run="{r}"' in runs for r in ("alpha", "beta", "gamma")) and "UTC" in runs
    run = client.get("/runs/alpha").text
    assert 'data-run="alpha"' in run and '<option value="train/loss">' in run and "/static/chart.js" in run
    corrupt = client.get("/runs/alpha/steps/1200").text
    assert 'data-status="corrupt"' in corrupt and "verify alpha@1200" in corrupt and "reg.load(" not in corrupt
    assert "model.safetensors" in corrupt and "best-eval" in corrupt
    deleted = client.get("/runs/alpha/steps/200").text
    assert 'data-status="deleted"' in deleted and "ended by" in deleted
    for asset in ("chart.js", "run.js", "runs.js", "style.css"):
        assert client.get(f"/static/{asset}").status_code == 200


def test_the_app_reads_a_read_only_catalog_and_writes_nothing(client: TestClient, ro: Registry) -> None:
    assert ro.read_only
    before = [e.id for e in ro.events()]
    for path in ("/", "/runs/alpha", "/runs/alpha/steps/1400", "/api/runs/alpha/gc?policy=keep-last 1",
                 "/api/runs/alpha/view", "/api/runs?sort_by=eval/loss"):
        assert client.get(path).status_code == 200
    assert [e.id for e in ro.events()] == before
    assert client.post("/api/runs/alpha/gc?policy=keep-last 1").status_code == 405
    with pytest.raises(ReadOnlyError):
        ro.tag("alpha", 1400, "nope")


def test_a_token_gates_every_request(ro: Registry) -> None:
    gated = TestClient(create_app(ro, token="s3cret"))
    assert gated.get("/api/runs").status_code == 401
    assert gated.get("/static/chart.js").status_code == 401
    assert gated.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert gated.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert gated.get("/?token=s3cret").status_code == 200
    assert gated.get("/api/runs").status_code == 200  # the cookie the first page set


def test_only_loopback_binds_without_a_token(site: tuple[str, Path, Site]) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    with pytest.raises(UnsafeBindError):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "token")
    url, root, _ = site
    result = CliRunner().invoke(main, ["--url", url, "--root", str(root), "ui", "--host", "0.0.0.0"],
                                env={"REGISTRY_UI_TOKEN": ""})
    assert result.exit_code == 1 and "refusing to bind 0.0.0.0" in result.output


def test_every_asset_ships_in_the_wheel_and_nothing_comes_from_the_network(client: TestClient) -> None:
    import re

    from registry.web.app import STATIC
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"web/static/*"' in package_data
    pages = [client.get(p).text for p in ("/", "/runs/alpha", "/runs/alpha/steps/800")]
    sources = pages + [p.read_text() for p in STATIC.iterdir()]
    urls = {u for text in sources for u in re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'<>)]*", text)}
    assert urls <= {"http://www.w3.org/2000/svg"}  # an XML namespace name, never fetched
    linked = {m for page in pages for m in re.findall(r'(?:src|href)="(/static/[^"]+)"', page)}
    assert linked and all(client.get(u).status_code == 200 for u in linked)


def test_registry_ui_serves_read_only_on_loopback(sqlite_reg: Registry) -> None:
    """The real command in a child process: it binds 127.0.0.1, serves the API, and opened the catalog read-only."""
    import socket
    import subprocess
    import sys

    import httpx

    from tests.helpers import child_env, make_state
    sqlite_reg.publish("alpha", 1, make_state(1))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-m", "registry", "ui", "--port", str(port),
                              "--url", sqlite_reg.url, "--root", str(sqlite_reg.store.root)],
                             env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        assert child.stderr is not None
        banner = child.stderr.readline()  # printed once the socket listens
        assert f"http://127.0.0.1:{port}/" in banner and "read-only" in banner, banner
        runs = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=30).json()
        assert [r["name"] for r in runs] == ["alpha"], child.poll()
    finally:
        child.terminate()
        child.wait(10)
