"""``dynamo deploy k8s TARGET -f CONFIG``: Kubernetes manifests for a graph.

    dynamo deploy k8s graphs.disagg_router:Frontend -f configs/disagg_router.yaml \\
        [--image IMG] [--namespace NS] [--name PREFIX] [--etcd URL] [--nats URL] \\
        [--storage-class SC] [--Comp.key=value ...] [-o DIR]

The graph and config are resolved exactly as ``dynamo serve`` resolves them (same
errors, exit code 2, nothing written); the manifests come from
`dynagraph.deploy.k8s.build_manifests`. Output: multi-document YAML on stdout, or
``DIR/<graph module>.yaml`` with ``-o DIR``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from dynagraph.errors import ConfigError, GraphError

PROG = "dynamo deploy k8s"


def add_parser(sub: Any) -> None:
    """Add ``deploy k8s`` to the ``dynamo`` command's subparsers."""
    deploy = sub.add_parser("deploy", help="generate deployment files for a graph",
                            description="Generate deployment files for a graph.")
    targets = deploy.add_subparsers(dest="platform", required=True)
    k = targets.add_parser(
        "k8s",
        help="Kubernetes manifests",
        description="Kubernetes manifests for MODULE:Component with CONFIG: etcd, NATS "
        "(JetStream), the config as a ConfigMap, one Deployment per component (replicas = "
        "ServiceArgs.workers), a Service for the Frontend. Extra arguments "
        "--Component.key=value override the config file, as for dynamo serve.",
    )
    k.add_argument("target", help="graph or entry component, e.g. graphs.agg:Frontend")
    k.add_argument("-f", "--config", help="YAML config file")
    k.add_argument("--image", help="container image (default dynagraph:VERSION-cpu, "
                   "-gpu when a component asks for GPUs; see deploy/k8s/Dockerfile)")
    k.add_argument("--namespace", default="dynagraph", help="Kubernetes namespace")
    k.add_argument("--name", help="prefix of every object's name "
                   "(default: the graph module's name, e.g. disagg-router)")
    k.add_argument("--etcd", metavar="URL", help="an existing etcd (default: deploy one)")
    k.add_argument("--nats", metavar="URL", help="an existing NATS with JetStream "
                   "(default: deploy one)")
    k.add_argument("--storage-class", help="for etcd's and NATS' volumes "
                   "(default: the cluster's default class)")
    k.add_argument("--service-type", default="ClusterIP",
                   choices=["ClusterIP", "NodePort", "LoadBalancer"],
                   help="type of the Frontend's Service")
    k.add_argument("--metrics-port", type=int, default=9090,
                   help="each pod's Prometheus port (DYNAMO_METRICS_PORT)")
    k.add_argument("--no-namespace", action="store_true",
                   help="do not emit the Namespace object (it exists already)")
    k.add_argument("-o", "--output-dir", metavar="DIR",
                   help="write DIR/<graph module>.yaml instead of printing")


def deploy_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from dynagraph.deploy import DeploySpec, K8sOptions, build_manifests, render_yaml
    from dynagraph.sdk._config import resolve_config
    from dynagraph.sdk._graph import resolve_target

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = args.target.partition(":")[0].rsplit(".", 1)[-1]
    try:
        graph = resolve_target(args.target)
        configs = resolve_config(graph, args.config, overrides)
        opts = K8sOptions(
            name=args.name or module.replace("_", "-").lower(),
            namespace=args.namespace,
            image=args.image,
            etcd_url=args.etcd,
            nats_url=args.nats,
            storage_class=args.storage_class,
            service_type=args.service_type,
            metrics_port=args.metrics_port,
            create_namespace=not args.no_namespace,
        )
        spec = DeploySpec(args.target, graph, configs,
                          args.config if args.config is not None else "<no file>")
        manifests = build_manifests(spec, opts)
    except (ConfigError, GraphError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    text = render_yaml(manifests, _header(args, overrides))
    if args.output_dir is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.output_dir) / f"{module}.yaml"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        print(f"{PROG}: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(manifests)} objects)", file=sys.stderr)
    return 0


def _header(args: argparse.Namespace, overrides: list[str]) -> str:
    """Says how the file was made (everything but ``-o``, which does not change it)."""
    cmd = ["dynamo", "deploy", "k8s", args.target]
    if args.config is not None:
        cmd += ["-f", args.config]
    for flag, value, default in (("--image", args.image, None),
                                 ("--namespace", args.namespace, "dynagraph"),
                                 ("--name", args.name, None), ("--etcd", args.etcd, None),
                                 ("--nats", args.nats, None),
                                 ("--storage-class", args.storage_class, None),
                                 ("--service-type", args.service_type, "ClusterIP"),
                                 ("--metrics-port", args.metrics_port, 9090)):
        if value != default:
            cmd += [flag, str(value)]
    if args.no_namespace:
        cmd.append("--no-namespace")
    cmd += overrides
    return (f"# Generated by: {shlex.join(cmd)}\n"
            "# Do not edit: change the graph or its config and generate again.\n"
            "# Apply: kubectl apply -f THIS_FILE   (deploy/README.md, \"Kubernetes\")\n")
