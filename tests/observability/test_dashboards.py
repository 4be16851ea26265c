"""Every panel of every dashboard: structure, catalogued metrics, PromQL that parses."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dynagraph.observability import dashboards as dash
from dynagraph.observability.catalog import INFRA_METRICS, series_index

from .conftest import DASHBOARDS, datasource_uids, promtool, requirements

ALL = dash.load_dashboards(DASHBOARDS)
EXPECTED = {"overview.json", "routing.json", "disaggregation.json", "infrastructure.json"}
GRAPHS = {"agg", "agg_router", "disagg", "disagg_router"}


def test_the_four_dashboards_exist_with_unique_uids() -> None:
    assert set(ALL) == EXPECTED
    assert len({d["uid"] for d in ALL.values()}) == len(ALL)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_structure(name: str) -> None:
    assert dash.structure_problems(ALL[name], datasource_uids()) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_metric_is_catalogued(name: str) -> None:
    known = set(series_index()) | set(INFRA_METRICS)
    for q in dash.panel_queries(ALL[name], name):
        names = dash.metric_names(q.expr)
        assert names, f"{name} {q.title!r} {q.ref_id}: no metric in {q.expr}"
        assert names <= known, f"{name} {q.title!r}: not in the catalogue: {names - known}"


def test_requirements_cover_every_panel() -> None:
    req = requirements()
    assert set(req) == EXPECTED
    for name, entry in req.items():
        titles = dash.panel_graphs(ALL[name], entry)
        assert set(entry.get("panels") or {}) <= set(titles), f"{name}: unknown panel title"
        assert set(titles.values()) <= GRAPHS, name


def test_checker_catches_broken_dashboards() -> None:
    good: dict[str, Any] = ALL["overview.json"]
    uids = datasource_uids()
    broken = copy.deepcopy(good)
    panels = [p for p in broken["panels"] if p["type"] != "row"]
    panels[1]["id"] = panels[0]["id"]
    panels[2]["gridPos"]["x"] = 20
    panels[3]["targets"][0]["expr"] += ' + on() vector($undefined_var)'
    panels[4]["datasource"] = {"type": "prometheus", "uid": "nope"}
    panels[5]["gridPos"] = dict(panels[6]["gridPos"])
    problems = "\n".join(dash.structure_problems(broken, uids))
    assert "panel id" in problems and "used by" in problems
    assert "outside the 24-column grid" in problems
    assert "$undefined_var" in problems
    assert "'nope'" in problems
    assert "overlap" in problems


def test_metric_names_and_concrete() -> None:
    expr = ('histogram_quantile(0.9, sum by (le) (rate(a_seconds_bucket{ns=~"$namespace"}'
            '[$__rate_interval]))) / on(x) group_left(y) b_total offset 5m > bool 1e-9')
    assert dash.metric_names(expr) == {"a_seconds_bucket", "b_total"}
    assert dash.concrete(expr).startswith(
        'histogram_quantile(0.9, sum by (le) (rate(a_seconds_bucket{ns=~".*"}[1m])))')
    assert dash.used_variables("${a} $b [[c]] ${d:csv}") == {"a", "b", "c", "d"}


def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    exprs = [dash.concrete(q.expr) for name, d in ALL.items() for q in dash.panel_queries(d, name)]
    rules = tmp_path / "dashboards.rules.yml"
    rules.write_text(dash.rules_yaml(exprs))
    res = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(exprs)} rules found" in res.stdout
    bad = tmp_path / "bad.rules.yml"
    bad.write_text(dash.rules_yaml(["sum(rate(x[1m]) by"]))
    assert subprocess.run([promtool(), "check", "rules", str(bad)], capture_output=True,
                          timeout=60, check=False).returncode != 0
