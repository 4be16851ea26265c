"""Model discovery: which models the live workers serve, from their discovery metadata.

Each model worker publishes, with its instance (``runtime.metadata``), the model it
serves, as Dynamo's workers publish their model card:

``model``               the served name clients put in ``"model"`` (the worker's
                        ``served-model-name``, else its model directory's name)
``model_path``          the model directory (tokenizer, chat template)
``max_model_len``       context length
``max_logprobs``        most logprobs per position a request may ask (absent: none)
``structured_outputs``  whether the engine constrains outputs (absent: no)

The Frontend lists a model in ``/v1/models`` only while at least one live worker
serves it, and answers 404 for any other; the Processor sends a request only to
workers of its model, and tokenizes with that model's tokenizer. A worker that
publishes no ``model`` (an engine from before discovery) counts as serving the
deployment's default model name. Pure logic: callers pass the live instance list.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class _Instance(Protocol):
    @property
    def instance_id(self) -> int: ...

    @property
    def metadata(self) -> dict[str, Any]: ...


class _EngineArgs(Protocol):
    @property
    def model(self) -> str: ...

    @property
    def served_model_name(self) -> str | None: ...

    @property
    def max_logprobs(self) -> int: ...

    @property
    def structured_outputs_backend(self) -> str: ...


def served_model_metadata(args: _EngineArgs, max_model_len: int) -> dict[str, Any]:
    """What a vLLM worker publishes about its model (see the module docstring)."""
    return {
        "model": args.served_model_name or os.path.basename(os.path.normpath(args.model)),
        "model_path": args.model,
        "max_model_len": max_model_len,
        "max_logprobs": args.max_logprobs,
        "structured_outputs": args.structured_outputs_backend != "none",
    }


@dataclass(frozen=True)
class ServedModel:
    """A model with at least one live worker; limits are the strictest of its workers."""

    name: str
    path: str | None
    max_model_len: int | None
    max_logprobs: int | None
    structured_outputs: bool
    instance_ids: tuple[int, ...]


def served_models(instances: Iterable[_Instance], default_name: str | None = None
                  ) -> dict[str, ServedModel]:
    """Group live worker instances by the model they serve (sorted by name)."""
    groups: dict[str, list[_Instance]] = {}
    for inst in instances:
        name = inst.metadata.get("model") or default_name
        if isinstance(name, str) and name:
            groups.setdefault(name, []).append(inst)
    out: dict[str, ServedModel] = {}
    for name in sorted(groups):
        metas = [i.metadata for i in groups[name]]
        out[name] = ServedModel(
            name=name,
            path=next((m["model_path"] for m in metas if isinstance(m.get("model_path"), str)),
                      None),
            max_model_len=_least(m.get("max_model_len") for m in metas),
            max_logprobs=_least_logprobs([m.get("max_logprobs") for m in metas]),
            structured_outputs=all(m.get("structured_outputs") is True for m in metas),
            instance_ids=tuple(i.instance_id for i in groups[name]),
        )
    return out


def _least(values: Iterable[Any]) -> int | None:
    ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return min(ints) if ints else None


def _least_logprobs(values: list[Any]) -> int | None:
    """-1 means unlimited; any worker without the key means no logprobs at all."""
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        return None
    limited = [v for v in values if v != -1]
    return min(limited) if limited else -1


class ModelDirectory:
    """:func:`served_models` of a live instance list, recomputed only when it changed.

    Called per request; instance records are immutable and replaced on change, so the
    identities of the listed records say whether the answer can be reused (the records
    are kept, so their identities cannot be reused meanwhile).
    """

    def __init__(self, default_name: str | None = None) -> None:
        self._default = default_name
        self._key: tuple[int, ...] | None = None
        self._held: list[_Instance] = []
        self._models: dict[str, ServedModel] = {}

    def models(self, instances: Sequence[_Instance]) -> dict[str, ServedModel]:
        key = tuple(map(id, instances))
        if key != self._key:
            self._models = served_models(instances, self._default)
            self._held = list(instances)
            self._key = key
        return self._models
