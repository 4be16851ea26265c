"""Graph configuration: one YAML file keyed by component class name.

```yaml
Common:                       # shared values, pulled in by name
  model: models/tiny-llama
VllmWorker:
  common-configs: [model]     # copy these keys from Common
  max-model-len: 2048
  ServiceArgs:                # how to run it, not what it does
    workers: 2
    resources: {cpu: 1}
    env: {VLLM_CPU_KVCACHE_SPACE: "1"}
```

Command-line overrides ``--VllmWorker.max-model-len=4096`` (values parsed as YAML) win
over the file. Everything is checked before anything starts: unknown components,
unknown keys and wrong types raise ``ConfigError`` naming the file, component and key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynagraph.errors import ConfigError
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import spec_of

COMMON = "Common"
COMMON_KEYS = "common-configs"
SERVICE_ARGS = "ServiceArgs"


class ServiceArgs(BaseModel):
    """Process-level settings of one component."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    workers: int = Field(default=1, ge=1, le=64)
    resources: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    embed_in: str | None = Field(default=None, alias="embed-in")
    """Run this component inside each worker process of the named component that calls
    it (the Processor in the Frontend's: ``embed-in: Frontend``), reached there without
    the request plane's socket (``dynagraph.runtime.rpc._local``). It is still an instance
    of its own in discovery; its ``workers`` follow the host's."""


@dataclass
class ComponentConfig:
    """The resolved settings of one component."""

    name: str
    service_args: ServiceArgs
    values: dict[str, Any] = field(default_factory=dict)  # validated, JSON-able, by field name
    instances_per_process: int = 1
    """Instances each worker process runs (see :func:`instances_per_process`)."""

    @property
    def instances(self) -> int:
        """Instances of the component in all: workers x instances per process."""
        return self.service_args.workers * self.instances_per_process


def instances_per_process(cls: type, values: dict[str, Any]) -> int:
    """How many instances of ``cls`` one worker process runs: 1, unless the component
    names a key of its config for it (``@service(instances_key="engines-per-process")``)
    and ``values`` (its resolved config) sets that key.

    Each instance is registered on its own (own lease, instance id, request-plane
    server), as if it were a process of its own. Opt-in per component, because a
    component must be written to share a process (no process-wide state such as
    environment variables or a fixed port).
    """
    key = spec_of(cls).instances_key
    if key is None:
        return 1
    n = values.get(key, 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"must be a whole number >= 1, got {n!r}", component=spec_of(cls).name,
                          key=key)
    return n


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """``["--Comp.key=value", ...]`` -> ``{"Comp": {"key": value}}`` (values parsed as YAML)."""
    out: dict[str, dict[str, Any]] = {}
    for arg in args:
        body = arg[2:] if arg.startswith("--") else arg
        name, eq, raw = body.partition("=")
        comp, dot, key = name.partition(".")
        if not eq or not dot or not comp or not key:
            raise ConfigError(f"override {arg!r} must look like --Component.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {arg!r}: value is not valid YAML ({exc})") from exc
        out.setdefault(comp, {})[key] = value
    return out


def load_yaml(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config: {exc.strerror}", file=str(p)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"broken YAML: {exc}", file=str(p)) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("top level must be a mapping of component names", file=str(p))
    return data


def resolve_config(
    graph: Graph, path: str | Path | None, overrides: list[str] | None = None
) -> dict[str, ComponentConfig]:
    """Validate the file (and overrides) against the graph; one ComponentConfig per node."""
    file = str(path) if path is not None else "<no file>"
    data = load_yaml(path)
    extra = parse_overrides(overrides or [])
    names = graph.names()
    common = data.get(COMMON) or {}
    if not isinstance(common, dict):
        raise ConfigError("must be a mapping", file=file, component=COMMON)
    common = {**common, **extra.get(COMMON, {})}  # --Common.key=value reaches every user
    for comp in [*data, *extra]:
        if comp != COMMON and comp not in names:
            raise ConfigError(
                f"unknown component (this graph has {', '.join(names)})", file=file, component=comp
            )
    out: dict[str, ComponentConfig] = {}
    user_set: dict[str, set[str]] = {}  # component -> the ServiceArgs keys the file/overrides set
    for cls in graph.nodes:
        spec = spec_of(cls)
        section = data.get(spec.name) or {}
        if not isinstance(section, dict):
            raise ConfigError("must be a mapping", file=file, component=spec.name)
        section = dict(section)
        merged = _merge_common(section.pop(COMMON_KEYS, []), common, file, spec.name)
        sargs_raw = section.pop(SERVICE_ARGS, {}) or {}
        merged.update(section)
        for key, value in extra.get(spec.name, {}).items():
            if key.startswith(f"{SERVICE_ARGS}."):
                sargs_raw = {**sargs_raw, key.split(".", 1)[1]: value}
            else:
                merged[key] = value
        user_set[spec.name] = set(sargs_raw)
        sargs = _validate(ServiceArgs, {"workers": spec.workers, "resources": spec.resources, **sargs_raw},
                          file, spec.name, prefix=f"{SERVICE_ARGS}.")
        values = _component_values(spec.config_type, merged, file, spec.name)
        out[spec.name] = ComponentConfig(spec.name, sargs, values,
                                         instances_per_process(cls, values))
    _check_embedding(graph, out, file, user_set)
    return out


def embedded_in(configs: Mapping[str, ComponentConfig], host: str) -> list[str]:
    """The components that run inside each worker process of ``host``."""
    return [n for n, c in configs.items() if c.service_args.embed_in == host]


def _check_embedding(graph: Graph, configs: dict[str, ComponentConfig], file: str,
                     user_set: dict[str, set[str]]) -> None:
    """``ServiceArgs.embed-in``: the host must be another component of the graph that calls
    this one (directly, or through components embedded in it: the whole agg graph in the
    Frontend's process, as vLLM's own server runs), not itself embedded, one instance per
    process on both sides. The embedded component's ``workers`` become the host's (one
    per host process)."""
    key = f"{SERVICE_ARGS}.embed-in"
    for name, cfg in configs.items():
        host = cfg.service_args.embed_in
        if host is None:
            continue

        def refuse(why: str, name: str = name) -> ConfigError:
            return ConfigError(why, file=file, component=name, key=key)

        if host not in configs or host == name:
            raise refuse(f"{host!r} is not another component of this graph "
                         f"({', '.join(n for n in configs if n != name)})")
        if configs[host].service_args.embed_in is not None:
            raise refuse(f"{host} is itself embedded (in {configs[host].service_args.embed_in})")
        if not _calls_within(graph, configs, host, name):
            raise refuse(f"{host} does not call {name} (no depends() edge to it, nor "
                         f"through components embedded in {host})")
        cls = graph.by_name(name)
        if spec_of(cls).controller:
            raise refuse(f"{name} is a controller: it runs beside the graph, not inside it")
        if cfg.instances_per_process != 1 or configs[host].instances_per_process != 1:
            raise refuse("needs one instance per process on both sides")
        sargs = cfg.service_args
        for key_name, ignored in (("workers", "workers" in user_set.get(name, ())),
                                  ("env", bool(sargs.env)),
                                  ("resources", bool(sargs.resources.get("gpu")))):
            if ignored:  # it would be: the host's process has its own
                raise ConfigError(f"an embedded component runs in each {host} process, with "
                                  f"its {key_name}; set {host}'s {key_name} instead",
                                  file=file, component=name, key=f"{SERVICE_ARGS}.{key_name}")
        cfg.service_args = cfg.service_args.model_copy(
            update={"workers": configs[host].service_args.workers})


def callees_first(graph: Graph, names: list[str]) -> list[str]:
    """``names`` ordered so that a component comes after every one of them it calls."""
    done: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in done or name in path:
            return
        for callee in graph.edges(graph.by_name(name)).values():
            callee_name = None if callee is None else spec_of(callee).name
            if callee_name in names:
                visit(callee_name, (*path, name))
        done.append(name)

    for name in names:
        visit(name, ())
    return done


def _calls_within(graph: Graph, configs: Mapping[str, ComponentConfig], host: str,
                  name: str) -> bool:
    """Whether ``host`` calls ``name`` directly or through components embedded in it."""
    target, todo, seen = graph.by_name(name), [graph.by_name(host)], set()
    while todo:
        for callee in graph.edges(todo.pop()).values():
            if callee is None or callee in seen:
                continue
            if callee is target:
                return True
            seen.add(callee)
            callee_cfg = configs.get(spec_of(callee).name)
            if callee_cfg is not None and callee_cfg.service_args.embed_in == host:
                todo.append(callee)
    return False


def build_config(cls: type, values: dict[str, Any]) -> BaseModel | None:
    """The typed config object for ``cls`` from resolved values (None if it takes none)."""
    cfg_type = spec_of(cls).config_type
    return cfg_type.model_validate(values) if cfg_type is not None else None


def _merge_common(keys: Any, common: dict[str, Any], file: str, comp: str) -> dict[str, Any]:
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError("must be a list of key names", file=file, component=comp, key=COMMON_KEYS)
    merged: dict[str, Any] = {}
    for key in keys:
        if key not in common:
            raise ConfigError(f"listed in {COMMON_KEYS} but missing from {COMMON}", file=file,
                              component=comp, key=key)
        merged[key] = common[key]
    return merged


def _component_values(
    cfg_type: type[BaseModel] | None, raw: dict[str, Any], file: str, comp: str
) -> dict[str, Any]:
    if cfg_type is None:
        if raw:
            key = next(iter(raw))
            raise ConfigError("this component takes no settings", file=file, component=comp, key=key)
        return {}
    allowed = _accepted_keys(cfg_type)
    for key in raw:
        if key not in allowed:
            raise ConfigError(
                f"unknown key (known: {', '.join(sorted(allowed))})", file=file, component=comp, key=key
            )
    model = _validate(cfg_type, raw, file, comp)
    values: dict[str, Any] = model.model_dump(mode="json", by_alias=True)
    return values


def _accepted_keys(cfg_type: type[BaseModel]) -> set[str]:
    keys: set[str] = set()
    by_name = cfg_type.model_config.get("populate_by_name", False) or cfg_type.model_config.get(
        "validate_by_name", False
    )
    for name, f in cfg_type.model_fields.items():
        if f.alias:
            keys.add(f.alias)
        if by_name or not f.alias:
            keys.add(name)
    return keys


def _validate(model: type[BaseModel], raw: dict[str, Any], file: str, comp: str,
              prefix: str = "") -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = prefix + ".".join(str(p) for p in err["loc"]) if err["loc"] else None
        raise ConfigError(err["msg"], file=file, component=comp, key=key) from exc
