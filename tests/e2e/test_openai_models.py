"""What vLLM's server has no counterpart for: model discovery across workers, and
refusing (400, naming the field) what we cannot honour instead of ignoring it.

Model discovery: a second worker serving the same weights under another name joins the
running agg graph (its own ``dynamo serve tests.e2e.worker_graph:graph`` on the same etcd and
NATS, as another host would). ``/v1/models`` lists it only while it is registered, and
requests for it reach that worker and no other.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.serve import ServeProcess

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
OTHER = "tiny-llama-b"


def models(base_url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{base_url}/v1/models").json()["data"]]


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not in time: {what}"
        time.sleep(0.2)


def prefix_queries(metrics_addr: str) -> float:
    text = httpx.get(f"http://{metrics_addr}/metrics").text
    m = re.search(r"^dynamo_worker_prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def second_worker(model_dir: Path, etcd_url: str, nats_url: str, base_url: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    config = tmp_path_factory.mktemp("second") / "worker.yaml"
    config.write_text(yaml.safe_dump({"VllmWorker": {
        "model": str(model_dir), "served-model-name": OTHER, "max-model-len": 512,
        "block-size": 32, "kv-cache-space-gib": 1, "enforce-eager": True,
        "structured-outputs-backend": "xgrammar"}}))
    sp = ServeProcess(["tests.e2e.worker_graph:graph", "-f", str(config)], env)
    try:
        sp.wait_ready(180)
        yield sp
    finally:
        sp.stop()


def worker_metrics(etcd_url: str) -> dict[str, str]:
    """Served model -> metrics address, from the workers' instance records in etcd."""
    start, end = b"/dynamo/instances/VllmWorker/", b"/dynamo/instances/VllmWorker0"
    r = httpx.post(f"{etcd_url}/v3/kv/range", json={
        "key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()})
    records = [json.loads(base64.b64decode(kv["value"])) for kv in r.json().get("kvs", [])]
    return {rec["model"]: rec["metrics"] for rec in records}


def test_a_second_model_is_listed_routed_by_name_and_dropped(
    base_url: str, second_worker: ServeProcess, etcd_url: str
) -> None:
    wait_for(lambda: OTHER in models(base_url), what=second_worker.output()[-3000:])
    assert sorted(models(base_url)) == [MODEL, OTHER]
    cards = {m["id"]: m for m in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert cards[OTHER]["max_model_len"] == 512

    metrics = worker_metrics(etcd_url)
    ours, theirs = metrics[MODEL], metrics[OTHER]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    before = (prefix_queries(ours), prefix_queries(theirs))
    for _ in range(3):
        r = client.completions.create(model=OTHER, prompt="Routed by name", max_tokens=2)
        assert r.model == OTHER and r.choices[0].text is not None
    wait_for(lambda: prefix_queries(theirs) > before[1], timeout=10)
    assert prefix_queries(ours) == before[0]
    middle = prefix_queries(theirs)
    client.completions.create(model=MODEL, prompt="Routed by name", max_tokens=2)
    wait_for(lambda: prefix_queries(ours) > before[0], timeout=10)
    assert prefix_queries(theirs) == middle
    with pytest.raises(openai.BadRequestError):  # its own context length applies
        client.completions.create(model=OTHER, prompt="word " * 600, max_tokens=2)

    assert second_worker.stop() == 0
    wait_for(lambda: OTHER not in models(base_url), timeout=15)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=OTHER, prompt="gone", max_tokens=2)
    assert models(base_url) == [MODEL]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 30}, "logprobs"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/chat/completions", {"n": 2, "temperature": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         "messages.0.content"),
        ("/v1/chat/completions", {"structured_outputs": {
            "regex": "a+", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": "required", "response_format": {
                                      "type": "json_object"}}, "tool_choice"),
    ],
)
def test_what_we_cannot_honour_is_refused_by_name(
    base_url: str, path: str, extra: dict[str, object], param: str
) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 4, **extra}
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body["prompt"] = "hi"
    r = httpx.post(f"{base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_guided_fields_are_honoured(base_url: str) -> None:
    """vLLM 0.32 dropped ``guided_*`` (it ignores them with a warning); Dynamo and older
    vLLM honour them, and so do we."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt="Pick", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model=MODEL, prompt="Code", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{3}"})
    assert re.fullmatch("[A-Z]{3}", r.choices[0].text)
