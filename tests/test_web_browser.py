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
from pathlib import Path
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
from tests.helpers import IN_CI, pg_schema_url  # noqa: E402
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
    best = driver.find_element(By.CSS_SELECTOR, '#runs th[data-col="4"]')
    best.click()
    best.click()  # descending: the worst best value first
    order = [r.get_attribute("data-run") for r in driver.find_elements(By.CSS_SELECTOR, "#runs tbody tr")]
    assert order == ["gamma", "beta", "alpha"]
    driver.save_screenshot(str(page["shots"] / "runs.png"))


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


def test_step_page_shows_a_checkpoint_and_how_to_load_it(page: dict[str, Any]) -> None:
    driver = page["driver"]
    driver.get(page["base"] + "/runs/alpha")
    wait_for(driver, "document.body.dataset.ready === '1'")
    driver.find_element(By.CSS_SELECTOR, '#checkpoints tr[data-step="800"] a').click()
    wait_for(driver, "document.getElementById('step') !== null")
    assert driver.find_element(By.ID, "step").get_attribute("data-status") == "verified"
    assert "reg.load('alpha@800')" in driver.find_element(By.CSS_SELECTOR, "pre.python").text
    names = [td.text for td in driver.find_elements(By.CSS_SELECTOR, "#files tbody td:first-child")]
    assert names == [f["name"] for f in cli_json(page, "show", "alpha@800")["files"]]
    driver.save_screenshot(str(page["shots"] / "step.png"))
