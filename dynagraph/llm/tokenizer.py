"""A Hugging Face tokenizer loaded from a local model directory, plus its chat template.

Only fast (Rust ``tokenizers``-backed) tokenizers are supported: the incremental
detokenizer (``dynagraph.llm.detokenize``) drives ``tokenizers.decoders.DecodeStream``
on :attr:`Tokenizer.backend`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynagraph.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Tokenizer:
    """Encode/decode and chat templating for one model. Thread-safe for reads.

    Build it with :meth:`from_dir` (loads from disk, never from the network) or pass an
    already loaded ``transformers`` tokenizer to the constructor.
    """

    def __init__(
        self, hf: PreTrainedTokenizerBase, *, extra_eos_token_ids: Sequence[int] = ()
    ) -> None:
        backend = getattr(hf, "_tokenizer", None)
        if backend is None:
            raise ConfigError(
                f"tokenizer {type(hf).__name__} is not a fast (tokenizers-backed) tokenizer; "
                "add a tokenizer.json to the model directory"
            )
        self.hf = hf
        self.backend: tokenizers.Tokenizer = backend
        eos: list[int] = []
        if hf.eos_token_id is not None:
            eos.append(int(hf.eos_token_id))
        eos.extend(int(t) for t in extra_eos_token_ids if int(t) not in eos)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, trust_remote_code: bool = False) -> Tokenizer:
        """Load the tokenizer in ``model_dir`` (files only, no hub access).

        EOS ids from ``generation_config.json`` (if present) are added to the tokenizer's
        own EOS id, as vLLM does.
        """
        path = Path(model_dir)
        if not path.is_dir():
            raise ConfigError(f"model directory {path} does not exist")
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise ConfigError(
                f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}"
            )
        try:
            hf = _load_hf_tokenizer(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc
        return cls(hf, extra_eos_token_ids=_generation_config_eos(path))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocab plus added tokens)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text, add_special_tokens=False))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) into the prompt text.

        ``tools`` (OpenAI tool dicts) and ``template_kwargs`` are passed to the template;
        ``chat_template`` replaces the model's own. The template is expected to emit BOS
        itself, so encode the result with ``add_special_tokens=False`` (:meth:`encode_chat`
        does).
        """
        if chat_template is None and not self.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions with a plain prompt",
                param="messages",
            )
        from jinja2 import TemplateError

        kwargs = dict(template_kwargs or {})
        for reserved in ("tokenize", "add_generation_prompt", "continue_final_message",
                         "tools", "chat_template", "conversation"):
            kwargs.pop(reserved, None)
        try:
            text = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except TemplateError as exc:  # e.g. raise_exception() for an unsupported role order
            raise InvalidRequest(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        except ValueError as exc:  # e.g. continue_final_message without a final message
            raise InvalidRequest(str(exc), param="messages") from exc
        assert isinstance(text, str)
        return text

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Chat template then encode, without adding special tokens a second time."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


# Tokenizer classes that are nothing but a tokenizer.json: loading them directly skips
# AutoTokenizer's model registry, which imports torch (seconds of start-up).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _load_hf_tokenizer(path: Path, *, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    config_path = path / "tokenizer_config.json"
    tokenizer_class = None
    if config_path.is_file() and (path / "tokenizer.json").is_file():
        tokenizer_class = json.loads(config_path.read_text()).get("tokenizer_class")
    if tokenizer_class in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(
            str(path), local_files_only=True)
        return fast
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=trust_remote_code
    )
    return tokenizer


def _generation_config_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []
