"""A request shed by SLO-aware admission: 429 with Retry-After and the reason, across the
request plane as itself."""

from __future__ import annotations

from dynagraph.errors import RequestShed
from dynagraph.llm.http.errors import from_exception
from dynagraph.runtime.rpc._framing import error_body, error_from_body


def test_a_shed_request_is_429_with_retry_after_and_the_reason() -> None:
    err = from_exception(RequestShed("batch work shed under pressure: 30 requests",
                                     retry_after=3, code="slo_shed"))
    assert err.status == 429 and err.headers == {"retry-after": "3"}
    assert (err.info.type, err.info.code) == ("rate_limit_exceeded", "slo_shed")
    assert err.info.message == "batch work shed under pressure: 30 requests"


def test_it_crosses_the_request_plane_as_itself() -> None:
    body = error_body(RequestShed("shed", retry_after=5, code="slo_shed"))
    back = error_from_body(body)
    assert isinstance(back, RequestShed)
    assert (str(back), back.retry_after, back.code) == ("shed", 5, "slo_shed")
    assert from_exception(back).headers == {"retry-after": "5"}
