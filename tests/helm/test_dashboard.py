"""The Grafana dashboard (helm/baton/dashboards/baton.json) against the metrics the code
records: every series a panel queries exists, and every metric is on some panel."""

from __future__ import annotations

import json
import re

from prometheus_client.metrics import MetricWrapperBase

import cluster.planner_metrics
import router.metrics
import workers.serving.metrics
import workers.serving.tier_metrics

from .chart import CHART

DASHBOARD = json.loads((CHART / "dashboards" / "baton.json").read_text())


def recorded_series() -> dict[str, str]:
    """Every sample name Baton exposes -> its metric's name."""
    series = {}
    modules = (
        workers.serving.metrics,
        workers.serving.tier_metrics,
        router.metrics,
        cluster.planner_metrics,
    )
    for module in modules:
        for metric in vars(module).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            name, kind = metric._name, metric._type
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            for suffix in suffixes.get(kind, [""]):
                series[name + suffix] = name
    return series


def queried_series() -> set[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    exprs.append(DASHBOARD["templating"]["list"][1]["query"]["query"])
    return {name for e in exprs for name in re.findall(r"\bbaton_\w+", e)}


def test_every_queried_series_is_recorded():
    unknown = queried_series() - set(recorded_series())
    assert not unknown, f"the dashboard queries series no code records: {sorted(unknown)}"


def test_every_metric_is_on_the_dashboard():
    series = recorded_series()
    shown = {series[name] for name in queried_series()}
    missing = set(series.values()) - shown
    assert not missing, f"metrics with no panel: {sorted(missing)}"


def test_panels_do_not_overlap():
    cells = set()
    for panel in DASHBOARD["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        assert g["x"] + g["w"] <= 24
        cells |= mine
