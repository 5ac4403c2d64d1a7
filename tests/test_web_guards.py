"""What the web view refuses: malformed numbers (a 400, never a 500), other names than loopback without a
token (DNS rebinding), and a port already taken (one error line, before any banner).

The queries go through Starlette's TestClient on both backends, which raises
any exception the app lets escape; the Host check and the port go through a
real ``registry ui`` process.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from registry import Registry  # noqa: E402
from registry.web import create_app  # noqa: E402
from tests.helpers import child_env, make_state, pg_schema_url  # noqa: E402

HUGE = "9" * 5000
HUGE_BYTES = "1" + "0" * 400


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("guards")
    url = (f"sqlite:///{tmp / 'catalog.db'}" if request.param == "sqlite"
           else pg_schema_url(request.getfixturevalue("pg_database")))
    with Registry.open(url=url, root=tmp / "ckpt") as reg:
        for step in (1, 2, 3):
            reg.publish("alpha", step, make_state(step), metrics={"eval/loss": 1.0 / step})
    with Registry.open(url=url, root=tmp / "ckpt", read_only=True, create=False) as ro:
        yield TestClient(create_app(ro), base_url="http://127.0.0.1:8765")


@pytest.mark.parametrize("query", [
    "/api/runs/alpha/gc?policy=keep-last%20%C2%B2",
    "/api/runs/alpha/gc?policy=keep-every%20%D9%A1",  # Arabic-Indic 1, which int() reads
    f"/api/runs/alpha/gc?policy=keep-last%20{HUGE}",
    f"/api/runs/alpha/gc?policy=keep-best%20eval/loss%20{HUGE}",
    f"/api/runs/alpha/gc?policy=max-bytes%20{HUGE_BYTES}",
    f"/api/runs/alpha/gc?policy=keep-last%201,max-bytes%20{HUGE_BYTES}GiB",
    f"/api/runs/alpha/view?points={HUGE}",
    "/api/runs/alpha/view?points=%C2%B2",
    "/api/runs/alpha/view?points=-5",
    "/api/runs/alpha/view?points=lots",
    f"/api/show?ref=alpha@{HUGE}",
])
def test_a_malformed_number_in_a_query_is_a_400(client: TestClient, query: str) -> None:
    response = client.get(query)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert "\n" not in error and len(error) < 400, error


@pytest.mark.parametrize("step", [HUGE, "99999999999999999999", "%C2%B2", "release"])
def test_a_malformed_step_in_a_page_address_is_a_400(client: TestClient, step: str) -> None:
    response = client.get(f"/runs/alpha/steps/{step}")
    assert response.status_code == 400 and "error" in response.text, response.text[:300]
    assert len(response.text) < 5000


def test_good_numbers_in_queries_still_work(client: TestClient) -> None:
    plan = client.get("/api/runs/alpha/gc?policy=keep-last%202,max-bytes%201.5GB").json()
    assert "MaxBytes(1500000000" in plan["policy"] and plan["keep"] == [2, 3], plan
    assert client.get("/api/runs/alpha/view?points=0020").status_code == 200
    assert 'data-status="verified"' in client.get("/runs/alpha/steps/2").text


@contextmanager
def ui(url: str, root: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``registry ui`` in a child process; yields it and its banner line, printed once it listens."""
    child = subprocess.Popen([sys.executable, "-m", "registry", "ui", *args, "--url", url, "--root", str(root)],
                             env={**child_env(), "REGISTRY_UI_TOKEN": ""}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stderr is not None
        yield child, child.stderr.readline()
    finally:
        child.terminate()
        child.wait(10)


def test_without_a_token_only_loopback_names_are_served(reg: Registry) -> None:
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 sends its own name as Host and is refused."""
    reg.publish("alpha", 1, make_state(1))
    with ui(reg.url, reg.store.root, "--port", "0") as (child, banner):
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", banner)
        assert found and found.group(1) != "0", banner
        port = found.group(1)

        session = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

        def get(path: str, host: str) -> httpx.Response:
            return session.get(path, headers={"Host": host})

        for host in (f"rebind.attacker.example:{port}", "rebind.attacker.example", f"localhost.attacker.example:{port}",
                     f"127.0.0.1.attacker.example:{port}", f"0.0.0.0:{port}", f"[::2]:{port}", f"10.0.0.1:{port}",
                     f"localhost:{port}@evil.example", ""):
            for path in ("/api/runs", "/", "/static/chart.js"):
                refused = get(path, host)
                assert refused.status_code in (400, 421), (host, path, refused.status_code)
                assert "alpha" not in refused.text and "\n" not in refused.text.strip(), refused.text
        for host in (f"localhost:{port}", "localhost", f"LocalHost:{port}", f"127.0.0.1:{port}", f"127.5.6.7:{port}",
                     f"[::1]:{port}", "[::1]"):
            served = get("/api/runs", host)
            assert served.status_code == 200 and [r["name"] for r in served.json()] == ["alpha"], (host, served.text)
        session.close()
        assert child.poll() is None


def test_with_a_token_any_name_is_served_to_who_has_it(reg: Registry) -> None:
    """The token is the guard on a shared address: reached by the machine's name, it still answers only with it."""
    reg.publish("alpha", 1, make_state(1))
    ro = Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False)
    try:
        gated = TestClient(create_app(ro, token="s3cret"), base_url="http://gpu-box.example:8765")
        assert gated.get("/api/runs").status_code == 401
        assert gated.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).json()[0]["name"] == "alpha"
    finally:
        ro.close()


def test_a_taken_port_is_one_error_line_and_no_banner(cli, reg: Registry) -> None:  # type: ignore[no-untyped-def]
    reg.publish("alpha", 1, make_state(1))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = cli("ui", "--port", str(port))
    assert result.exit_code == 1, result.output
    assert result.output == (f"registry: error: port {port} on 127.0.0.1 is in use (another registry ui?); "
                             "pick another with --port\n")
