"""Bounds at the edge, slow clients, the concurrency cap, Redis restarted under traffic and two gateways as one. The
gateway under test is the real app in this process, served by uvicorn in a thread with the gateway's edge protocol,
over the fake backend (harness.FakeBackend); two more gateways are `swiftkv serve` processes (no engines) whose pool is
that gateway as a remote OpenAI server, all sharing a redis-server of their own."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest
from harness import HTTP_TIMEOUT, free_port, metric, scrape, served_gateway, swiftkv_serve

KEY = "sk-test-main"
PUBLIC = "edge"
LIMITS = {"max_messages": 8, "max_stop_sequences": 2, "max_stop_chars": 16, "max_n": 3, "max_logit_bias": 4,
          "max_tools": 2, "max_body_bytes": 50_000, "max_header_bytes": 4096, "header_timeout_seconds": 2.0,
          "body_timeout_seconds": 2.0, "send_timeout_seconds": 3.0, "max_concurrent_requests": 3}
SHARED_KEY = "sk-edge-shared"  # 20 requests per minute, held in Redis by every gateway
BUSY_KEY = "sk-edge-busy"  # a limit far above the traffic: its buckets live in Redis, nothing is refused

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


class Redis:
    """A redis-server of the test's own on a free port (no persistence), stopped and started at will."""

    def __init__(self, work):
        self.port = free_port()
        self.work = work
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(self.work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                assert time.time() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    r = Redis(tmp_path_factory.mktemp("redis"))
    yield r
    r.stop()


@pytest.fixture(scope="module")
def edge(tiny_base, redis_server, tmp_path_factory):
    """The gateway with the edge's bounds over one pool whose fake engine answers max_tokens tokens (as with
    ignore_eos), one every millisecond; its limits in the module's Redis."""
    with served_gateway(tiny_base, tmp_path_factory.mktemp("edge"), pools=("base",), max_model_len=4096,
                        fake={"tokens": None, "delay": 0.001}, batch=False,
                        keys=(KEY, f"{SHARED_KEY} requests_per_minute=20", f"{BUSY_KEY} requests_per_minute=100000"),
                        model=PUBLIC, limits=LIMITS, redis_url=redis_server.url) as server:
        yield server


@pytest.fixture(scope="module")
def edge_server(edge) -> str:
    return edge.base


@pytest.fixture(scope="module")
def client(edge_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge_server}/v1", api_key=KEY, max_retries=0, timeout=120)


HI = [{"role": "user", "content": "hi"}]


def refused(call, status: int = 400) -> dict:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert e.value.status_code == status
    return e.value.body


def test_bounds_are_4xx_naming_the_field_and_the_limit(client, edge_server):
    chat = client.chat.completions.create
    b = refused(lambda: chat(model=PUBLIC, messages=HI * 9, max_tokens=2))
    assert b["param"] == "messages" and b["code"] == "array_above_max_length" and "9 messages; the limit is 8" in b["message"]
    b = refused(lambda: chat(model=PUBLIC, messages=HI, max_tokens=2, stop=["a", "b", "c"]))
    assert b["param"] == "stop" and "limit is 2" in b["message"] and "limits.max_stop_sequences" in b["message"]
    b = refused(lambda: client.completions.create(model=PUBLIC, prompt="x", max_tokens=2, stop="s" * 17))
    assert b["param"] == "stop" and b["code"] == "string_above_max_length" and "17 characters; the limit is 16" in b["message"]
    b = refused(lambda: chat(model=PUBLIC, messages=HI, max_tokens=2, n=4))
    assert b["param"] == "n" and b["code"] == "integer_above_max_value" and "limit is 3" in b["message"]
    b = refused(lambda: chat(model=PUBLIC, messages=HI, max_tokens=2, logit_bias={str(i): 1 for i in range(5)}))
    assert b["param"] == "logit_bias" and "5 entries; the limit is 4" in b["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    b = refused(lambda: chat(model=PUBLIC, messages=HI, max_tokens=2, tools=[tool] * 3))
    assert b["param"] == "tools" and "3 tools; the limit is 2" in b["message"]
    # at the bounds: served
    r = chat(model=PUBLIC, messages=HI * 8, max_tokens=2, n=3, stop=["a" * 16, "b"], logit_bias={str(i): 1 for i in range(4)})
    assert len(r.choices) == 3
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{edge_server}/tokenize", json={"messages": HI * 9}, headers=h, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # body: 413 from Content-Length, and from the bytes of a chunked body that declares none
    big = json.dumps({"model": PUBLIC, "prompt": "a" * 60_000}).encode()
    r = httpx.post(f"{edge_server}/v1/completions", content=big, headers=h, timeout=HTTP_TIMEOUT)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large" and "50000 bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{edge_server}/v1/completions", content=iter([big[:30_000], big[30_000:]]), headers=h, timeout=HTTP_TIMEOUT)
    assert r.status_code == 413 and "limits.max_body_bytes" in r.json()["error"]["message"]
    # headers: 431 in OpenAI's envelope, the connection closed
    r = httpx.post(f"{edge_server}/v1/completions", json={"model": PUBLIC, "prompt": "x"}, headers={**h, "x-big": "b" * 5000}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
    assert "4096 bytes" in r.json()["error"]["message"] and r.headers["connection"] == "close"
    m = scrape(edge_server)
    assert metric(m, "swiftkv_requests_rejected_total", reason="bounds") >= 6  # /tokenize refusals are not counted
    assert metric(m, "swiftkv_requests_rejected_total", reason="body_too_large") >= 2
    assert metric(m, "swiftkv_requests_rejected_total", reason="header_too_large") >= 1


def raw_response(sock: socket.socket, timeout: float) -> tuple[float, bytes]:
    """Read until the server closes; -> (seconds taken, bytes)."""
    t0 = time.time()
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return time.time() - t0, data


def test_slow_headers_and_slow_bodies_time_out(edge_server):
    port = int(edge_server.rsplit(":", 1)[1])
    # headers dribbled: a 408 once limits.header_timeout_seconds (2 s) have passed since the first byte
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.time()
    for _ in range(3):
        time.sleep(0.5)
        s.sendall(b"X-Slow: 1\r\n")
    _, data = raw_response(s, 10)
    took = time.time() - t0
    assert data.startswith(b"HTTP/1.1 408") and b"limits.header_timeout_seconds" in data, data
    assert 1.8 < took < 4
    # a connection that sends nothing is closed the same way
    s = socket.create_connection(("127.0.0.1", port))
    took, data = raw_response(s, 10)
    assert data.startswith(b"HTTP/1.1 408") and took < 4
    # body dribbled: a 408 in OpenAI's envelope after limits.body_timeout_seconds (2 s)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
              f"Content-Length: 100\r\n\r\n{{".encode())
    t0 = time.time()
    for _ in range(3):
        time.sleep(0.5)
        s.sendall(b" ")
    _, data = raw_response(s, 10)
    took = time.time() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(body)["error"]["code"] == "request_timeout" and 1.8 < took < 4
    m = scrape(edge_server)
    assert metric(m, "swiftkv_requests_rejected_total", reason="header_timeout") >= 2
    assert metric(m, "swiftkv_requests_rejected_total", reason="body_timeout") >= 1
    print(f"\nslow headers and body: 408 after {took:.1f} s")


def one_response(sock: socket.socket) -> bytes:
    """Read one response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_an_idle_keep_alive_connection_is_left_for_the_client_to_close(edge_server):
    # httpx and most HTTP clients expire idle pooled connections after 5 s, uvicorn's own default; a server
    # closing at the same moment resets a request sent on the connection. The gateway waits limits.keep_alive_seconds.
    port = int(edge_server.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(10)
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    s.sendall(request)
    assert one_response(s).startswith(b"HTTP/1.1 200")
    time.sleep(7)  # idle: past uvicorn's 5 s and past limits.header_timeout_seconds (2 s here), which times headers only
    s.sendall(request)
    assert one_response(s).startswith(b"HTTP/1.1 200")
    s.close()


def test_slow_bodies_hold_no_shared_slot(client, edge_server):
    """Three requests whose bodies are still on their way, as many as the process's slots: they are counted against
    their key's share from arrival, but take a shared slot only once their body is in (services/gateway/slots.py), so
    the next request is served at once. Before, each held a slot from its headers on and the fourth was a 503. (The
    503 with Retry-After past limits.slot_wait_seconds, the per-key 429 and the fair wait: tests/test_gateway_slots.py.)"""
    port = int(edge_server.rsplit(":", 1)[1])
    holders = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{".encode())
        holders.append(s)
    time.sleep(0.3)
    assert metric(scrape(edge_server), "swiftkv_gateway_requests_active") == 0  # /metrics itself is not capped
    r = client.chat.completions.create(model=PUBLIC, messages=HI, max_tokens=2)
    assert r.choices[0].message is not None
    for s in holders:
        s.close()


def test_a_client_that_stops_reading_is_disconnected_and_its_engine_request_aborted(edge, edge_server):
    port = int(edge_server.rsplit(":", 1)[1])
    engine = edge.served.backends["base"]
    aborted_before = engine.aborted
    before = scrape(edge_server)
    body = json.dumps({"model": PUBLIC, "messages": HI, "max_tokens": 3500, "ignore_eos": True, "stream": True, "n": 3,
                       "logprobs": True, "top_logprobs": 5}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffers fill soon
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert s.recv(1024).startswith(b"HTTP/1.1 200")
    t0 = time.time()  # from here on the client reads nothing and keeps the connection open
    deadline = t0 + 150  # the kernel buffers (MBs on loopback) fill first, at the engine's pace
    while True:
        m = scrape(edge_server)
        dropped = metric(m, "swiftkv_slow_client_disconnects_total") - metric(before, "swiftkv_slow_client_disconnects_total")
        if dropped == 1 and engine.aborted == aborted_before + 1:  # the engine's request was cancelled
            break
        assert time.time() < deadline, "the engine kept generating for a client that stopped reading"
        time.sleep(0.2)
    took = time.time() - t0
    generated = metric(m, "swiftkv_generation_tokens_total", model=PUBLIC) - metric(before, "swiftkv_generation_tokens_total", model=PUBLIC)
    aborted = metric(m, "swiftkv_requests_total", status="client_disconnect") - metric(before, "swiftkv_requests_total", status="client_disconnect")
    assert generated < 3 * 3500 and aborted == 1
    # The server closed the connection: what it had sent drains, then an end of file or a reset (a socket
    # still open would time out here).
    s.settimeout(10)
    with contextlib.suppress(ConnectionResetError):
        while s.recv(1 << 20):
            pass
    s.close()
    print(f"\nclient stopped reading: disconnected and engine request aborted {took:.1f} s later "
          f"(send timeout 3 s), {generated:g} of {3 * 3500} tokens generated")


def front_gateway(tmp_path, name: str, tiny_base, backend: str, redis_url: str):
    """A `swiftkv serve` without engines whose one pool is `backend` (the module's gateway, as a remote OpenAI server)."""
    work = tmp_path / name
    work.mkdir()
    (work / "keys").write_text(f"{SHARED_KEY} requests_per_minute=20\n{KEY}\n")
    # the keys share the prefix cache: per-key caches send vLLM's cache_salt, which a SwiftKV gateway upstream refuses
    config = {"model": "front", "data_dir": str(work / "data"), "redis_url": redis_url, "health": {"period_seconds": 30.0},
              "routing": {"share_prefix_cache": True},
              "pools": {"base": {"backend": "remote", "url": f"{backend}/v1", "api_key": KEY,
                                 "served_model_name": f"{PUBLIC}-base", "model": str(tiny_base)}}}
    return swiftkv_serve(work, config, "--engine", "inprocess", "--api-keys-file", str(work / "keys")).start().wait(timeout=120)


def ask(base: str, key: str) -> int:
    body = {"model": "front", "messages": HI, "max_tokens": 2}
    try:
        return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code
    except httpx.TransportError:
        return -1  # connection refused / reset: a gateway that is gone


@pytest.mark.slow
def test_two_gateways_share_one_limit_and_one_survives_the_others_death(edge_server, redis_server, tiny_base, tmp_path):
    a = b = None
    try:
        a = front_gateway(tmp_path, "a", tiny_base, edge_server, redis_server.url)
        b = front_gateway(tmp_path, "b", tiny_base, edge_server, redis_server.url)
        a_base, b_base = a.base, b.base
        t0 = time.time()
        statuses = [ask(base, SHARED_KEY) for _ in range(10) for base in (a_base, b_base)]
        elapsed = time.time() - t0
        statuses += [ask(base, SHARED_KEY) for _ in range(5) for base in (a_base, b_base)]
        elapsed2 = time.time() - t0
        admitted = statuses.count(200)
        assert set(statuses) <= {200, 429}, statuses
        assert 20 <= admitted <= 20 + elapsed2 * 20 / 60 + 1, (admitted, statuses)  # one limit across both
        print(f"\ntwo gateways, one Redis, 20 requests/min: {admitted} of {len(statuses)} admitted in {elapsed2:.1f} s "
              f"(first 20 in {elapsed:.1f} s)")

        # kill -9 of gateway a while requests flow to both: b keeps serving every one sent to it
        results = {a_base: [], b_base: []}
        stop_at = [time.time() + 60]

        def traffic(base):
            while time.time() < stop_at[0]:
                results[base].append((time.time(), ask(base, KEY)))

        threads = [threading.Thread(target=traffic, args=(base,)) for base in (a_base, b_base)]  # within the engine server's cap of 3
        for t in threads:
            t.start()
        while not all(len(r) >= 3 for r in results.values()):  # both answering
            assert time.time() < stop_at[0], results
            time.sleep(0.05)
        killed_at = time.time()
        a.proc.kill()
        a.proc.wait()
        stop_at[0] = time.time() + 2  # b serving on while a is gone
        for t in threads:
            t.join(60)
        b_statuses = [s for _, s in results[b_base]]
        assert b_statuses and set(b_statuses) == {200}, b_statuses
        a_after = [s for t, s in results[a_base] if t > killed_at + 0.5]
        assert all(s == -1 for s in a_after)
        print(f"gateway a killed: b answered {len(b_statuses)} of {len(b_statuses)} with 200 "
              f"({sum(t > killed_at for t, _ in results[b_base])} after the kill); a answered "
              f"{sum(s == 200 for _, s in results[a_base])} before, then refused connections")
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()


def test_redis_stopped_and_restarted_under_traffic(edge_server, redis_server):
    """Last: it restarts the module's Redis. Limits fail open to each process's own buckets (a metric says so)
    and are shared again once Redis answers; no request fails for it."""
    results: list = []
    done = threading.Event()

    def traffic():
        while not done.is_set():
            t = time.time()
            try:
                status = httpx.post(f"{edge_server}/v1/chat/completions", json={"model": PUBLIC, "messages": HI, "max_tokens": 2},
                                    headers={"Authorization": f"Bearer {BUSY_KEY}"}, timeout=30).status_code
            except httpx.TransportError:
                status = -1
            results.append((t, time.time() - t, status))

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 20
        while len(results) < 5:  # the traffic flows
            assert time.time() < deadline, results
            time.sleep(0.05)
        assert metric(scrape(edge_server), "swiftkv_rate_limits_shared") == 1
        redis_server.stop()
        stopped_at = time.time()
        deadline = time.time() + 20
        while metric(scrape(edge_server), "swiftkv_rate_limits_shared") != 0:
            assert time.time() < deadline
            time.sleep(0.2)
        local_after = time.time() - stopped_at
        time.sleep(1)  # requests keep coming while Redis is down
        redis_server.start()
        started_at = time.time()
        deadline = time.time() + 30
        while metric(scrape(edge_server), "swiftkv_rate_limits_shared") != 1:
            assert time.time() < deadline, "limits not shared again after Redis came back"
            time.sleep(0.2)
        shared_after = time.time() - started_at
        time.sleep(1)  # and once it is back
    finally:
        done.set()
        for t in threads:
            t.join(60)
    statuses = [s for _, _, s in results]
    during = [lat for t, lat, _ in results if stopped_at <= t <= started_at]
    assert set(statuses) == {200}, statuses
    print(f"\nRedis stopped and restarted under traffic: {len(statuses)} requests, all 200; local limits "
          f"{local_after:.1f} s after the stop, shared again {shared_after:.1f} s after the restart; "
          f"max latency while Redis was down {max(during) * 1000:.0f} ms (n={len(during)})")
