"""Deployment targets generated from a graph and its config (``dynamo deploy``).

``dynagraph.deploy.k8s``: Kubernetes manifests (``dynamo deploy k8s``); pure functions,
the command line does the I/O (``dynagraph.cli.deploy``).
"""

from __future__ import annotations

from dynagraph.deploy._k8s_objects import K8sOptions
from dynagraph.deploy.k8s import DeploySpec, build_manifests, config_yaml, render_yaml

__all__ = ["DeploySpec", "K8sOptions", "build_manifests", "config_yaml", "render_yaml"]
