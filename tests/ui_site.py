"""A small real catalog for the web view's tests and for ``scripts/screenshot``: every status, tags, curves.

``build_site(reg)`` publishes three runs through the public API: ``alpha``
has a dense ``train/loss`` curve, an ``eval/loss`` at each checkpoint, a config and one
checkpoint of each status (verified, published, corrupt, deleted, failed),
two tags and a retention pass; ``beta`` and ``gamma`` are there to be sorted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from registry import Registry
from registry.retention import KeepEvery, KeepLast
from tests.helpers import make_state, mark_corrupt

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CONFIG = {"model": "toy-mlp", "hidden": 8, "optimizer": {"name": "adamw", "lr": 0.0003}}  # alpha's config.json
CONFIGS = {"beta": {"model": "toy-mlp", "hidden": 16, "optimizer": {"name": "adamw", "lr": 0.001}},
           "gamma": {"model": "toy-mlp", "hidden": 8, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}}}
IDLE_FOR = timedelta(days=1)  # gamma was trained this long ago: idle, where alpha and beta are training
BROWSER_MISSING = "chromium not installed (/usr/bin/chromium, /usr/bin/chromedriver); browser tests skipped"


@dataclass(frozen=True)
class Site:
    runs: tuple[str, ...]
    checkpoints: int  # of alpha, every status
    dense_points: int  # train/loss points of alpha


def build_site(reg: Registry) -> Site:
    for step in range(10, 1610, 10):  # a dense training curve, most points between checkpoints
        reg.log_metrics("alpha", step, {"train/loss": 2.0 * math.exp(-step / 600) + 0.05 * math.sin(step / 37)})
    for i, step in enumerate(range(200, 1601, 200)):
        reg.publish("alpha", step, make_state(i), metrics={"eval/loss": 1.5 * math.exp(-step / 700) + 0.1,
                                                            "eval/acc": 1 - math.exp(-step / 500)},
                    config=CONFIG, verify=step % 400 == 0, epoch=step // 800, consumed_samples=step * 32)
    reg.tag("alpha", 800, "release")
    reg.tag("alpha", 1200, "best-eval")
    reg.apply_retention("alpha", KeepEvery(400) | KeepLast(3))  # deletes 200, 600 and 1000
    mark_corrupt(reg, next(i for i in reg.checkpoints("alpha") if i.step == 1200), "bit flip found by a scrub")
    claim = reg.catalog.claim("alpha", 1700, path="alpha/step-00001700", writer=reg.writer, overwrite=False)
    reg.catalog.abort_claim(claim, reason="out of disk while writing", old_payload_intact=False)
    for name, best in (("beta", 0.3), ("gamma", 0.7)):
        for i, step in enumerate((100, 200)):
            reg.publish(name, step, make_state(10 + i), metrics={"eval/loss": best + 0.1 * (1 - i),
                                                                  "eval/acc": 1 - best}, config=CONFIGS[name])
    reg.flush()
    age_run(reg, "gamma", IDLE_FOR)
    return Site(runs=("alpha", "beta", "gamma"), checkpoints=len(reg.checkpoints("alpha", include_deleted=True)),
                dense_points=len(reg.metrics("alpha", "train/loss")))


def age_run(reg: Registry, run: str, by: timedelta) -> None:
    """Move every time ``run`` recorded (checkpoints, metric points, events, attempts) ``by`` into the past, as
    if it had been trained that long ago."""
    from sqlalchemy import select, update

    from registry.catalog.models import Attempt, CheckpointRow, Event, Metric, Run

    def fn(conn):  # type: ignore[no-untyped-def]
        run_id = conn.scalar(select(Run.c.id).where(Run.c.name == run))
        for table, columns in ((CheckpointRow, ("created_at", "updated_at", "published_at", "verified_at")),
                               (Metric, ("logged_at",)), (Event, ("created_at",)), (Attempt, ("started_at",)),
                               (Run, ("created_at",))):
            owned = table.c.id == run_id if table is Run else table.c.run_id == run_id
            for row in conn.execute(select(table.c.id, *(table.c[c] for c in columns)).where(owned)).all():
                moved = {c: getattr(row, c) - by for c in columns if getattr(row, c) is not None}
                conn.execute(update(table).where(table.c.id == row.id).values(moved))
    reg.catalog.write(fn)


def browser(scratch: Path):  # type: ignore[no-untyped-def]
    """Headless Debian chromium through its own chromedriver; nothing is ever downloaded.

    Its profile and temporary files go to ``scratch`` (chromium leaves empty directories in $TMPDIR).
    """
    import os

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should it ever run, must not fetch a browser
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1100", "--hide-scrollbars", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "TMPDIR": str(scratch)})
    return webdriver.Chrome(service=service, options=options)


def wait_for(driver, script: str, *, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    """Wait until ``script`` (a JS expression) is truthy in the page; returns its value."""
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(f"return {script};"))


def screenshot_run_page(driver, base_url: str, out: Path, *, run: str = "alpha",  # type: ignore[no-untyped-def]
                        policy: str = "keep-last 2, keep-best eval/loss 1", also: tuple[str, ...] = ()) -> Path:
    """The README's picture: the run page (``also``: more metrics drawn) with a retention preview filled in."""
    driver.get(f"{base_url}/runs/{run}")
    wait_for(driver, "document.body.dataset.ready === '1'")
    for key in also:
        driver.find_element("css selector", f'#keys input[value="{key}"]').click()
        wait_for(driver, f"document.querySelector('#chart polyline.curve[data-series=\"{key}\"]') !== null")
    driver.find_element("id", "policy").send_keys(policy)
    driver.find_element("css selector", "#retention button").click()
    wait_for(driver, "document.getElementById('plan').dataset.ready === '1'")
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    return out


def screenshot_compare_page(driver, base_url: str, out: Path, *,  # type: ignore[no-untyped-def]
                            runs: tuple[str, ...] = ("alpha", "beta", "gamma"), key: str = "eval/loss") -> Path:
    """The web view guide's picture (docs/guide/web-ui.md): several runs overlaid, with their comparison table
    and where their configs differ."""
    query = "&".join(f"run={r}" for r in runs)
    driver.get(f"{base_url}/compare?{query}&key={key}")
    wait_for(driver, "document.body.dataset.ready === '1'")
    return whole_page(driver, out)


def screenshot_runs_page(driver, base_url: str, out: Path, *,  # type: ignore[no-untyped-def]
                         query: str = "columns=eval/loss, eval/acc:max&sort=eval/loss") -> Path:
    """The runs table with two metric columns, sorted by the first, each run's state and health."""
    driver.get(f"{base_url}/?{query}")
    wait_for(driver, "document.getElementById('runs') !== null")
    return whole_page(driver, out)


def whole_page(driver, out: Path, *, height: int | None = None) -> Path:  # type: ignore[no-untyped-def]
    """Save the page down to its end (or ``height`` pixels) in one picture; the window is put back after."""
    size = driver.get_window_size()
    tall = height or int(driver.execute_script("return document.querySelector('main').getBoundingClientRect().bottom"
                                               " + window.outerHeight - window.innerHeight;"))
    driver.set_window_size(size["width"], max(tall, 200))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.set_window_size(size["width"], size["height"])
    return out
