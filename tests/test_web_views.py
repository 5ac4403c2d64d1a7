"""The web view's own documents through Starlette's TestClient, on both backends: run health, runs compared,
a step's tensors and config, diffs, events in words, the refresh stamp, and the step page's load lines.

Every figure is checked against what the rest of the project says about the same catalog: the command line's
``--json``, ``Registry.load``'s tensors, ``Registry.diff``. The browser tests are in test_web_browser.py.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from registry import Registry  # noqa: E402
from registry.cli import main  # noqa: E402
from registry.web import create_app  # noqa: E402
from tests.helpers import make_state  # noqa: E402
from tests.test_web import ro, site  # noqa: E402, F401 - the same site and read-only registry as the API tests
from tests.ui_site import CONFIG, Site  # noqa: E402

HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


@pytest.fixture(scope="module")
def client(ro: Registry) -> TestClient:
    return TestClient(create_app(ro), base_url="http://127.0.0.1")


def cli(site: tuple[str, Path, Site], *args: str, cwd: Path | None = None) -> Any:
    url, root, _ = site
    result = CliRunner().invoke(main, ["--url", url, "--root", str(root), *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in args else result.output


def get(client: TestClient, url: str, status: int = 200) -> Any:
    response = client.get(url)
    assert response.status_code == status, response.text
    return response.json()


def test_health_counts_every_status_and_says_when_a_run_last_changed(client: TestClient,
                                                                      site: tuple[str, Path, Site]) -> None:
    health = {r["name"]: r for r in get(client, "/api/health")}
    for run in ("alpha", "beta", "gamma"):
        listed = cli(site, "ls", run, "--all", "--json")
        counts: dict[str, int] = {}
        for c in listed:
            counts[c["status"]] = counts.get(c["status"], 0) + 1
        assert health[run]["statuses"] == counts
        newest = max(c["created_at"] for c in listed)
        assert health[run]["last_updated"] >= newest
    assert (health["alpha"]["corrupt"], health["alpha"]["failed"]) == (1, 1)
    assert (health["beta"]["corrupt"], health["beta"]["failed"]) == (0, 0)
    assert {k: v for k, v in health["alpha"].items() if k in get(client, "/api/runs")[0]} == \
        get(client, "/api/runs")[0]  # the runs document, with health added


def test_the_runs_page_shows_damage_not_just_a_count(client: TestClient) -> None:
    html = client.get("/").text
    alpha = html.split('data-run="alpha"', 1)[1].split("</tr>", 1)[0]
    assert "1 corrupt, 1 failed" in alpha and 'class="health damaged"' in alpha
    beta = html.split('data-run="beta"', 1)[1].split("</tr>", 1)[0]
    assert "healthy" in beta and "last updated" in html


def test_compare_overlays_runs_with_their_latest_and_best(client: TestClient, ro: Registry,
                                                           site: tuple[str, Path, Site]) -> None:
    doc = get(client, "/api/compare?run=alpha&run=beta&key=eval/loss&key=eval/acc")
    assert [(s["run"], s["key"]) for s in doc["series"]] == \
        [("alpha", "eval/loss"), ("alpha", "eval/acc"), ("beta", "eval/loss"), ("beta", "eval/acc")]
    for s in doc["series"]:
        assert s["points"] == [[p["step"], p["value"]] for p in cli(site, "metrics", s["run"], "--key", s["key"],
                                                                    "--json")]
        assert s["latest"]["step"] == ro.resolve(f"{s['run']}@latest").step
        assert s["best"]["step"] == ro.resolve(f"{s['run']}@best:{s['key']}").step
    best_max = get(client, "/api/compare?run=alpha&key=eval/loss&mode=max")["series"][0]["best"]
    assert best_max["step"] == ro.resolve("alpha@best:eval/loss:max").step != ro.resolve("alpha@best:eval/loss").step
    rows = {r["run"]: r for r in doc["table"]}
    sorted_runs = {r["name"]: r for r in cli(site, "runs", "--sort-by", "eval/loss", "--json")}
    for run, row in rows.items():
        assert row["metrics"]["eval/loss"]["best"] == sorted_runs[run]["best"]["value"]
        assert row["latest_verified_step"] == sorted_runs[run]["latest_verified_step"]
        assert row["latest_step"] == max(c["step"] for c in cli(site, "ls", run, "--all", "--json"))
    assert doc["available_keys"] == ["eval/acc", "eval/loss", "train/loss"]
    assert get(client, "/api/compare?run=alpha")["keys"] == ["eval/loss"]  # the run page's default


def test_compare_refuses_what_it_cannot_draw(client: TestClient) -> None:
    assert "at least one run" in get(client, "/api/compare", 400)["error"]
    assert "min or max" in get(client, "/api/compare?run=alpha&mode=up", 400)["error"]
    many = "&".join(f"run=r{i}" for i in range(13))
    assert "at most 12" in get(client, f"/api/compare?{many}", 400)["error"]
    assert "nope" in get(client, "/api/compare?run=nope", 404)["error"]
    assert client.get("/compare?run=alpha&run=beta").status_code == 200


def test_a_steps_tensors_and_config_are_what_a_load_returns(client: TestClient, ro: Registry) -> None:
    doc = get(client, "/api/runs/alpha/steps/800/contents")
    ckpt = ro.load("alpha@800", broadcast=False)
    assert doc["error"] is None
    assert [(t["name"], t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]] == \
        [(n, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
         for n, t in sorted(ckpt.state_dict.items())]
    assert doc["config"] == ckpt.config == CONFIG
    from html import unescape
    html = unescape(client.get("/runs/alpha/steps/800").text)
    assert all(f"<code>{n}</code>" in html for n in ckpt.state_dict) and "16×4" in html and "bfloat16" in html
    assert '"lr": 0.0003' in html
    gone = get(client, "/api/runs/alpha/steps/200/contents")
    assert gone["tensors"] == [] and "deleted step has no payload" in gone["error"]


def test_the_step_page_loads_with_the_uis_root_or_says_what_to_do(client: TestClient, ro: Registry,
                                                                   site: tuple[str, Path, Site],
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from html import unescape
    url, root, _ = site
    page = unescape(client.get("/runs/alpha/steps/800").text)
    shell = page.split('<pre class="shell">', 1)[1].split("</pre>", 1)[0].splitlines()
    python = page.split('<pre class="python">', 1)[1].split("</pre>", 1)[0]
    assert f"--root {root}" in shell[0] and f"root={str(root)!r}" in python
    assert "--url" in shell[0]  # this site's catalog is not the root's default one
    from registry.fs.store import Store
    from registry.views import load_snippets
    own = load_snippets(ro.resolve("alpha@800"), root=root, url=f"sqlite:///{Store.default_catalog(root)}")
    assert "--url" not in own["shell"] and "url=" not in own["python"]
    hidden = load_snippets(ro.resolve("alpha@800"), root=root, url="postgresql://u:s3cret@db/x")
    assert "s3cret" not in hidden["shell"] + hidden["python"] and "postgresql://u:***@db/x" in hidden["shell"]
    monkeypatch.chdir(tmp_path)  # the lines work from anywhere, not only where the UI was started
    monkeypatch.delenv("REGISTRY_ROOT", raising=False)
    monkeypatch.delenv("REGISTRY_URL", raising=False)
    for line in shell:
        result = CliRunner().invoke(main, shlex.split(line)[1:], catch_exceptions=False)
        assert result.exit_code == 0 and "alpha" in result.output, result.output
    opened = python.split("with ", 1)[1].split(" as reg", 1)[0]
    with eval(opened, {"Registry": Registry}) as reg:  # noqa: S307 - the snippet the page shows, run as written
        assert reg.resolve("alpha@800").path == ro.resolve("alpha@800").path

    corrupt = unescape(client.get("/runs/alpha/steps/1200").text)
    assert "reg.load(" not in corrupt and "Load it" not in corrupt
    remedy = corrupt.split('<pre id="remedy" class="shell">', 1)[1].split("</pre>", 1)[0]
    assert f"--root {root}" in remedy and "verify alpha@1200" in remedy and " fsck" in remedy
    assert "resolve alpha@latest" in remedy and "falls back" in corrupt


def test_events_read_as_words_with_one_time_format(client: TestClient, ro: Registry) -> None:
    events = get(client, "/api/runs/alpha/timeline")
    assert [e["id"] for e in events] == [e.id for e in reversed(ro.events("alpha"))]
    assert all(not HEX64.search(e["text"]) and "{" not in e["text"] for e in events)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", e["time"]) for e in events)
    texts = {e["kind"]: e["text"] for e in events}
    assert texts["corrupt"].startswith("marked step 1200 corrupt: bit flip found by a scrub")
    assert texts["publish-failed"] == "publishing step 1700 failed: out of disk while writing"
    assert texts["tag"].startswith("tagged step ")
    step = client.get("/runs/alpha/steps/1200").text.split('id="step-events"', 1)[1]
    assert not HEX64.search(step) and "manifest_sha256" not in step and "marked step 1200 corrupt" in step


def test_diff_is_the_librarys(client: TestClient, ro: Registry) -> None:
    doc = get(client, "/api/diff?a=alpha@800&b=alpha@1600")
    assert doc == ro.diff("alpha@800", "alpha@1600").to_json()
    html = client.get("/diff?a=alpha@800&b=alpha@1600").text
    changed = [t["name"] for t in doc["tensors"]["content"]]
    assert changed and all(f"<code>{n}</code>" in html for n in changed)
    assert "eval/loss" in html
    same = get(client, "/api/diff?a=alpha@800&b=alpha@release")
    assert same["identical"] and 'data-identical="true"' in client.get("/diff?a=alpha@800&b=alpha@release").text
    assert client.get("/diff?a=alpha@800&b=alpha@99").status_code == 404
    assert "?a=RUN@STEP&amp;b=RUN@STEP" in client.get("/diff?a=alpha@800").text
    assert 'action="/diff"' in client.get("/runs/alpha/steps/1600").text


def test_the_stamp_moves_when_a_step_is_published(reg: Registry) -> None:
    reg.publish("live", 1, make_state(1), metrics={"eval/loss": 1.0})
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        client = TestClient(create_app(ro), base_url="http://127.0.0.1")
        before = get(client, "/api/runs/live/stamp")
        assert get(client, "/api/runs/live/stamp") == before  # nothing happened, nothing moved
        reg.publish("live", 2, make_state(2), metrics={"eval/loss": 0.5})
        after = get(client, "/api/runs/live/stamp")
        reg.log_metrics("live", 3, {"train/loss": 0.4})  # a curve growing between checkpoints moves it too
        reg.flush()
        logged = get(client, "/api/runs/live/stamp")
    assert (before["latest_step"], after["latest_step"]) == (1, 2) and after != before
    assert after["last_updated"] >= before["last_updated"]
    assert logged["last_updated"] > after["last_updated"] and logged["latest_step"] == 2


def test_a_sharded_steps_tensors_come_from_its_dcp_metadata(reg: Registry) -> None:
    import torch
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.float16)}, "rng": torch.arange(5)}
    reg.publish("s", 10, state, sharded=True, config={"lr": 1})
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        doc = get(TestClient(create_app(ro), base_url="http://127.0.0.1"), "/api/runs/s/steps/10/contents")
        full = ro.load("s@10", broadcast=False).state_dict
    assert doc["error"] is None and doc["config"] == {"lr": 1}
    assert [(t["name"], t["shape"], t["dtype"], t["bytes"]) for t in doc["tensors"]] == \
        [(n, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
         for n, t in sorted(full.items())]


def test_pages_show_a_loading_state_until_their_data_arrives(client: TestClient) -> None:
    run = client.get("/runs/alpha").text
    assert run.count("loading…") == 3  # the chart, the checkpoint table, the events: never an empty table
    assert "loading…" in client.get("/compare?run=alpha").text


def test_a_steps_tag_notes_params_and_code_are_the_same_on_the_page_the_api_and_show(reg: Registry) -> None:
    reg.begin_attempt("noted")
    reg.publish("noted", 1, make_state(1), metrics={"eval/loss": 1.0})
    reg.tag("noted", 1, "release", note="passed the eval gate")
    reg.set_params("noted", {"lr": 0.001})
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        client = TestClient(create_app(ro), base_url="http://127.0.0.1")
        page = client.get("/runs/noted/steps/1").text
        api = get(client, "/api/show?ref=noted@1")
    shown = json.loads(CliRunner().invoke(main, ["--url", reg.url, "--root", str(reg.store.root), "show", "noted@1",
                                                 "--json"]).output)
    assert "release (passed the eval gate)" in page and "python" in page  # the attempt's environment line
    assert api["tag_notes"] == shown["tag_notes"] == {"release": "passed the eval gate"}
    assert api["params"] == shown["params"] == {"lr": 0.001}
    assert api["attempt"] == shown["attempt"] and api["attempt"]["environment"]["python"]
