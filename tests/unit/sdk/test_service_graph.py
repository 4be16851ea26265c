from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynagraph.errors import GraphError
from dynagraph.sdk import Graph, depends, endpoint, resolve_target, service, spec_of
from tests.unit.sdk.example_components import Back, BackConfig, Extra, Front, Middle, Numbers


def test_service_spec_records_endpoints_dependencies_and_config() -> None:
    spec = spec_of(Back)
    assert spec.name == "Back" and spec.namespace == "test" and spec.workers == 2
    assert [(e.name, e.method_name, e.request_type) for e in spec.endpoints] == [
        ("generate", "generate", Numbers)
    ]
    assert spec.config_type is BackConfig and spec.on_start == ("start",)
    assert spec_of(Middle).dependencies == {"back": Back, "extra": Extra}
    assert [(e.name, e.request_type) for e in spec_of(Front).endpoints] == [("stream", None)]


def test_link_builds_an_immutable_graph_and_prunes_unlinked_edges() -> None:
    g = Front.link(Middle)
    g2 = g.link(Back)
    assert g.nodes == (Front, Middle) and g2.nodes == (Front, Middle, Back)
    assert g2.edges(Middle) == {"back": Back, "extra": None}
    g2.validate()


def test_unreachable_linked_component_is_an_error() -> None:
    with pytest.raises(GraphError, match="not reachable from Front"):
        Front.link(Back).validate()


def test_a_controller_need_not_be_reachable_and_reaches_its_dependencies() -> None:
    @service(dynamo={"namespace": "test"}, controller=True)
    class Watcher:
        back = depends(Back)

        @endpoint()
        async def status(self, request: dict[str, int]) -> AsyncIterator[int]:
            yield 0

    assert spec_of(Watcher).controller and not spec_of(Front).controller
    Front.link(Middle).link(Back).link(Watcher).validate()
    Front.link(Back).link(Watcher).validate()  # Back is reached through the controller


def test_linking_twice_is_an_error() -> None:
    with pytest.raises(GraphError, match="linked twice"):
        Front.link(Middle).link(Middle)


def test_closure_takes_every_dependency() -> None:
    assert set(Graph.closure(Front).nodes) == {Front, Middle, Back, Extra}


def test_resolve_target_prefers_the_module_graph_rooted_at_the_class() -> None:
    g = resolve_target("tests.unit.sdk.example_components:Front")
    assert g.nodes == (Front, Middle, Back)
    assert resolve_target("tests.unit.sdk.example_components:pipeline") == g
    assert resolve_target("tests.unit.sdk.example_components:Middle").nodes[0] is Middle


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("nocolon", "must look like"),
        ("no.such.module:X", "cannot import"),
        ("tests.unit.sdk.example_components:Nope", "no attribute"),
        ("tests.unit.sdk.example_components:Numbers", "neither a Graph"),
    ],
)
def test_resolve_target_errors(target: str, match: str) -> None:
    with pytest.raises(GraphError, match=match):
        resolve_target(target)


def test_endpoint_must_be_an_async_generator() -> None:
    with pytest.raises(GraphError, match="async generator"):

        @service()
        class Bad:
            @endpoint()
            async def generate(self, request: Numbers) -> int:  # type: ignore[misc]
                return 1

    with pytest.raises(GraphError, match="exactly one request"):

        @service()
        class Bad2:
            @endpoint()
            async def generate(self, a: int, b: int) -> AsyncIterator[int]:
                yield 1
