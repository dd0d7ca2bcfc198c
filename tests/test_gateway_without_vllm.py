"""The gateway image has no vLLM: every route of the gateway app (as `swiftkv serve` assembles it, the Batch API
included) answers without a 500 in a process where `import vllm` fails, over the fake backend. The routes come from
the app itself, so a route added later is called too (with a bare request where this file has no better one).

This file is also the script that process runs (`python tests/test_gateway_without_vllm.py TOKENIZER DATA_DIR`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 8}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_every_gateway_route_answers_without_vllm(tiny_base, tmp_path):
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(tiny_base), str(tmp_path)],
                         cwd=HERE.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["vllm_blocked"] and not report["vllm_imported"]
    calls = report["calls"]
    failed = [c for c in calls if c["status"] >= 500]
    assert not failed, failed
    routes = {tuple(r) for r in report["routes"]}
    assert routes == {(c["method"], c["route"]) for c in calls}  # every route was called
    served = {(c["method"], c["route"], c["what"]): c["status"] for c in calls}
    for what in ("plain", "stream", "tools required", "tool named", "json schema", "structured outputs"):
        assert served[("POST", "/v1/chat/completions", what)] == 200, what
    for what in ("plain", "stream", "logprobs"):
        assert served[("POST", "/v1/completions", what)] == 200, what
    assert served[("GET", "/version", "plain")] == served[("GET", "/ready", "plain")] == 200
    assert report["batch_status"] == "completed"  # its lines went through the gateway's request path


# ---- the process without vLLM -----------------------------------------------------------------------------------
class WithoutVllm:
    """A meta path finder in front of every other: vLLM is not found, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def requests_for(route: str, method: str, ids: dict) -> list[tuple[str, dict]]:
    """(what, httpx request arguments) for one route: the ones this file knows, a bare request for any other."""
    gen = {
        ("POST", "/v1/chat/completions"): [
            ("plain", {"json": CHAT}),
            ("stream", {"json": CHAT | {"stream": True, "stream_options": {"include_usage": True}}}),
            ("tools required", {"json": CHAT | {"tools": TOOLS, "tool_choice": "required"}}),
            ("tool named", {"json": CHAT | {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}}),
            ("tools auto", {"json": CHAT | {"tools": TOOLS}}),  # no tool_call_parser: a 400
            ("json schema", {"json": CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": TOOLS[0]["function"]["parameters"]}}}}),
            ("structured outputs", {"json": CHAT | {"structured_outputs": {"regex": "[a-z]+"}}}),
            ("bad", {"json": CHAT | {"temperature": 9}}),
        ],
        ("POST", "/v1/completions"): [
            ("plain", {"json": {"model": "m", "prompt": "The capital of France is", "max_tokens": 4}}),
            ("stream", {"json": {"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "stream": True}}),
            ("logprobs", {"json": {"model": "m", "prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2, "echo": False}}),
        ],
        ("POST", "/tokenize"): [("plain", {"json": {"prompt": "hello"}}), ("chat", {"json": {"messages": CHAT["messages"]}})],
        ("POST", "/detokenize"): [("plain", {"json": {"tokens": [1, 2, 3]}})],
        ("POST", "/v1/files"): [("plain", {"files": {"file": ("lines.jsonl", ids["lines"])}, "data": {"purpose": "batch"}})],
        ("POST", "/v1/batches"): [("plain", {"json": {"input_file_id": ids.get("file_id", "file-x"), "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"}})],
    }
    if (method, route) in gen:
        return gen[(method, route)]
    path = route.replace("{file_id}", ids.get("file_id", "file-x")).replace("{batch_id}", ids.get("batch_id", "batch_x"))
    return [("plain", {"url": path} | ({"json": {}} if method in ("POST", "PUT", "PATCH") else {}))]


async def serve_every_route(tokenizer: str, data_dir: str) -> dict:
    import asyncio

    from harness import FakeBackend
    from harness.gateway import InProcessGateway, platform_config
    from starlette.routing import Route

    cfg = platform_config(Path(tokenizer), data_dir=data_dir, batch={"poll_seconds": 0.1})
    served = InProcessGateway(cfg, {name: FakeBackend(name, tokens=None) for name in cfg.pools})
    # The file first, then the batch that reads it, so the routes of both get real ids; deleting and cancelling last.
    order = {("POST", "/v1/files"): 0, ("POST", "/v1/batches"): 1}
    routes = sorted({(method, r.path) for r in served.app.routes if isinstance(r, Route) for method in r.methods if method != "HEAD"},
                    key=lambda mr: (order.get(mr, 3 if mr[0] == "DELETE" or mr[1].endswith("/cancel") else 2), mr[1], mr[0]))
    line = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    ids: dict = {"lines": (json.dumps(line) + "\n").encode()}
    calls = []
    await served.gateway.start()  # the pools' start and health watch too (what the app's lifespan runs)
    async with served.running() as client:
        for method, route in routes:
            for what, args in requests_for(route, method, ids):
                r = await client.request(method, args.pop("url", route), **args)
                calls.append({"method": method, "route": route, "what": what, "status": r.status_code, "body": r.text[:300]})
                if (method, route) == ("POST", "/v1/files") and r.status_code == 200:
                    ids["file_id"] = r.json()["id"]
                if (method, route) == ("POST", "/v1/batches") and r.status_code == 200:
                    ids["batch_id"] = r.json()["id"]
                    for _ in range(300):  # the runner replays the line through the gateway's request path
                        batch = (await client.get(f"/v1/batches/{ids['batch_id']}")).json()
                        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                            break
                        await asyncio.sleep(0.1)
                    ids["batch_status"] = batch["status"]
    await served.gateway.stop()
    served.close()
    try:
        import vllm  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    return {"routes": routes, "calls": calls, "batch_status": ids.get("batch_status"), "vllm_blocked": blocked,
            "vllm_imported": any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)}


if __name__ == "__main__":
    sys.meta_path.insert(0, WithoutVllm())
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    import asyncio

    report = asyncio.run(serve_every_route(sys.argv[1], sys.argv[2]))
    print(json.dumps(report))
