"""``dynamo settings``: commands checked against the components' own live-settings
declarations, exact refusals, and how values and changes read."""

from __future__ import annotations

import pytest

from components.kv_router import Router, RouterConfig
from components.prefill_worker import PrefillWorker
from components.worker import VllmWorker
from dynagraph.cli.live_catalog import Catalog
from dynagraph.cli.settings import describe_change, plan_command, render_values
from dynagraph.runtime.live_settings import SettingError
from graphs.disagg_router import graph as disagg_router
from tests.unit.sdk.example_components import Back as PlainComponent

CONFIGS = {"Router": {"mode": "kv", "cost-model": "time", "overlap-weight": 2.0,
                      "temperature": 0.0},
           "VllmWorker": {"max-local-prefill-length": 512, "max-prefill-queue-size": 4}}


def catalog(configs: dict[str, dict[str, object]] | None = CONFIGS) -> Catalog:
    return Catalog.from_classes(disagg_router.nodes, "graphs.disagg_router:Frontend", configs)


def test_the_catalog_is_what_the_components_declare() -> None:
    cat = catalog()
    assert {n: c.spec.names for n, c in cat.components.items()} == {
        "Router": ("mode", "cost-model", "overlap-weight", "temperature"),
        "VllmWorker": ("max-local-prefill-length", "max-prefill-queue-size"),
        "PrefillWorker": ("hold-before-reply-s",),
    }
    assert cat.components["Router"].spec is Router.LIVE_SETTINGS
    assert cat.components["VllmWorker"].spec is VllmWorker.LIVE_SETTINGS
    assert cat.components["PrefillWorker"].spec is PrefillWorker.LIVE_SETTINGS
    assert cat.get("Router").key("overlap_weight") == "/dynamo/settings/Router/overlap-weight"


def test_the_running_router_follows_exactly_the_declared_settings() -> None:
    router = Router(RouterConfig())
    assert router.settings.names == list(Router.LIVE_SETTINGS.names)
    assert router.settings.prefix == "/dynamo/settings/Router/"


@pytest.mark.parametrize(("args", "message"), [
    (("set", "Routr", "mode", "kv"),
     "no component 'Routr' with live settings in graphs.disagg_router:Frontend; components "
     "with live settings: Router, VllmWorker, PrefillWorker"),
    (("set", "Router", "mood", "kv"),
     "Router has no live setting 'mood'; its live settings: mode, cost-model, overlap-weight, "
     "temperature"),
    (("set", "Router", "mode", "fastest"),
     "Router mode: 'fastest' is not allowed: expected one of kv, kv-load, round-robin, random"),
    (("set", "Router", "cost-model", "tokens"),
     "Router cost-model: 'tokens' is not allowed: expected one of time, blocks"),
    (("set", "Router", "overlap-weight", "-0.5"),
     "Router overlap-weight: '-0.5' is not allowed: expected a number >= 0"),
    (("set", "Router", "temperature", "warm"),
     "Router temperature: 'warm' is not allowed: expected a number >= 0"),
    (("set", "VllmWorker", "max-prefill-queue-size", "2.5"),
     "VllmWorker max-prefill-queue-size: '2.5' is not allowed: expected an integer >= 0"),
    (("set", "VllmWorker", "max-local-prefill-length", "true"),
     "VllmWorker max-local-prefill-length: 'true' is not allowed: expected an integer >= 0"),
    (("unset", "Frontend", "port", None),
     "no component 'Frontend' with live settings in graphs.disagg_router:Frontend; "
     "components with live settings: Router, VllmWorker, PrefillWorker"),
])
def test_bad_commands_are_refused_naming_component_key_and_allowed_values(
        args: tuple[str, str, str, str | None], message: str) -> None:
    with pytest.raises(SettingError) as exc:
        plan_command(catalog(), *args)
    assert str(exc.value) == message


@pytest.mark.parametrize(("component", "key", "raw", "stored"), [
    ("Router", "mode", "round-robin", "round-robin"),
    ("Router", "cost-model", "blocks", "blocks"),
    ("Router", "overlap_weight", "2", 2.0),
    ("Router", "temperature", " 0.5 ", 0.5),
    ("VllmWorker", "max-prefill-queue-size", "0", 0),
    ("PrefillWorker", "hold-before-reply-s", "1.5", 1.5),
])
def test_good_values_are_stored_as_json_the_component_accepts(
        component: str, key: str, raw: str, stored: object) -> None:
    plan = plan_command(catalog(), "set", component, key, raw)
    comp, name = plan.targets[0]
    assert plan.value == stored and type(plan.value) is type(stored)
    assert comp.spec.parse(name, plan.value) == comp.spec.parse(name, raw)


def test_get_plans_cover_all_one_component_or_one_key() -> None:
    cat = catalog()
    assert len(plan_command(cat, "get", None, None, None).targets) == 7
    assert [n for _, n in plan_command(cat, "get", "Router", None, None).targets] == [
        "mode", "cost-model", "overlap-weight", "temperature"]
    assert [n for _, n in plan_command(cat, "get", "Router", "overlap_weight", None).targets] \
        == ["overlap-weight"]


def test_values_say_where_they_come_from() -> None:
    cat = catalog()
    stored = {"/dynamo/settings/Router/mode": "round-robin",
              "/dynamo/settings/Router/temperature": "hot"}
    assert render_values(cat.values(stored, ["Router", "VllmWorker"])) == [
        "Router mode                         = round-robin  etcd                               "
        "(one of kv, kv-load, round-robin, random)",
        "Router cost-model                   = time         config                             "
        "(one of time, blocks)",
        "Router overlap-weight               = 2            config                             "
        "(a number >= 0)",
        "Router temperature                  = 0            config; etcd holds 'hot', ignored  "
        "(a number >= 0)",
        "VllmWorker max-local-prefill-length = 512          config                             "
        "(an integer >= 0)",
        "VllmWorker max-prefill-queue-size   = 4            config                             "
        "(an integer >= 0)",
    ]


def test_without_the_served_config_the_default_is_shown_as_such() -> None:
    [v] = catalog(None).values({}, ["PrefillWorker"])
    assert (v.value, v.source) == (0.0, "unset")
    assert render_values([v]) == [
        "PrefillWorker hold-before-reply-s = 0  not set; the config file's value applies, "
        "default shown  (a number >= 0)"]


def test_a_change_reads_as_before_and_after() -> None:
    cat = catalog()
    comp = cat.get("Router")
    before = cat.value(comp, "mode", None)
    after = cat.value(comp, "mode", "round-robin")
    assert describe_change(before, after, comp.key("mode")) == (
        "Router mode: kv (config) -> round-robin (etcd /dynamo/settings/Router/mode)")
    assert describe_change(after, before, comp.key("mode")) == (
        "Router mode: round-robin (etcd) -> kv (config)")


def test_components_without_live_settings_are_not_in_the_catalog() -> None:
    cat = Catalog.from_classes([PlainComponent], "x:Y", {})
    assert cat.components == {}
