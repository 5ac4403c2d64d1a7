"""The web view in a real headless browser (Debian's chromium via Selenium), against a real catalog on both backends.

One uvicorn server and one browser per backend. The pages must draw what the
API says: a marker per checkpoint coloured by status, tag labels, the curve;
the retention preview must show exactly what ``gc --dry-run --json`` plans.
Screenshots are kept under pytest's temp dir (``ui-screens*``), never in the
repository. Without chromium the tests are skipped, and say so
(``scripts/test`` installs it where it can); in CI they fail instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium")

from click.testing import CliRunner  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from registry import Registry  # noqa: E402
from registry.cli import main  # noqa: E402
from registry.web import create_app  # noqa: E402
from registry.web.server import background_server  # noqa: E402
from tests.helpers import IN_CI, make_state, pg_schema_url  # noqa: E402
from tests.ui_site import (BROWSER_MISSING, CHROMEDRIVER, CHROMIUM, Site, browser, build_site,  # noqa: E402
                           screenshot_run_page, wait_for)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def page(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A served site and a browser on it: {"base", "driver", "url", "root", "site", "shots"}."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if IN_CI:
            pytest.fail(BROWSER_MISSING.replace("; browser tests skipped", "; CI must run the browser tests"))
        pytest.skip(BROWSER_MISSING)
    tmp = tmp_path_factory.mktemp("ui")
    url = (f"sqlite:///{tmp / 'catalog.db'}" if request.param == "sqlite"
           else pg_schema_url(request.getfixturevalue("pg_database")))
    with Registry.open(url=url, root=tmp / "ckpt") as reg:
        site = build_site(reg)
    with Registry.open(url=url, root=tmp / "ckpt", read_only=True, create=False) as ro, \
            background_server(create_app(ro)) as base:
        driver = browser(tmp)
        try:
            yield {"base": base, "driver": driver, "url": url, "root": tmp / "ckpt", "site": site,
                   "shots": tmp_path_factory.mktemp(f"ui-screens-{request.param}")}
        finally:
            driver.quit()


def cli_json(page: dict[str, Any], *args: str) -> Any:
    result = CliRunner().invoke(main, ["--url", page["url"], "--root", str(page["root"]), *args, "--json"],
                                catch_exceptions=False)
    return json.loads(result.output)


def test_runs_page_filters_and_sorts(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/?metric=eval/loss")
    rows = driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")
    assert [r.get_attribute("data-run") for r in rows] == list(page["site"].runs)
    driver.find_element(By.ID, "filter").send_keys("gam")
    visible = [r.get_attribute("data-run") for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")
               if r.is_displayed()]
    assert visible == ["gamma"]
    driver.find_element(By.ID, "filter").clear()
    best = driver.find_element(By.CSS_SELECTOR, '#runs th[data-col="6"]')
    best.click()
    best.click()  # descending: the worst best value first
    order = [r.get_attribute("data-run") for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")]
    assert order == ["gamma", "beta", "alpha"]
    driver.save_screenshot(str(page["shots"] / "runs.png"))


def test_runs_page_shows_each_runs_health_and_last_update(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/")
    health = {r.get_attribute("data-run"): r.find_element(By.CSS_SELECTOR, "td.health").text
              for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")}
    statuses = [c["status"] for c in cli_json(page, "ls", "alpha", "--all")]
    assert health["alpha"] == f"{statuses.count('corrupt')} corrupt, {statuses.count('failed')} failed" == \
        "1 corrupt, 1 failed"
    assert health["beta"] == health["gamma"] == "healthy"
    heads = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#runs thead th")]
    assert "health" in heads and "last updated" in heads
    alpha = driver.find_element(By.CSS_SELECTOR, '#runs tr[data-run="alpha"]')
    newest = max(c["created_at"] for c in cli_json(page, "ls", "alpha", "--all"))
    assert alpha.find_elements(By.TAG_NAME, "td")[8].text[:16] == newest.replace("T", " ")[:16]


def test_run_page_marks_every_checkpoint_by_status(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/runs/alpha")
    wait_for(driver, "document.body.dataset.ready === '1'")
    site: Site = page["site"]
    markers = driver.find_elements(By.CSS_SELECTOR, "#chart svg .ckpt-marker")
    listed = cli_json(page, "ls", "alpha", "--all")
    assert len(markers) == site.checkpoints == len(listed)
    assert sorted((int(m.get_attribute("data-step")), m.get_attribute("data-status")) for m in markers) == \
        sorted((c["step"], c["status"]) for c in listed)
    labels = {(int(t.get_attribute("data-step")), t.text)
              for t in driver.find_elements(By.CSS_SELECTOR, "#chart svg .tag-label")}
    assert labels == {(c["step"], tag) for c in listed for tag in c["tags"]}
    assert driver.find_element(By.CSS_SELECTOR, "#chart svg polyline.curve").get_attribute("points").count(",") == 8
    refs = {m.get_attribute("data-ref"): int(m.get_attribute("data-step"))
            for m in driver.find_elements(By.CSS_SELECTOR, "#chart svg .ref-marker")}
    latest, best = (cli_json(page, "show", ref)["step"] for ref in ("alpha@latest", "alpha@best:eval/loss"))
    assert refs == ({"latest best": latest} if latest == best else {"latest": latest, "best": best})
    assert driver.find_element(By.CSS_SELECTOR, "#chart svg .y-label").text == "eval/loss"
    assert driver.find_element(By.CSS_SELECTOR, "#chart svg .x-label").text == "step"
    kinds = {li.get_attribute("data-kind") for li in driver.find_elements(By.CSS_SELECTOR, "#events li")}
    assert {"publish", "tag", "corrupt", "delete"} <= kinds

    from selenium.webdriver.support.ui import Select
    Select(driver.find_element(By.ID, "key")).select_by_value("train/loss")
    wait_for(driver, "document.body.dataset.ready === '1' && document.getElementById('key').value === 'train/loss'")
    points = driver.find_element(By.CSS_SELECTOR, "#chart svg polyline.curve").get_attribute("points").split()
    assert len(points) == site.dense_points  # short enough to be drawn whole
    assert len(driver.find_elements(By.CSS_SELECTOR, "#chart svg .ckpt-marker")) == site.checkpoints
    driver.save_screenshot(str(page["shots"] / "run-train-loss.png"))


def test_retention_preview_matches_gc_dry_run(page: dict[str, Any]) -> None:
    driver = page["driver"]
    policy = "keep-last 2, keep-best eval/loss 1"
    screenshot_run_page(driver, page["base"], page["shots"] / "run-page.png", policy=policy)
    plan = cli_json(page, "gc", "alpha", "--keep-last", "2", "--keep-best", "eval/loss=1", "--dry-run")
    rows = driver.find_elements(By.CSS_SELECTOR, "#plan-table tr[data-step]")
    assert [(int(r.get_attribute("data-step")), r.get_attribute("data-action")) for r in rows] == \
        [(d["step"], d["action"]) for d in plan["decisions"]]
    reasons = [r.find_elements(By.TAG_NAME, "td")[4].text for r in rows]
    assert reasons == ["; ".join(d["reasons"]) for d in plan["decisions"]]
    assert f"would delete {len(plan['delete'])} of {len(plan['decisions'])}" in \
        driver.find_element(By.CSS_SELECTOR, "#plan .summary").text
    assert plan["delete"], "the preview must show a deletion to prove anything"
    assert [c["step"] for c in cli_json(page, "ls", "alpha")] == [400, 800, 1200, 1400, 1600]  # nothing deleted

    driver.find_element(By.ID, "policy").clear()
    driver.find_element(By.ID, "policy").send_keys("keep-sometimes 2")
    driver.find_element(By.CSS_SELECTOR, "#retention button").click()
    wait_for(driver, "document.getElementById('plan').dataset.ready === '1'")
    assert "keep-last N" in driver.find_element(By.CSS_SELECTOR, "#plan .error").text
    hint = driver.find_element(By.CSS_SELECTOR, "#plan .hint:not(.did-you-mean)").text
    assert hint.startswith("Type in this field") and "keep-best eval/acc 2" in hint and "eval/loss" in hint
    assert not driver.find_elements(By.CSS_SELECTOR, "#plan .did-you-mean")  # keep-sometimes is no typo

    driver.find_element(By.ID, "policy").clear()
    driver.find_element(By.ID, "policy").send_keys("keep-lst 2")
    driver.find_element(By.CSS_SELECTOR, "#retention button").click()
    wait_for(driver, "document.getElementById('plan').dataset.ready === '1'")
    assert driver.find_element(By.CSS_SELECTOR, "#plan .did-you-mean").text == "Did you mean keep-last?"


def test_step_page_shows_a_checkpoint_and_how_to_load_it(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/runs/alpha")
    wait_for(driver, "document.body.dataset.ready === '1'")
    driver.find_element(By.CSS_SELECTOR, '#checkpoints tr[data-step="800"] a').click()
    wait_for(driver, "document.getElementById('step') !== null")
    assert driver.find_element(By.ID, "step").get_attribute("data-status") == "verified"
    python = driver.find_element(By.CSS_SELECTOR, "pre.python").text
    assert "reg.load('alpha@800')" in python and f"Registry.open(root={str(page['root'])!r}" in python
    assert f"registry --root {page['root']} " in driver.find_element(By.CSS_SELECTOR, "pre.shell").text
    names = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "#files tbody td:first-child")]
    assert names == [f["name"] for f in cli_json(page, "show", "alpha@800")["files"]]
    driver.save_screenshot(str(page["shots"] / "step.png"))


def test_step_page_lists_its_tensors_and_config(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/runs/alpha/steps/800")
    rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in driver.find_elements(By.CSS_SELECTOR, "#tensors tbody tr")]
    with Registry.open(url=page["url"], root=page["root"], read_only=True, create=False) as reg:
        state = reg.load("alpha@800", broadcast=False).state_dict
    assert [r[0] for r in rows] == sorted(state)
    for name, shape, dtype, _size, file in rows:
        tensor = state[name]
        assert shape == ("×".join(map(str, tensor.shape)) or "scalar")
        assert dtype == str(tensor.dtype).removeprefix("torch.") and file == "model.safetensors"
    assert '"optimizer"' in driver.find_element(By.ID, "config").text
    driver.save_screenshot(str(page["shots"] / "step-tensors.png"))

    driver.get(page["base"] + "/runs/alpha/steps/1200")  # corrupt: what to do, not how to load
    assert not driver.find_elements(By.CSS_SELECTOR, "pre.python")
    remedy = driver.find_element(By.ID, "remedy").text
    assert f"registry --root {page['root']}" in remedy and "verify alpha@1200" in remedy and "fsck" in remedy


def test_two_runs_overlaid_and_compared(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/")
    for run in ("alpha", "beta"):
        driver.find_element(By.CSS_SELECTOR, f'#runs tr[data-run="{run}"] input[type=checkbox]').click()
    driver.find_element(By.ID, "compare").click()
    wait_for(driver, "document.body.dataset.ready === '1'")
    curves = {c.get_attribute("data-series"): c.get_attribute("points").split()
              for c in driver.find_elements(By.CSS_SELECTOR, "#chart svg polyline.curve")}
    assert set(curves) == {"alpha", "beta"}
    for run in ("alpha", "beta"):
        assert len(curves[run]) == len(cli_json(page, "metrics", run, "--key", "eval/loss"))
    rows = {tr.get_attribute("data-run"): tr for tr in driver.find_elements(By.CSS_SELECTOR, "#compare-table tbody tr")}
    assert set(rows) == {"alpha", "beta"}
    best = {r["name"]: r["best"] for r in cli_json(page, "runs", "--sort-by", "eval/loss")}
    for run, tr in rows.items():
        value, at = tr.find_element(By.CSS_SELECTOR, "td.best").text.split(" @")
        assert float(value) == pytest.approx(best[run]["value"], rel=1e-3) and int(at) == best[run]["step"]
    refs = {m.get_attribute("data-step") for m in driver.find_elements(By.CSS_SELECTOR, "#chart svg .ref-marker")}
    assert {str(best["alpha"]["step"]), str(best["beta"]["step"])} <= refs
    driver.save_screenshot(str(page["shots"] / "compare.png"))

    # a second metric on the same chart: one curve per run and metric
    driver.find_element(By.CSS_SELECTOR, '#keys input[value="eval/acc"]').click()
    wait_for(driver, "document.querySelectorAll('#chart svg polyline.curve').length === 4")
    assert "eval/acc" in driver.find_element(By.CSS_SELECTOR, "#chart svg .y-label").text


def test_log_scale_and_smoothing_redraw_the_curve(page: dict[str, Any]) -> None:
    import math
    driver = page["driver"]
    driver.get(page["base"] + "/runs/alpha?key=train/loss")
    wait_for(driver, "document.body.dataset.ready === '1' && document.getElementById('key').value === 'train/loss'")
    values = [p["value"] for p in cli_json(page, "metrics", "alpha", "--key", "train/loss")]

    def ys() -> list[float]:
        points = driver.find_element(By.CSS_SELECTOR, "#chart svg polyline.curve").get_attribute("points").split()
        return [float(p.split(",")[1]) for p in points]

    def spread(transform: Any, y: list[float], of: list[float] | None = None) -> float:
        """How far the drawn y are from a straight map of transform(value), in pixels."""
        t = [transform(v) for v in (values if of is None else of)]
        (ta, tb), (ya, yb) = (t[0], t[-1]), (y[0], y[-1])
        return max(abs(ya + (tv - ta) / (tb - ta) * (yb - ya) - yv) for tv, yv in zip(t, y))

    linear = ys()
    assert spread(lambda v: v, linear) < 1 < spread(math.log10, linear)  # pixels (points are rounded to 0.1)
    driver.find_element(By.ID, "log").click()
    wait_for(driver, "document.querySelector('#chart svg').dataset.scale === 'log'")
    logged = ys()
    assert spread(math.log10, logged) < 1 < spread(lambda v: v, logged)
    assert "(log scale)" in driver.find_element(By.CSS_SELECTOR, "#chart svg .y-label").text
    driver.find_element(By.ID, "log").click()
    wait_for(driver, "document.querySelector('#chart svg').dataset.scale === 'linear'")
    driver.execute_script("const s = document.getElementById('smooth'); s.value = '0.9';"
                          "s.dispatchEvent(new Event('input'));")
    wait_for(driver, "document.querySelector('#chart svg .y-label').textContent.includes('smoothed 0.9')")
    smoothed = ys()
    ema, acc = [], 0.0
    for n, v in enumerate(values, 1):  # TensorBoard's debiased exponential moving average
        acc = 0.9 * acc + 0.1 * v
        ema.append(acc / (1 - 0.9 ** n))
    assert spread(lambda v: v, smoothed, ema) < 1 < spread(lambda v: v, smoothed)


def test_runs_table_sorts_by_a_metric_column_and_keeps_the_order_in_the_url(page: dict[str, Any]) -> None:
    from urllib.parse import parse_qs, urlparse

    from selenium.webdriver.support.ui import Select
    driver = page["driver"]
    driver.get(page["base"] + "/?columns=eval/loss, eval/acc:max")

    def heads() -> dict[str, Any]:
        return {th.get_attribute("data-spec"): th
                for th in driver.find_elements(By.CSS_SELECTOR, "#runs th[data-spec]")}

    def order() -> list[str]:
        return [r.get_attribute("data-run") for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")]

    def sort_in_url() -> list[str]:
        return parse_qs(urlparse(driver.current_url).query).get("sort", [])

    acc = heads()["eval/acc:max"]
    assert list(heads()) == ["eval/loss:min", "eval/acc:max"] and acc.text == "best eval/acc (max)"
    assert "RUN@best:eval/acc:max" in acc.get_attribute("title")
    ranked = [r["name"] for r in cli_json(page, "runs", "--sort-by", "eval/acc:max")]
    acc.click()  # a best-value column sorts best first: the highest eval/acc
    assert order() == ranked and sort_in_url() == ["eval/acc:max"]
    acc.click()
    assert order() == ranked[::-1] and sort_in_url() == ["-eval/acc:max"]
    driver.get(driver.current_url)  # the server repeats the order the URL says
    assert order() == ranked[::-1] and heads()["eval/acc:max"].get_attribute("data-dir") == "asc"
    for row in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr"):
        run = row.get_attribute("data-run")
        best = cli_json(page, "show", f"{run}@best:eval/acc:max")
        cell = row.find_element(By.CSS_SELECTOR, 'td[data-spec="eval/acc:max"]')
        assert cell.text == f"{best['metrics']['eval/acc']:.6g} @{best['step']}"
    badges = {r.get_attribute("data-run"): r.find_element(By.CSS_SELECTOR, ".state")
              for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")}
    states = {r["name"]: r["state"] for r in json.loads(driver.execute_script(
        "const x = new XMLHttpRequest(); x.open('GET', '/api/health', false); x.send(); return x.responseText;"))}
    assert {run: b.text for run, b in badges.items()} == states and states["gamma"] == "idle"
    assert "10 minutes" in badges["gamma"].get_attribute("title")

    Select(driver.find_element(By.ID, "add-column")).select_by_value("train/loss")  # adds it and reloads
    wait_for(driver, "document.querySelector('#runs th[data-spec=\"train/loss:min\"]') !== null")
    best = cli_json(page, "show", "alpha@best:train/loss")
    alpha = driver.find_element(By.CSS_SELECTOR, '#runs tr[data-run="alpha"] td[data-spec="train/loss:min"]')
    assert alpha.text == f"{best['metrics']['train/loss']:.6g} @{best['step']}"
    assert driver.find_element(By.CSS_SELECTOR, '#runs tr[data-run="beta"] td[data-spec="train/loss:min"]').text == "-"
    driver.find_element(By.ID, "where").send_keys("eval/loss < 0.5")
    driver.find_element(By.CSS_SELECTOR, "#table-form button").click()
    wait_for(driver, "document.getElementById('filtered') !== null")
    assert order() == ["beta", "alpha"]  # gamma's best eval/loss is 0.7; still sorted as the URL said
    assert list(heads()) == ["eval/loss:min", "eval/acc:max", "train/loss:min"] and sort_in_url() == ["-eval/acc:max"]
    driver.save_screenshot(str(page["shots"] / "runs-columns.png"))


def test_compare_page_shows_where_the_configs_differ(page: dict[str, Any]) -> None:
    from tests.ui_site import CONFIG, CONFIGS, screenshot_compare_page
    driver = page["driver"]
    screenshot_compare_page(driver, page["base"], page["shots"] / "compare-config.png")
    rows = driver.find_elements(By.CSS_SELECTOR, "#compare-config tbody tr")
    configs = [CONFIG, CONFIGS["beta"], CONFIGS["gamma"]]
    assert [r.get_attribute("data-key") for r in rows] == ["hidden", "optimizer.lr", "optimizer.momentum",
                                                           "optimizer.name"]
    lr = rows[1].find_elements(By.TAG_NAME, "td")
    assert [td.text for td in lr] == ["optimizer.lr"] + [json.dumps(c["optimizer"]["lr"]) for c in configs]
    same, differs = lr[1], lr[2]  # alpha is the baseline; beta's lr differs from it
    assert differs.value_of_css_property("background-color") != same.value_of_css_property("background-color")
    assert [td.text for td in rows[2].find_elements(By.TAG_NAME, "td")][1:] == ["not set", "not set", "0.9"]
    heads = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#compare-config th")]
    latest = [cli_json(page, "show", f"{r}@latest")["step"] for r in ("alpha", "beta", "gamma")]
    assert heads == ["key"] + [f"{r}@{s}" for r, s in zip(("alpha", "beta", "gamma"), latest)]
    driver.find_element(By.LINK_TEXT, f"beta@{latest[1]}").click()
    wait_for(driver, "document.getElementById('step') !== null")
    assert '"hidden": 16' in driver.find_element(By.ID, "config").text


def test_step_and_run_pages_show_only_what_was_given(page: dict[str, Any]) -> None:
    driver = page["driver"]

    def facts(step: int) -> dict[str, str]:
        driver.get(f"{page['base']}/runs/alpha/steps/{step}")
        terms = driver.find_elements(By.CSS_SELECTOR, "main > dl:first-of-type dt")
        return {dt.text: dt.find_element(By.XPATH, "following-sibling::dd[1]").text for dt in terms}

    shown = cli_json(page, "show", "alpha@400")
    assert (shown["epoch"], shown["policy_version"]) == (0, None)  # defaulted: never given
    first = facts(400)
    assert "epoch" not in first and "policy version" not in first and "None" not in first.values()
    assert first["consumed samples"] == str(shown["consumed_samples"])
    assert facts(800)["epoch"] == "1"
    driver.save_screenshot(str(page["shots"] / "step-facts.png"))

    driver.get(page["base"] + "/runs/gamma")  # trained a day ago
    wait_for(driver, "document.getElementById('live-state').dataset.state !== undefined")
    state = driver.find_element(By.ID, "live-state")
    assert state.text.startswith("idle · updated ") and "10 minutes" in state.get_attribute("title")
    assert not driver.find_element(By.ID, "refresh").is_selected()


def test_auto_refresh_picks_up_a_step_published_while_the_page_is_open(page: dict[str, Any]) -> None:
    """Runs last: it adds a run to the shared catalog."""
    driver = page["driver"]
    with Registry.open(url=page["url"], root=page["root"]) as writer:
        writer.publish("live", 100, make_state(1), metrics={"eval/loss": 1.0})
        driver.get(page["base"] + "/runs/live?refresh=1")
        wait_for(driver, "document.body.dataset.ready === '1'")
        assert driver.find_element(By.ID, "refresh").is_selected()  # just changed: taken to be training
        assert "training" in driver.find_element(By.ID, "live-state").text
        assert [m.get_attribute("data-step") for m in driver.find_elements(By.CSS_SELECTOR, ".ckpt-marker")] == \
            ["100"]
        writer.publish("live", 200, make_state(2), metrics={"eval/loss": 0.5})
        wait_for(driver, "document.querySelector('#chart .ckpt-marker[data-step=\"200\"]') !== null"
                         " && document.querySelector('#checkpoints tr[data-step=\"200\"]') !== null")
    assert driver.find_element(By.CSS_SELECTOR, '#chart .ref-marker[data-step="200"]').get_attribute("data-ref") \
        == "latest best"
