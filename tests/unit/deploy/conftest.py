"""Shared helpers: resolve a shipped graph the way ``dynamo deploy k8s`` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynagraph.deploy import DeploySpec, K8sOptions, build_manifests
from dynagraph.sdk._config import resolve_config
from dynagraph.sdk._graph import resolve_target

REPO = Path(__file__).resolve().parents[3]
GRAPHS = ["agg", "agg_router", "disagg", "disagg_router"]


def spec_for(graph: str, config: str | Path | None = None,
             overrides: list[str] | None = None) -> DeploySpec:
    """The DeploySpec of ``graphs.GRAPH:Frontend`` with ``configs/GRAPH.yaml`` (or ``config``)."""
    target = f"graphs.{graph}:Frontend"
    path = config if config is not None else REPO / "configs" / f"{graph}.yaml"
    g = resolve_target(target)
    return DeploySpec(target, g, resolve_config(g, path, overrides), str(path))


def manifests_for(graph: str, config: str | Path | None = None,
                  overrides: list[str] | None = None, **opts: Any) -> list[dict[str, Any]]:
    options = K8sOptions(name=opts.pop("name", graph.replace("_", "-")), **opts)
    return build_manifests(spec_for(graph, config, overrides), options)


def by_kind_name(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}
