"""Building a served mocker engine's settings from a worker component's config.

The worker configs (``components/mocker_worker.py``, ``components/mocker_prefill_worker.py``)
extend ``MockerEngineArgs`` with keys of their own; :func:`engine_args` takes the engine's
part, gives the engine the instance's id, and, when the config names a ``model``
directory, draws output tokens from that model's tokenizer vocabulary minus its special
tokens (the Processor then detokenizes them like a real model's; no weights are read).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from dynagraph.errors import ConfigError

from .args import MockerEngineArgs


def engine_args(config: MockerEngineArgs, engine_id: str) -> MockerEngineArgs:
    """The engine's own settings out of a worker config: ``engine-id`` defaults to
    ``engine_id``; with a model directory (the config's ``model``), the vocabulary and
    the excluded tokens are the tokenizer's."""
    fields = set(MockerEngineArgs.model_fields)
    args = MockerEngineArgs.model_validate(config.model_dump(include=fields))
    update: dict[str, Any] = {}
    if args.engine_id is None:
        update["engine_id"] = engine_id
    model_dir = getattr(config, "model", None)
    if model_dir is not None:
        vocab, specials = tokenizer_vocab(str(model_dir))
        update["vocab_size"] = vocab
        update["eos_token_ids"] = sorted({*args.eos_token_ids, *specials})
    return args.model_copy(update=update) if update else args


@functools.cache
def tokenizer_vocab(model_dir: str) -> tuple[int, tuple[int, ...]]:
    """(vocabulary size, special token ids) of ``model_dir/tokenizer.json``."""
    path = Path(model_dir) / "tokenizer.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the tokenizer of {model_dir}: {exc}",
                          key="model") from exc
    vocab: dict[str, int] = data.get("model", {}).get("vocab", {})
    added = data.get("added_tokens", [])
    ids = [int(v) for v in vocab.values()] + [int(t["id"]) for t in added]
    if not ids:
        raise ConfigError(f"{path} has no vocabulary", key="model")
    specials = tuple(sorted(int(t["id"]) for t in added if t.get("special", False)))
    return max(ids) + 1, specials
