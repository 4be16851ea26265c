"""Which components of a graph have live settings, and what value each setting has now.

Pure: built from component classes (their ``LIVE_SETTINGS``, see
`dynagraph.runtime.live_settings.LiveSpec`) and, when known, their resolved configs;
``dynamo settings`` and ``dynamo status`` both read it, so they name, validate and show
settings exactly as the components apply them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `dynamo --help` need not load pydantic
    from dynagraph.runtime.live_settings import LiveSpec


@dataclass(frozen=True)
class LiveComponent:
    """One component's live settings: where they live in etcd and their config values."""

    name: str
    namespace: str
    spec: LiveSpec[Any]
    config: dict[str, Any] | None = None
    """The component's resolved config values, by YAML key (None: not known)."""

    @property
    def prefix(self) -> str:
        return f"/{self.namespace}/settings/{self.name}/"

    def key(self, name: str) -> str:
        return self.prefix + self.spec.check_name(name)

    def configured(self, name: str) -> tuple[Any, str]:
        """The value that applies while etcd holds none, and where it comes from:
        ``config``, ``default``, or ``unset`` (the config is not known: the model's
        default is returned, the served config file may say otherwise)."""
        key = self.spec.check_name(name)
        if self.config is None:
            return self.spec.default(key), "unset"
        for spelling in (key, key.replace("-", "_")):  # resolved configs use the YAML key
            if spelling in self.config:
                return self.spec.parse(key, self.config[spelling]), "config"
        return self.spec.default(key), "default"


@dataclass(frozen=True)
class SettingValue:
    """A live setting as it stands: the value in effect and where it comes from."""

    component: str
    namespace: str
    name: str
    value: Any
    source: str
    """``etcd``; ``config`` (the served config file); ``default`` (the model's, the file
    does not set it); ``unset`` (not in etcd, config not known: ``value`` is the model's
    default); ``etcd, ignored`` (the stored value is invalid, the components keep their
    config's value)."""
    stored: Any = None
    """The raw value in etcd, if any."""
    allowed: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "namespace": self.namespace, "name": self.name,
                "value": self.value, "source": self.source, "stored": self.stored,
                "allowed": self.allowed}


class Catalog:
    """The live settings of a graph's components, by component name."""

    def __init__(self, components: Iterable[LiveComponent], source: str) -> None:
        self.components = {c.name: c for c in components}
        self.source = source
        """Where the classes came from, for messages (``graphs.agg:Frontend``)."""

    @classmethod
    def from_classes(cls, classes: Iterable[type], source: str,
                     configs: Mapping[str, Mapping[str, Any]] | None = None) -> Catalog:
        from dynagraph.runtime.live_settings import live_spec_of
        from dynagraph.sdk._service import spec_of

        out = []
        for c in classes:
            spec = live_spec_of(c)
            if spec is None:
                continue
            sspec = spec_of(c)
            config = None if configs is None else dict(configs.get(sspec.name, {}))
            out.append(LiveComponent(sspec.name, sspec.namespace, spec, config))
        return cls(out, source)

    def get(self, component: str) -> LiveComponent:
        """The component named ``component``; SettingError listing the ones that exist."""
        from dynagraph.runtime.live_settings import SettingError

        found = self.components.get(component)
        if found is not None:
            return found
        known = ", ".join(self.components) or "none"
        raise SettingError(f"no component {component!r} with live settings in "
                           f"{self.source}; components with live settings: {known}")

    def value(self, comp: LiveComponent, name: str, stored: Any | None) -> SettingValue:
        """The setting ``name`` of ``comp`` given the value stored in etcd (None: unset)."""
        from dynagraph.runtime.live_settings import SettingError

        name = comp.spec.check_name(name)
        allowed = comp.spec.describe(name)
        configured, where = comp.configured(name)
        if stored is None:
            return SettingValue(comp.name, comp.namespace, name, plain(configured), where,
                                None, allowed)
        try:
            value = comp.spec.parse(name, stored)
        except SettingError:
            return SettingValue(comp.name, comp.namespace, name, plain(configured),
                                "etcd, ignored", stored, allowed)
        return SettingValue(comp.name, comp.namespace, name, plain(value), "etcd", stored,
                            allowed)

    def values(self, stored: Mapping[str, Any], components: Iterable[str] | None = None
               ) -> list[SettingValue]:
        """Every setting of ``components`` (default: all) given ``stored`` (etcd key ->
        value under the components' prefixes)."""
        names = list(self.components) if components is None else list(components)
        return [self.value(c, n, stored.get(c.key(n)))
                for c in (self.components[x] for x in names if x in self.components)
                for n in c.spec.names]


def plain(value: Any) -> Any:
    """A setting's value as it reads in a table or JSON (enums by their value)."""
    raw = getattr(value, "value", value)
    return raw if isinstance(raw, str | int | float | bool) or raw is None else str(raw)


def show(value: Any) -> str:
    """A value for a table: ``1`` not ``1.0``, strings bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
