"""OpenAI request -> engine requests plus the plan for its answer (the Processor's front half).

Pure apart from the tokenizer: chat templating (with tools), tokenization, token-id
validation, context-length checks and the resolution of every sampling and output
option the way vLLM's OpenAI server resolves it:

* sampling (penalties, ``top_k``, ``min_p``, ``logit_bias``, ``seed``, ``bad_words``,
  ``n`` ...) goes to the engine in :class:`SamplingParams`;
* output constraints (``response_format``, ``structured_outputs``, ``guided_*``, forced
  tool calls) become one :class:`StructuredOutputsSpec`;
* what only the Processor needs (stop strings, echo, logprob formatting, tool parsing)
  is kept in the :class:`RequestPlan`.

A completion request with several prompts becomes one engine request per prompt; each
asks for ``n`` choices.
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from dynagraph.errors import InvalidRequest, PromptTooLong
from dynagraph.llm.api.requests import ToolParam
from dynagraph.llm.api.structured import requested_constraint
from dynagraph.llm.api.tools import ToolPlan, plan_tools, tool_constraint
from dynagraph.llm.detokenize import ResponseDetokenizer
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIRequest,
    PreprocessedRequest,
    SamplingParams,
    TokenizeRequest,
)
from dynagraph.llm.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 4096  # used when the model's context length is unknown
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass
class PromptPlan:
    """One engine request and what the Processor needs to answer it."""

    request: PreprocessedRequest
    echo_text: str | None = None
    """Text the answer starts with (``echo``), or None."""
    echo_only: bool = False
    """``max_tokens: 0`` with ``echo``: the answer is the prompt alone."""


@dataclass
class RequestPlan:
    """Everything the Processor's back half needs to turn engine outputs into chunks."""

    endpoint: str
    prompts: list[PromptPlan]
    n: int = 1
    stream: bool = False
    logprobs: int | None = None
    """Alternatives per generated token in the answer (None: no logprobs)."""
    echo_logprobs: bool = False
    """Completions ``echo`` with ``logprobs``: the prompt's logprobs lead each choice's."""
    prompt_logprobs: bool = False
    """Return vLLM's ``prompt_logprobs`` field."""
    include_stop_str: bool = False
    tools: ToolPlan | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        """One prompt, one choice, text only: the detokenizer alone can answer it."""
        return (len(self.prompts) == 1 and self.n == 1 and self.logprobs is None
                and not self.prompt_logprobs and self.tools is None
                and self.prompts[0].echo_text is None and not self.include_stop_str)


@dataclass(eq=False)
class Preprocessor:
    """Turns OpenAI requests into engine requests for one model.

    ``max_model_len`` is the engine's context length (prompt + completion); when set,
    prompts that do not fit are rejected with :class:`PromptTooLong` and ``max_tokens``
    defaults to the room left in the context. ``max_logprobs`` is the most logprobs
    per position the model's workers give (-1: the whole vocabulary; None: no
    logprobs at all); ``structured_outputs`` whether they constrain outputs.
    ``tool_parser`` names the tool-call parser (``hermes``) and ``chat_template``
    replaces the model's own template.
    """

    tokenizer: Tokenizer
    _: KW_ONLY
    max_model_len: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS
    structured_outputs: bool = True
    tool_parser: str | None = None
    chat_template: str | None = None

    # -- the simple interface (one prompt) ------------------------------------------------

    def preprocess(self, request: OpenAIRequest, request_id: str) -> PreprocessedRequest:
        """Tokenize and validate a one-prompt request. Raises InvalidRequest / PromptTooLong."""
        plan = self.plan(request, request_id)
        if len(plan.prompts) != 1:
            raise InvalidRequest("expected one prompt", param="prompt")
        return plan.prompts[0].request

    def detokenizer(self, request: PreprocessedRequest, *, include_stop_str: bool = False
                    ) -> ResponseDetokenizer:
        """The per-choice post-processor for a request made by :meth:`plan`."""
        return ResponseDetokenizer(self.tokenizer, request, include_stop_str=include_stop_str)

    # -- the full interface --------------------------------------------------------------

    def plan(self, request: OpenAIRequest, request_id: str) -> RequestPlan:
        """Engine requests and the answer plan for ``request``. Raises InvalidRequest."""
        logprobs = request.num_logprobs()
        self._check_logprobs(logprobs, "top_logprobs" if isinstance(
            request, ChatCompletionRequest) else "logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.n > 1 and request.temperature == 0:
            raise InvalidRequest("n must be 1 when using greedy sampling (temperature 0)",
                                 param="n")
        tools = None
        skip_special = request.skip_special_tokens
        if isinstance(request, ChatCompletionRequest):
            tools = plan_tools(request, self.tool_parser)
            if tools is not None:
                skip_special = False  # tool-call markers may be special tokens
            prompts = [self._chat_prompt(request)]
            prompt_param = "messages"
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo:
                prompt_logprobs = request.top_logprobs or 0
        else:
            prompts = [self._completion_prompt(request, p) for p in request.prompts()]
            prompt_param = "prompt"
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is None and request.echo and logprobs is not None:
                prompt_logprobs = logprobs
        constraint = requested_constraint(request)
        if tools is not None:
            constraint = tool_constraint(tools, constraint)
        if constraint is not None and not self.structured_outputs:
            raise InvalidRequest(
                "this model's workers do not support structured outputs",
                param="tools" if tools is not None else _constraint_param(request))
        logit_bias = self._logit_bias(request.logit_bias)
        allowed = self._token_ids(request.allowed_token_ids, "allowed_token_ids")
        if allowed == []:
            raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
        out: list[PromptPlan] = []
        for index, (token_ids, echo_text) in enumerate(prompts):
            token_ids = self._truncate(request, token_ids)
            if not token_ids:
                raise InvalidRequest("the prompt is empty", param=prompt_param)
            requested = request.requested_max_tokens()
            echo_only = requested == 0  # completions with echo: the engine makes one token
            max_tokens = self._resolve_max_tokens(
                1 if echo_only else requested, len(token_ids), prompt_param)
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=max(request.top_k or 0, 0),
                min_p=request.min_p or 0.0,
                seed=request.seed,
                min_tokens=min(request.min_tokens, max_tokens),
                ignore_eos=request.ignore_eos,
                stop_token_ids=list(request.stop_token_ids or ()),
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if request.repetition_penalty is None
                                    else request.repetition_penalty),
                logit_bias=logit_bias,
                bad_words=list(request.bad_words or ()),
                allowed_token_ids=allowed,
                n=request.n,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=constraint,
            )
            rid = request_id if len(prompts) == 1 else f"{request_id}-{index}"
            pre = PreprocessedRequest(
                request_id=rid,
                token_ids=token_ids,
                sampling=sampling,
                eos_token_ids=list(self.tokenizer.eos_token_ids),
                stop=request.stop_list(),
                skip_special_tokens=skip_special,
            )
            out.append(PromptPlan(pre, echo_text=echo_text if request.echo else None,
                                  echo_only=echo_only))
        return RequestPlan(
            endpoint="chat" if isinstance(request, ChatCompletionRequest) else "completion",
            prompts=out,
            n=request.n,
            stream=bool(request.stream),
            logprobs=logprobs,
            echo_logprobs=bool(request.echo) and logprobs is not None and isinstance(
                request, CompletionRequest),
            prompt_logprobs=prompt_logprobs is not None,
            include_stop_str=request.include_stop_str_in_output,
            tools=tools,
        )

    # -- tokenize / detokenize -----------------------------------------------------------

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """The token ids of a ``/tokenize`` body (a prompt, or messages through the template)."""
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(
                template_messages(request.messages),
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=_tool_dicts(request.tools),
                chat_template=self.chat_template,
                template_kwargs=request.chat_template_kwargs,
            )
            return self.tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
        assert request.prompt is not None
        add = True if request.add_special_tokens is None else request.add_special_tokens
        return self.tokenizer.encode(request.prompt, add_special_tokens=add)

    # -- pieces --------------------------------------------------------------------------

    def _chat_prompt(self, request: ChatCompletionRequest) -> tuple[list[int], str | None]:
        messages = template_messages(request.messages)
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=_tool_dicts(request.tools),
            chat_template=self.chat_template,
            template_kwargs=request.chat_template_kwargs,
        )
        ids = self.tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
        echo = None
        if request.echo:
            role = "assistant" if request.add_generation_prompt else messages[-1]["role"]
            last = messages[-1]
            echo = str(last.get("content") or "") if last["role"] == role else ""
        return ids, echo or None

    def _completion_prompt(self, request: CompletionRequest, prompt: str | list[int]
                           ) -> tuple[list[int], str | None]:
        add = True if request.add_special_tokens is None else request.add_special_tokens
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add), prompt
        ids = self._token_ids(list(prompt), "prompt") or []
        # the text is only echoed; decoding a long prompt costs more than the rest of its plan
        return ids, self.tokenizer.decode(ids, skip_special_tokens=False) if request.echo else None

    def checked_token_ids(self, ids: list[int], param: str) -> list[int]:
        """``ids``, or InvalidRequest naming ``param`` if one is outside the vocabulary."""
        return self._token_ids(ids, param) or []

    def _token_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        if ids is None:
            return None
        vocab = self.tokenizer.vocab_size
        if not ids or 0 <= min(ids) and max(ids) < vocab:
            return ids
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise InvalidRequest(
                    f"token id {token_id} is outside the vocabulary (0..{vocab - 1})",
                    param=param)
        return ids

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        out = {int(k): min(100.0, max(-100.0, float(v))) for k, v in bias.items()}
        self._token_ids(list(out), "logit_bias")
        return out

    def _check_logprobs(self, num: int | None, param: str) -> None:
        if num is None:
            return
        if num < -1:
            raise InvalidRequest(f"{param} must be a non-negative number or -1", param=param)
        limit = self.max_logprobs
        if limit is None:
            raise InvalidRequest("this model's workers do not return logprobs", param=param)
        vocab = self.tokenizer.vocab_size
        want = vocab if num == -1 else num
        if want > (vocab if limit == -1 else limit):
            raise InvalidRequest(f"{param} ({num}) is more than the {limit} this model's "
                                 "workers allow", param=param)

    def _truncate(self, request: OpenAIRequest, ids: list[int]) -> list[int]:
        keep = request.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len if self.max_model_len is not None else len(ids)
        return ids[-keep:] if keep else []

    def _resolve_max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str
                            ) -> int:
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


def _constraint_param(request: OpenAIRequest) -> str:
    if request.response_format is not None and request.response_format.type != "text":
        return "response_format"
    if request.structured_outputs is not None:
        return "structured_outputs"
    return next((f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(request, f) is not None), "response_format")


def _tool_dicts(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.model_dump(mode="json", exclude_none=True) for t in tools]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the dicts chat templates expect: text parts joined, tool calls with
    their arguments parsed into objects (as vLLM and Transformers pass them)."""
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
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                try:
                    args = json.loads(call.function.arguments) if call.function.arguments else {}
                except ValueError:
                    raise InvalidRequest(
                        f"tool call {call.function.name!r} has arguments that are not JSON",
                        param=f"messages.{index}.tool_calls") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            entry["tool_calls"] = calls
        out.append(entry)
    return out
