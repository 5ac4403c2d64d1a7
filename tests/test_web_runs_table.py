"""The runs table, run states, the compare page's config diff and the step page's facts, through Starlette's
TestClient on both backends.

Every figure is checked against what the rest of the project says about the same catalog: ``Registry.resolve``
of ``RUN@best:KEY``, the command line's ``runs --sort-by``, ``Registry.diff``'s config changes. The browser
checks of the same pages are in test_web_browser.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from registry import Registry  # noqa: E402
from registry.catalog.models import Attempt  # noqa: E402
from registry.cli import main  # noqa: E402
from registry.errors import InvalidQueryError  # noqa: E402
from registry.format.search import Field, parse_columns, parse_sort, parse_where  # noqa: E402
from registry.ops.diff import json_diff  # noqa: E402
from registry.retention import KeepLast  # noqa: E402
from registry.views import TRAINING_WINDOW, default_column, run_state, value_at  # noqa: E402
from registry.web import create_app, data  # noqa: E402
from tests.helpers import make_state  # noqa: E402
from tests import test_web  # noqa: E402
from tests.ui_site import CONFIG, CONFIGS, IDLE_FOR, Site, age_run  # noqa: E402


site, ro = test_web.site, test_web.ro  # the same site and read-only registry as the API tests, built per module


@pytest.fixture(scope="module")
def client(ro: Registry) -> TestClient:
    return TestClient(create_app(ro), base_url="http://127.0.0.1")


def get(client: TestClient, url: str, status: int = 200, **params: str) -> Any:
    response = client.get(url, params=params) if params else client.get(url)
    assert response.status_code == status, response.text
    return response.json()


def cli_json(site: tuple[str, Path, Site], *args: str) -> Any:
    url, root, _ = site
    result = CliRunner().invoke(main, ["--url", url, "--root", str(root), *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def row_of(html: str, run: str) -> str:
    return html.split(f'<tr data-run="{run}"', 1)[1].split("</tr>", 1)[0]


# ---------------------------------------------------------------------- the runs table


def test_the_runs_table_shows_the_best_of_a_default_metric_unasked(client: TestClient, ro: Registry) -> None:
    table = get(client, "/api/table")
    assert table["default_column"] == "eval/loss:min" and table["columns"] == ["eval/loss:min"]
    html = client.get("/").text
    assert "best eval/loss</th>" in html and 'id="default-column"' in html
    for run in ("alpha", "beta", "gamma"):
        best = ro.resolve(f"{run}@best:eval/loss")
        cell = {r["name"]: r for r in table["runs"]}[run]["values"]["eval/loss:min"]
        assert (cell["value"], cell["step"]) == (best.metrics["eval/loss"], best.step)
        shown = row_of(html, run).split('data-spec="eval/loss:min"', 1)[1]
        assert f'{best.metrics["eval/loss"]:.6g}' in shown and f'>@{best.step}</a>' in shown


def test_metric_columns_sort_as_the_cli_ranks_runs(client: TestClient, site: tuple[str, Path, Site],
                                                   ro: Registry) -> None:
    table = get(client, "/api/table?columns=eval/acc:max,eval/loss&sort=eval/acc:max")
    assert table["columns"] == ["eval/acc:max", "eval/loss:min"]
    ranked = [r["name"] for r in cli_json(site, "runs", "--sort-by", "eval/acc:max")]
    assert [r["name"] for r in table["runs"]] == ranked == ["alpha", "beta", "gamma"]
    for r in table["runs"]:
        best = ro.resolve(f"{r['name']}@best:eval/acc:max")
        assert r["values"]["eval/acc:max"] == {"value": best.metrics["eval/acc"], "step": best.step}
    reverse = get(client, "/api/table?columns=eval/acc:max&sort=-eval/acc:max")
    assert [r["name"] for r in reverse["runs"]] == ranked[::-1] and reverse["sort"] == "-eval/acc:max"
    by_loss = get(client, "/api/table?sort=eval/loss")
    assert [r["name"] for r in by_loss["runs"]] == [r["name"] for r in cli_json(site, "runs", "--sort-by",
                                                                                "eval/loss")]
    html = client.get("/?columns=eval/acc:max&sort=eval/acc:max").text
    assert 'data-spec="eval/acc:max" data-best="max" data-dir="desc"' in html
    assert html.index('data-run="alpha"') < html.index('data-run="beta"') < html.index('data-run="gamma"')


def test_where_keeps_the_runs_whose_best_value_matches(client: TestClient, ro: Registry) -> None:
    best = {r: ro.resolve(f"{r}@best:eval/loss").metrics["eval/loss"] for r in ("alpha", "beta", "gamma")}
    for where, keep in (("eval/loss < 0.5", lambda v: v < 0.5), ("eval/loss >= 0.3", lambda v: v >= 0.3),
                        ("eval/loss > 0.2 and eval/loss<0.65", lambda v: 0.2 < v < 0.65)):
        expected = sorted(r for r, v in best.items() if keep(v))
        assert sorted(r["name"] for r in get(client, "/api/table", where=where)["runs"]) == expected, where
        assert 0 < len(expected) < 3
    # a condition on another metric than the columns shown, and one no run meets
    assert [r["name"] for r in get(client, "/api/table", where="eval/acc:max > 0.65")["runs"]] == ["alpha", "beta"]
    assert get(client, "/api/table", where="eval/nothing < 1")["runs"] == []
    html = client.get("/?where=eval/loss%20%3C%200.5").text
    assert 'id="filtered"' in html and 'data-run="gamma"' not in html and 'data-run="beta"' in html


def test_the_table_is_the_search_of_registry_runs(client: TestClient, site: tuple[str, Path, Site],
                                                  ro: Registry) -> None:
    """The same where, sort and columns give the same runs, order, values and steps on the page, in
    ``Registry.search_runs`` and in ``registry runs --json``."""
    columns, where, sort = "eval/loss,eval/acc:max,eval/loss:last", "eval/acc:max > 0.1", "-eval/loss:last"
    table = get(client, "/api/table", columns=columns, where=where, sort=sort)
    found = ro.search_runs(where, sort=sort, columns=columns)
    specs = ["eval/loss:min", "eval/acc:max", "eval/loss:last"]
    assert table["columns"] == specs and table["where"] == ["eval/acc:max > 0.1"] and table["sort"] == sort
    assert [(r["name"], r["values"]) for r in table["runs"]] == \
        [(f.name, {s: {"value": f.values[s], "step": f.steps[s]} for s in specs}) for f in found]
    assert [(d["name"], d["values"], d["steps"]) for d in cli_json(site, "runs", "--where", where, "--sort", sort,
                                                                   "--columns", columns)] == \
        [(f.name, f.values, f.steps) for f in found]
    assert len(found) >= 2
    for f in found:
        last = max((i for i in ro.checkpoints(f.name) if "eval/loss" in i.metrics), key=lambda i: i.step)
        assert (f.values["eval/loss:last"], f.steps["eval/loss:last"]) == (last.metrics["eval/loss"], last.step)
    html = client.get("/", params={"columns": columns, "where": where, "sort": sort}).text
    assert "last eval/loss</th>" in html and 'id="table-error"' not in html


def test_a_malformed_column_condition_or_sort_is_said_above_the_table(client: TestClient) -> None:
    for query, words in ((("where", "eval/loss < oops"), "compares with a number"),
                         (("where", "eval/loss"), "FIELD OP VALUE"), (("columns", "eval/loss:median"), "eval/loss:max"),
                         (("sort", "eval loss"), "invalid field")):
        assert words in get(client, "/api/table", 400, **dict([query]))["error"], query
        page = client.get("/", params=dict([query]))
        assert page.status_code == 200 and words in unescape(page.text.split('id="table-error">', 1)[1])
        assert all(f'data-run="{r}"' in page.text for r in ("alpha", "beta", "gamma"))  # the table, unasked


def test_the_default_column_prefers_an_evaluation_loss() -> None:
    assert default_column([["train/loss", "eval/loss", "eval/acc"], ["eval/loss"]]) == Field("eval/loss", "min")
    assert default_column([["train/loss"], ["train/loss", "val/loss"]]) == Field("val/loss", "min")
    assert default_column([["train/loss", "lr"], ["train/loss"]]) == Field("train/loss", "min")
    assert default_column([["eval/acc", "lr"], ["eval/acc"]]) == Field("eval/acc", "max")
    assert default_column([["lr"]]) == Field("lr", "min") and default_column([[], []]) is None


def test_the_table_reads_the_grammar_of_registry_runs() -> None:
    """One grammar: a metric without a summary is ``KEY:min``, as ``RUN@best:KEY`` ranks."""
    assert [c.spec for c in parse_columns(["eval/loss, eval/acc:max", "params.lr", "eval/loss:min"])] == \
        ["eval/loss:min", "eval/acc:max", "params.lr"]
    assert [str(k) for k in parse_sort("eval/acc:max")] == ["eval/acc:max"] and parse_sort("eval/acc:max")[0].descending
    (loss,) = parse_sort("-eval/loss")
    assert (loss.field, loss.descending, str(loss)) == (Field("eval/loss", "min"), True, "-eval/loss:min")
    (lr,) = parse_sort("-params.lr")
    assert (lr.field, lr.descending) == (Field("lr"), True) and parse_sort("") == ()
    lr_, opt, flag = parse_where(["params.lr <= 1e-3 and params.optimizer = 'adamw', params.ema=true"])
    assert (lr_.op, lr_.value, opt.value, flag.value) == ("<=", 1e-3, "adamw", True)
    (metric,) = parse_where(["eval/loss == 0.5"])
    assert (metric.field, metric.op, str(metric)) == (Field("eval/loss", "min"), "=", "eval/loss:min = 0.5")
    for bad in ("eval/loss < 'low'", "eval/loss ~ 1", "params. = 1", "eval/loss <"):
        with pytest.raises(InvalidQueryError):
            parse_where([bad])


def test_value_at_reads_the_paths_json_diff_writes() -> None:
    a = {"lr": 0.1, "lr.warmup": 10, "opt": {"betas": [0.9, 0.99], "name": "adam"},
         "layers": [{"width": 8}, {"width": 16}], "gone": None}
    b = {"lr": 0.2, "lr.warmup": 20, "opt": {"betas": [0.9, 0.95], "name": "adamw"},
         "layers": [{"width": 8}, {"width": 32}], "new": [1, 2]}
    changes = json_diff(a, b)
    assert {c.key for c in changes} == {"lr", "lr.warmup", "opt.betas[1]", "opt.name", "layers[1].width", "gone", "new"}
    for c in changes:
        if c.change != "added":
            assert value_at(a, c.key) == (True, c.a), c.key
        if c.change != "removed":
            assert value_at(b, c.key) == (True, c.b), c.key
    assert value_at(a, "new") == (False, None) and value_at(a, "layers[7]") == (False, None)
    assert value_at(a, "opt.betas") == (True, [0.9, 0.99])


# ---------------------------------------------------------------------- training, idle, finished


def test_a_run_is_training_only_within_the_window_of_its_last_write(ro: Registry) -> None:
    active = {r["name"]: datetime.fromisoformat(r["active_at"]) for r in data.health_doc(ro)}
    alpha = active["alpha"]
    assert alpha >= max(i.created_at for i in ro.checkpoints("alpha", include_deleted=True) if i.created_at)
    for now, state in ((alpha + TRAINING_WINDOW - timedelta(seconds=1), "training"),
                       (alpha + TRAINING_WINDOW, "idle")):
        assert {r["name"]: r["state"] for r in data.health_doc(ro, now=now)}["alpha"] == state
        assert data.stamp_doc(ro, "alpha", now=now)["state"] == state
        assert {r["name"]: r["state"] for r in data.table_doc(ro, now=now)["runs"]}["alpha"] == state
    just_after = max(active.values()) + timedelta(seconds=1)
    states = {r["name"]: r["state"] for r in data.health_doc(ro, now=just_after)}
    assert states == {"alpha": "training", "beta": "training", "gamma": "idle"}  # gamma: written a day before
    assert run_state(None, None) == "idle"


def test_tags_verifies_and_deletions_are_not_training(reg: Registry) -> None:
    reg.publish("done", 1, make_state(1), metrics={"eval/loss": 1.0}, verify=False)
    reg.publish("done", 2, make_state(2), metrics={"eval/loss": 0.5}, verify=False)
    reg.flush()
    age_run(reg, "done", IDLE_FOR)
    reg.tag("done", 2, "release")
    reg.verify("done")
    reg.apply_retention("done", KeepLast(1))
    assert [i.step for i in reg.checkpoints("done")] == [2]
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        client = TestClient(create_app(ro), base_url="http://127.0.0.1")
        stamp = get(client, "/api/runs/done/stamp")
        assert stamp["state"] == "idle" and stamp["last_updated"] > stamp["active_at"]  # moved, not trained
        assert 'data-state="idle"' in row_of(client.get("/").text, "done")
        reg.log_metrics("done", 3, {"train/loss": 0.4})
        reg.flush()
        assert get(client, "/api/runs/done/stamp")["state"] == "training"  # a metric point is a trainer at work
        assert "10 minutes" in unescape(client.get("/runs/done").text.split('id="live-state" title="', 1)[1])


@pytest.mark.skipif("ended_at" not in Attempt.c, reason="attempts record no ended_at in this catalog schema")
def test_a_run_whose_last_attempt_ended_is_finished(reg: Registry) -> None:  # pragma: no cover - see skip
    from sqlalchemy import update
    reg.publish("ended", 1, make_state(1), metrics={"eval/loss": 1.0})
    reg.flush()
    reg.catalog.write(lambda conn: conn.execute(update(Attempt).values(ended_at=datetime.now().astimezone())))
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        assert data.stamp_doc(ro, "ended")["state"] == "finished"


# ---------------------------------------------------------------------- compare: the config diff


def test_the_compare_page_diffs_the_runs_configs_key_by_key(client: TestClient, ro: Registry) -> None:
    doc = get(client, "/api/compare/config?run=alpha&run=beta&run=gamma")
    configs = [CONFIG, CONFIGS["beta"], CONFIGS["gamma"]]
    assert doc["steps"] == [ro.resolve(f"{r}@latest").step for r in ("alpha", "beta", "gamma")]
    keys = [r["key"] for r in doc["config"]]
    assert keys == ["hidden", "optimizer.lr", "optimizer.momentum", "optimizer.name"]  # "model" is the same
    for row in doc["config"]:
        for cell, config, differs in zip(row["values"], configs, row["differs"]):
            found, value = value_at(config, row["key"])
            assert cell == ({"value": value} if found else {"absent": True})
            assert differs == (cell != row["values"][0])
    two = get(client, "/api/compare/config?run=alpha&run=beta")
    library = ro.diff("alpha@latest", "beta@latest").config
    assert [(r["key"], r["values"][0].get("value"), r["values"][1].get("value")) for r in two["config"]] == \
        [(c.key, c.a, c.b) for c in library]
    html = client.get("/compare?run=alpha&run=beta&run=gamma").text
    table = html.split('<table id="compare-config"', 1)[1].split("</table>", 1)[0]
    assert [k.split('"', 1)[0] for k in table.split('data-key="')[1:]] == keys
    assert '<td class="differs"><code>&quot;sgd&quot;</code></td>' in table
    momentum = table.split('data-key="optimizer.momentum"', 1)[1].split("</tr>", 1)[0]
    assert momentum.count('class="same absent"') == 2 and '<td class="differs"><code>0.9</code>' in momentum
    assert "alpha@1600" in table and "gamma@200" in table
    same = client.get("/compare?run=beta&run=beta").text
    assert "compare-config" not in same
    assert "nope" in get(client, "/api/compare/config?run=alpha&run=nope", 404)["error"]
    assert client.get("/compare?run=alpha&run=nope").status_code == 404


def test_a_run_without_a_config_is_said_so(reg: Registry) -> None:
    reg.publish("bare", 1, make_state(1))
    reg.publish("configured", 1, make_state(1), config={"lr": 0.1})
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        doc = data.compare_config(ro, ["configured", "bare"])
    assert doc["notes"] == {"bare": "bare@1 has no config.json"}
    assert doc["config"] == [{"key": "lr", "values": [{"value": 0.1}, {"absent": True}], "differs": [False, True]}]


# ---------------------------------------------------------------------- a step's facts


def facts_of(html: str) -> dict[str, str]:
    dl = html.split("<dl>", 1)[1].split("</dl>", 1)[0]
    return {unescape(p.split("</dt>", 1)[0]): unescape(p.split("<dd>", 1)[1].split("</dd>", 1)[0])
            for p in dl.split("<dt>")[1:]}


def test_a_step_shows_no_field_that_was_never_given(client: TestClient, ro: Registry) -> None:
    first = facts_of(client.get("/runs/alpha/steps/400").text)
    assert ro.resolve("alpha@400").epoch == 0 and ro.resolve("alpha@400").policy_version is None
    assert not {"epoch", "policy version"} & set(first) and "None" not in first.values()
    assert first["consumed samples"] == "12800"
    later = facts_of(client.get("/runs/alpha/steps/800").text)
    assert (later["epoch"], later["consumed samples"], later["tags"]) == ("1", "25600", "release")
    manifest = client.get("/runs/alpha/steps/400").text.split("<h2>Manifest</h2>", 1)[1].split("</dl>", 1)[0]
    assert "policy_version" not in manifest and "None" not in manifest and "layout" not in manifest


def test_a_policy_version_given_is_shown(reg: Registry) -> None:
    reg.publish("rl", 5, make_state(1), policy_version=3)
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        html = TestClient(create_app(ro), base_url="http://127.0.0.1").get("/runs/rl/steps/5").text
    facts = facts_of(html)
    assert facts["policy version"] == "3" and "epoch" not in facts and "consumed samples" not in facts
    assert "<dt>policy_version</dt><dd>3</dd>" in html.split("<h2>Manifest</h2>", 1)[1]


# ---------------------------------------------------------------------- parameters, where recorded


@pytest.mark.skipif(not hasattr(Registry, "set_params"), reason="this registry records no run parameters yet")
def test_parameter_columns_and_conditions(reg: Registry) -> None:  # pragma: no cover - see skip
    for run, lr, optimizer in (("a", 1e-4, "adamw"), ("b", 3e-3, "sgd"), ("c", 1e-3, "adamw")):
        reg.publish(run, 1, make_state(1), metrics={"eval/loss": lr * 100})
        reg.set_params(run, {"lr": lr, "optimizer": {"name": optimizer}})  # type: ignore[attr-defined]
    with Registry.open(url=reg.url, root=reg.store.root, read_only=True, create=False) as ro:
        client = TestClient(create_app(ro), base_url="http://127.0.0.1")
        table = get(client, "/api/table?columns=params.lr,params.optimizer.name&where=params.lr%3C%3D1e-3"
                            "&sort=-params.lr")
        assert [(r["name"], r["values"]["params.lr"]["value"], r["values"]["params.optimizer.name"]["value"])
                for r in table["runs"]] == [("c", 1e-3, "adamw"), ("a", 1e-4, "adamw")]
        compared = get(client, "/api/compare/config?run=a&run=b")
        assert {r["key"] for r in compared["params"]} == {"lr", "optimizer.name"}
