"""Write docs/run-page.png, docs/compare-page.png and docs/runs-page.png (or into the folder given): the test
site's run page, retention preview filled in, its three runs compared, and its runs table."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from registry import Registry  # noqa: E402
from registry.web import create_app  # noqa: E402
from registry.web.server import background_server  # noqa: E402
from tests.ui_site import (browser, build_site, screenshot_compare_page, screenshot_run_page,  # noqa: E402
                           screenshot_runs_page)


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs"
    outs = [folder / "run-page.png", folder / "compare-page.png", folder / "runs-page.png"]
    with tempfile.TemporaryDirectory() as tmp:
        url, root = f"sqlite:///{tmp}/catalog.db", Path(tmp) / "ckpt"
        with Registry.open(url=url, root=root) as reg:
            build_site(reg)
        with Registry.open(url=url, root=root, read_only=True, create=False) as ro, \
                background_server(create_app(ro)) as base:
            driver = browser(Path(tmp))
            try:
                screenshot_run_page(driver, base, outs[0], also=("train/loss",))
                screenshot_compare_page(driver, base, outs[1])
                screenshot_runs_page(driver, base, outs[2])
            finally:
                driver.quit()
    for out in outs:
        print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
