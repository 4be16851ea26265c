"""Tenants as served: `dynamo serve graphs.agg_router` with a tenants file, the official
openai client. Keys, isolated prefix caches (cached_tokens: each repeat must also be
routed by the salted hashes to the worker holding that tenant's blocks), forged
identities, quotas."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dynagraph.llm.protocol import OpenAIRequestEnvelope
from dynagraph.llm.tenants import TenantToken
from dynagraph.runtime.rpc import RpcClient
from tests.support.infra import own_infra
from tests.support.serve import ServeProcess, graph_env, served

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-llama"
KEY_A, KEY_B, KEY_Q = "sk-acme-5e2a9b17c4d8", "sk-globex-8d1f3a0c6e92", "sk-quota-3b7c9e1d0a54"
LONG = "The quarterly report covers revenue, costs and the outlook for next year. " * 30


@pytest.fixture(scope="module")
def graph(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(f"{KEY_A}: {{tenant: acme, slo-class: interactive}}\n"
                       f"{KEY_B}: {{tenant: globex}}\n"
                       f"{KEY_Q}: {{tenant: quota-co, requests-per-minute: 2}}\n")
    with own_infra() as (etcd, nats), served(
            ["graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml", "--Frontend.port=0",
             f"--Common.model={model_dir}", "--Common.max-model-len=1024",
             f"--Frontend.tenants-file={tenants}"],
            graph_env(etcd.url, nats.url, in_process_engines=True), ready_timeout=300) as sp:
        yield sp


def client(graph: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{graph.url()}/v1", api_key=key, max_retries=0, timeout=120)


def cached(graph: ServeProcess, key: str, prompt: str) -> int:
    r = client(graph, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                              temperature=0)
    details: Any = r.usage.prompt_tokens_details if r.usage else None
    return int(details.cached_tokens) if details is not None else 0


def test_no_or_a_wrong_key_is_401(graph: ServeProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(graph, "sk-not-a-key-000000").completions.create(model=MODEL, prompt="hi",
                                                                 max_tokens=1)
    # The openai client refuses to send no key at all; plain HTTP does.
    r = httpx.post(f"{graph.url()}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error", r.text


def test_prefix_caches_are_isolated_per_tenant(graph: ServeProcess) -> None:
    assert cached(graph, KEY_A, LONG) == 0
    assert cached(graph, KEY_A, LONG) > 0     # the same tenant reuses its prefix
    assert cached(graph, KEY_B, LONG) == 0    # another tenant does not see it
    assert cached(graph, KEY_B, LONG) > 0


async def test_a_forged_identity_sent_to_the_processor_is_refused(graph: ServeProcess) -> None:
    m = re.search(r"Processor\[0\] pid=\d+ rpc=(\S+)", graph.output())
    assert m is not None, graph.output()[-2000:]
    forged = TenantToken(tenant="acme", slo_class="interactive", issued_for="r-forged",
                         sig="0" * 64)
    envelope = OpenAIRequestEnvelope(
        request_id="r-forged", endpoint="completion", tenant=forged,
        body={"model": MODEL, "prompt": LONG, "max_tokens": 2})
    rpc = RpcClient()
    try:
        with pytest.raises(Exception) as info:
            async for _ in rpc.call(m.group(1), "generate", envelope.to_wire()):
                pass
    finally:
        await rpc.close()
    assert "signature does not verify" in str(info.value)


def test_quota_is_429_with_retry_after(graph: ServeProcess) -> None:
    c = client(graph, KEY_Q)
    for _ in range(2):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert int(info.value.response.headers["retry-after"]) >= 1
