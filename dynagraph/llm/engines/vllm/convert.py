"""Conversions between our engine protocol and vLLM's request and output objects.

:func:`to_sampling_params` builds vLLM's ``SamplingParams`` from a :class:`SamplingSpec`
(imports vLLM); :func:`to_engine_outputs` turns a ``RequestOutput`` (DELTA mode) into
:class:`EngineOutput` values and :func:`invalid_request` vLLM's client errors into ours
(both pure).
"""

from __future__ import annotations

from typing import Any

from dynagraph.errors import EngineError, InvalidRequest
from dynagraph.llm.engines.base import EngineOutput, FinishReason, SamplingSpec


def to_sampling_params(spec: SamplingSpec, kv_transfer_params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if spec.structured_outputs is not None:
        structured = StructuredOutputsParams(**spec.structured_outputs)
    return SamplingParams(
        n=spec.n,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k or 0,
        min_p=spec.min_p,
        seed=spec.seed,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=spec.logit_bias,
        bad_words=list(spec.bad_words) or None,
        allowed_token_ids=spec.allowed_token_ids,
        logprobs=spec.logprobs,
        prompt_logprobs=spec.prompt_logprobs,
        flat_logprobs=spec.logprobs is not None or spec.prompt_logprobs is not None,
        structured_outputs=structured,
        detokenize=False,  # the processor detokenizes; the engine only moves ids
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def invalid_request(exc: Exception) -> InvalidRequest:
    """vLLM's client errors as ours, keeping the parameter vLLM names."""
    param = getattr(exc, "parameter", None)
    return InvalidRequest(str(exc), param=param if isinstance(param, str) else None)


def to_engine_outputs(out: Any, num_prompt_tokens: int) -> list[EngineOutput]:
    """One ``EngineOutput`` per choice in a vLLM ``RequestOutput`` (DELTA mode).

    Runs per token: the plain case (one choice, no logprobs) passes no optional field.
    """
    prompt_logprobs = out.prompt_logprobs
    cached = out.num_cached_tokens or 0
    results = []
    for completion in out.outputs:
        reason = completion.finish_reason
        if reason == "error":
            raise EngineError(f"vLLM reported an error for request {out.request_id}")
        kv = out.kv_transfer_params if reason is not None and out.finished else None
        if not completion.index and completion.logprobs is None and not prompt_logprobs:
            results.append(EngineOutput(
                token_ids=list(completion.token_ids), finish_reason=_finish_reason(reason),
                num_prompt_tokens=num_prompt_tokens, num_cached_tokens=cached,
                kv_transfer_params=kv))
            continue
        results.append(EngineOutput(
            token_ids=list(completion.token_ids), finish_reason=_finish_reason(reason),
            num_prompt_tokens=num_prompt_tokens, num_cached_tokens=cached,
            kv_transfer_params=kv, index=completion.index,
            logprobs=None if completion.logprobs is None else _positions(completion.logprobs),
            prompt_logprobs=_prompt_positions(prompt_logprobs) if prompt_logprobs else None))
        prompt_logprobs = None  # once per request output
    return results


def _positions(flat: Any) -> list[tuple[list[int], list[float]]]:
    """vLLM's ``FlatLogprobs`` -> (ids, logprobs) per position."""
    ids, lps = flat.token_ids, flat.logprobs
    return [(ids[a:b], lps[a:b])
            for a, b in zip(flat.start_indices, flat.end_indices, strict=True)]


def _prompt_positions(flat: Any) -> list[tuple[list[int], list[float], list[int]] | None]:
    ids, lps, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return [(ids[a:b], lps[a:b], [r or 0 for r in ranks[a:b]]) if b > a else None
            for a, b in zip(flat.start_indices, flat.end_indices, strict=True)]


def _finish_reason(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    if reason in ("length", "abort"):
        return reason  # type: ignore[return-value]
    return "stop"  # "stop" and vLLM's "repetition" both end the text normally
