from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynagraph.errors import ConfigError, InvalidRequest
from dynagraph.llm.tokenizer import Tokenizer
from tests.support.tokenizer import build_tiny_tokenizer


def test_chat_template_with_generation_prompt(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Café 日本"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == "<s><|system|>be brief<|end|>\n<|user|>Café 日本<|end|>\n<|assistant|>"
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>")


def test_encode_chat_has_exactly_one_bos(tok: Tokenizer) -> None:
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    bos = tok.hf.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids[-1] == tok.hf.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s><|user|>hi")


def test_encode_decode_round_trip_multibyte(tok: Tokenizer) -> None:
    text = "Café crème 日本 🙂🚀 done"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.count_tokens(text) == len(ids)


def test_eos_and_vocab(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (tok.hf.convert_tokens_to_ids("</s>"),)
    assert tok.vocab_size >= 256


def test_generation_config_eos_ids_are_added(tmp_path: Path) -> None:
    model_dir = build_tiny_tokenizer(tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == (1, 2)


def test_no_chat_template_is_an_invalid_request(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path / "m", with_chat_template=False))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequest) as exc:
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert exc.value.param == "messages"


def test_template_error_is_an_invalid_request(tok: Tokenizer) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    tok.hf.chat_template, saved = template, tok.hf.chat_template
    try:
        with pytest.raises(InvalidRequest, match="roles must alternate"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
    finally:
        tok.hf.chat_template = saved


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no tokenizer"):
        Tokenizer.from_dir(tmp_path / "empty")
