"""The tiny local model: loadable by transformers, chat-ready, built atomically and seeded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tools.model_builder import (
    BOS,
    IM_END,
    REQUIRED_FILES,
    BuildSpec,
    ensure_model,
    is_complete,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_model_dir_is_a_llama_with_long_context(model_dir: Path) -> None:
    assert is_complete(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"]) == (256, 512)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (4, 4)
    assert config["num_key_value_heads"] == 2
    assert config["max_position_embeddings"] >= 4096
    assert 1000 <= config["vocab_size"] <= 2048
    info = json.loads((model_dir / "dynagraph_build.json").read_text())
    assert info["steps_done"] > 0  # the shared model is trained


def test_tokenizer_loads_with_auto_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.bos_token == BOS and tok.bos_token_id == 0
    assert tok.eos_token == IM_END and tok.eos_token_id == 3
    ids = tok("Hello, world! Ünïcode too.").input_ids
    assert ids[0] == 0  # BOS is prepended
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, world! Ünïcode too."
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [3, 1]


def test_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [0, 2]  # BOS, <|im_start|> as single special tokens


def test_build_is_seeded_atomic_and_skipped_when_complete(tmp_path: Path) -> None:
    spec = BuildSpec(train_steps=2, train_seconds=60.0)
    a = ensure_model(tmp_path / "a", spec)
    b = ensure_model(tmp_path / "b", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha(a / name) == sha(b / name), name
    assert sorted(p.name for p in a.iterdir()) == sorted(REQUIRED_FILES)
    # Only the finished directories and their lock files remain: no temp dirs.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.lock", ".b.lock", "a", "b"]

    before = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(a, spec) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == before

    untrained = ensure_model(a, BuildSpec(train_seconds=0), force=True)
    assert sha(untrained / "model.safetensors") != sha(b / "model.safetensors")
    assert json.loads((a / "dynagraph_build.json").read_text())["steps_done"] == 0
