"""A dual_mode pool on a remote server checks at start that the server serves base mode: a SwiftKV server started
without the dual-mode override refuses base-mode requests (swiftkv_core/vllm/engine_config.py), and the pool stays out
of routing, saying why, until a check finds the server fixed."""

from __future__ import annotations

import json

import httpx
import pytest

from services.serving.backend import BackendDown
from services.serving.remote import RemoteBackend

REFUSAL = {"error": {"message": "swiftkv_mode=base: this SwiftKV engine was not started in dual mode", "type": "BadRequestError",
                     "param": "extra_args", "code": 400}}


def server(dual: dict):
    probes = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.0"})
        body = json.loads(request.content)
        probes.append(body)
        if body.get("vllm_xargs", {}).get("swiftkv_mode") == "base" and not dual["on"]:
            return httpx.Response(400, json=REFUSAL)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    return httpx.MockTransport(handle), probes


def backend(transport, dual_mode: bool) -> RemoteBackend:
    b = RemoteBackend("swiftkv", "http://engine:8000/v1", "m", dual_mode=dual_mode)
    b.client = httpx.AsyncClient(transport=transport)
    return b


async def test_a_dual_mode_pool_whose_server_refuses_base_mode_does_not_start():
    dual = {"on": False}
    transport, probes = server(dual)
    b = backend(transport, dual_mode=True)
    with pytest.raises(BackendDown, match="dual_mode is set but the server .* does not serve base mode"):
        await b.start()
    assert probes[0]["vllm_xargs"] == {"swiftkv_mode": "base"} and probes[0]["max_tokens"] == 1
    assert not await b.health()  # kept out of routing by the health watcher too
    dual["on"] = True  # the server restarted with the override
    assert await b.health()
    await b.start()


async def test_other_pools_send_no_probe():
    transport, probes = server({"on": False})
    await backend(transport, dual_mode=False).start()
    assert probes == []
    dual_transport, dual_probes = server({"on": True})
    await backend(dual_transport, dual_mode=True).start()
    assert len(dual_probes) == 1
