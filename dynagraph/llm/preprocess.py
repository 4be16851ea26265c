"""OpenAI request -> tokenized :class:`PreprocessedRequest` (the Processor's front half).

Pure apart from the tokenizer: chat templating, tokenization, token-id validation,
context-length checks and resolution of defaults (``max_tokens``, temperature, ...).
"""

from __future__ import annotations

from typing import Any

from dynagraph.errors import InvalidRequest, PromptTooLong
from dynagraph.llm.detokenize import ResponseDetokenizer
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIRequest,
    PreprocessedRequest,
    SamplingParams,
)
from dynagraph.llm.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 4096  # used when the model's context length is unknown


class Preprocessor:
    """Turns OpenAI requests into engine requests for one model.

    ``max_model_len`` is the engine's context length (prompt + completion); when set,
    prompts that do not fit are rejected with :class:`PromptTooLong` and ``max_tokens``
    defaults to the room left in the context.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        max_model_len: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens

    def preprocess(self, request: OpenAIRequest, request_id: str) -> PreprocessedRequest:
        """Tokenize and validate ``request``. Raises InvalidRequest / PromptTooLong."""
        if isinstance(request, ChatCompletionRequest):
            token_ids = self.tokenizer.encode_chat(_template_messages(request.messages))
            prompt_param = "messages"
        else:
            token_ids = self._completion_prompt_ids(request)
            prompt_param = "prompt"
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param=prompt_param)
        max_tokens = self._resolve_max_tokens(request, len(token_ids), prompt_param)
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            min_tokens=min(request.min_tokens, max_tokens),
            ignore_eos=request.ignore_eos,
            stop_token_ids=list(request.stop_token_ids or ()),
        )
        return PreprocessedRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling=sampling,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            stop=request.stop_list(),
            skip_special_tokens=request.skip_special_tokens,
        )

    def detokenizer(self, request: PreprocessedRequest) -> ResponseDetokenizer:
        """The per-request post-processor for a request made by :meth:`preprocess`."""
        return ResponseDetokenizer(self.tokenizer, request)

    def _completion_prompt_ids(self, request: CompletionRequest) -> list[int]:
        prompt: Any = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest(
                    f"batched prompts are not supported (got {len(prompt)}); send one "
                    "prompt per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.tokenizer.vocab_size
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise InvalidRequest(
                    f"token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                )
        return ids

    def _resolve_max_tokens(
        self, request: OpenAIRequest, prompt_len: int, prompt_param: str
    ) -> int:
        requested = request.requested_max_tokens()
        limit = self.max_model_len
        if limit is None:
            return requested if requested is not None else self.default_max_tokens
        if prompt_len >= limit:
            raise PromptTooLong(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens; shorten the {prompt_param}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise PromptTooLong(
                f"this model's maximum context length is {limit} tokens, but {prompt_len + requested} "
                f"were requested ({prompt_len} in the {prompt_param}, {requested} in the "
                "completion); reduce the prompt or max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the dicts chat templates expect, with text parts joined."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        content = message.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            pieces: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"content part type {part.type!r} is not supported; only text is",
                        param=f"messages.{index}.content",
                    )
                pieces.append(part.text)
            text = "".join(pieces)
        entry: dict[str, Any] = {"role": message.role, "content": text}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
