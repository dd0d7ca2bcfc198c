"""Batch API helpers: JSONL input files, batch lines, and waiting on a batch (through the official client, or through
an httpx client of the in-process app)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from services.serving.fake import FakeBackend

from .gateway import InProcessGateway, platform_config

PROMPT_HEAVY = {"model": "m", "prompt": "hello " * 20, "max_tokens": 1}  # the ratio picks the swiftkv pool (the SwiftKV model)


def jsonl(items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def chat_line(custom_id: str, content: str = "Say something.", max_tokens: int = 8, model: str = "tiny", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True} | extra
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client, items, purpose: str = "batch") -> str:
    return client.files.create(file=("requests.jsonl", jsonl(items)), purpose=purpose).id


def submit(client, items, window: str = "24h", endpoint: str = "/v1/chat/completions", **kw):
    return client.batches.create(input_file_id=upload(client, items), endpoint=endpoint, completion_window=window, **kw)


def wait_for(client, batch_id: str, until, timeout: float = 300):
    deadline = time.time() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.time() < deadline, f"batch {batch_id} still {b.status} ({b.request_counts})"
        time.sleep(0.2)


def finished(client, batch_id: str, timeout: float = 300):
    return wait_for(client, batch_id, lambda b: b.status in ("completed", "failed", "expired", "cancelled"), timeout)


def read_jsonl(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def every_line_once(client, b, custom_ids: list[str]) -> tuple[dict, dict]:
    """Output and error files by custom_id; each input custom_id appears exactly once across both."""
    out, err = read_jsonl(client, b.output_file_id), read_jsonl(client, b.error_file_id)
    seen = [line["custom_id"] for line in out + err]
    assert sorted(seen) == sorted(custom_ids), "every custom_id exactly once"
    return {line["custom_id"]: line for line in out}, {line["custom_id"]: line for line in err}


async def until(condition, timeout=10.0):
    """Await `condition()` until it is true."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def start_batch(c: httpx.AsyncClient, lines: int = 3) -> dict:
    data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": PROMPT_HEAVY}) + "\n"
                   for i in range(lines))
    f = (await c.post("/v1/files", files={"file": ("in.jsonl", data.encode())}, data={"purpose": "batch"})).json()
    return (await c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"})).json()


def gated_gateway(tiny_base, data_dir, batch: dict | None = None, keys: tuple[str, ...] = (), **platform):
    """The gateway with the Batch API over the pools swiftkv and base of fake engines whose
    gates hold batch requests (priority > 0) before their first token, live ones answering at once; `batch` overrides
    batch settings, `keys` are the API keys (none: no key needed). -> (backends by pool, InProcessGateway)."""
    cfg = platform_config(tiny_base, max_model_len=64, data_dir=str(data_dir),
                          batch={"max_in_flight": 3, "min_in_flight": 1, "live_quiet_seconds": 60, "poll_seconds": 0.1} | (batch or {}),
                          **platform)
    backends = {name: FakeBackend(name, gate=asyncio.Event(), hold=lambda request: request.priority > 0) for name in cfg.pools}
    return backends, InProcessGateway(cfg, backends, keys=keys)
