"""Schema fuzzing with schemathesis: every operation of the gateway's /openapi.json (the real app served over HTTP
from this process, as `swiftkv serve` serves it, over a stand-in engine that checks each request's sampling
parameters with vLLM's own checks, as an in-process engine does before it runs one) and of the trainer's (a real
`swiftkv trainer serve`) gets a bounded number of generated requests, valid ones (the schema's) and invalid ones (schemathesis' negative mode),
over real HTTP with a per-request timeout. Nothing may be a 5xx or hang, every 4xx is in OpenAI's error envelope,
and a request the schema forbids is refused (schemathesis' own negative_data_rejection check)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests
from harness.engines import KEY
from harness.gateway import served_gateway
from harness.training import MODEL, Trainer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import negative_data_rejection  # noqa: E402

pytestmark = pytest.mark.slow

PUBLIC = "fuzz"
EXAMPLES = 60  # generated requests per operation (half valid, half invalid), plus the coverage phase's cases (every field at its bounds and in every wrong type)
TIMEOUT = 30.0  # seconds per request: longer is a hang
# the coverage phase's cases of an operation are sent this many at a time (concurrent requests, as clients send them)
COVERAGE_CLIENTS = 4
ENVELOPE = {"message", "type", "param", "code"}


def checked_as_vllm_checks(request) -> None:
    """What an in-process engine refuses before it runs a request (vLLM's SamplingParams checks), refused the same way."""
    from services.serving.backend import BadRequest
    from services.serving.engine import to_sampling_params

    try:
        to_sampling_params(request.sampling)
    except ValueError as e:
        raise BadRequest(str(e)) from e


@pytest.fixture(scope="module")
def gateway(tiny_base, tmp_path_factory):
    pytest.importorskip("vllm")
    with served_gateway(tiny_base, tmp_path_factory.mktemp("gateway-fuzz"), pools=("base",), max_model_len=256, keys=(KEY,),
                        fake={"tokens": None, "check": checked_as_vllm_checks}, model=PUBLIC,
                        limits={"max_n": 2, "body_timeout_seconds": 5.0}) as server:
        yield server.base


@pytest.fixture(scope="module")
def trainer(tiny_base, tmp_path_factory):
    work = tmp_path_factory.mktemp("trainer-fuzz")
    t = Trainer(work, work / "data", work / "models", tiny_base, key=KEY).start()
    try:
        yield t.base
    finally:
        t.stop()


def problems(response: requests.Response) -> list[str]:
    """What is wrong with one answer, beyond schemathesis' own checks."""
    if response.status_code >= 500:
        return [f"{response.status_code}: {response.text[:300]}"]
    if response.status_code < 400:
        return []
    try:
        body = response.json()
    except ValueError:
        return [f"{response.status_code} not JSON: {response.text[:200]}"]
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict) and set(body["error"]) == ENVELOPE):
        return [f"{response.status_code} outside OpenAI's envelope: {response.text[:200]}"]
    return []


def json_type(value) -> str:
    for kind, name in ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"), (dict, "object"), (list, "array")):
        if isinstance(value, kind):
            return name
    return "null"


def fuzz(base: str, headers: dict, models: list[str]) -> tuple[dict, list, dict]:
    """Every operation of base's /openapi.json: -> ({operation: examples sent}, [(operation, mode, request, problem)],
    {(operation, body field): JSON types sent for it})."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=headers)
    counts: dict[str, dict[int | str, int]] = defaultdict(lambda: defaultdict(int))
    failures: list = []
    sent_types: dict[tuple[str, str], set[str]] = defaultdict(set)
    refused: dict = defaultdict(lambda: defaultdict(int))  # valid per the schema, refused by a check it cannot express
    lock = threading.Lock()  # the coverage phase sends from several threads

    def send(label: str, mode: GenerationMode, case, strict: bool) -> None:
        """One request; `strict`: a request the schema forbids must also be refused (the hypothesis phases; the
        coverage phase's edge cases are checked for 5xx, hangs and the envelope only)."""
        if isinstance(case.body, dict):
            with lock:
                for field, value in case.body.items():
                    sent_types[(label, field)].add(json_type(value))
        sent = case.as_curl_command(headers=headers, base_url=base)[:400]
        try:
            response = case.call(base_url=base, headers=headers, timeout=TIMEOUT)
        except requests.Timeout:
            with lock:
                failures.append((label, mode.value, sent, f"no answer within {TIMEOUT:g} s"))
                counts[label]["timeout"] += 1
            return
        with lock:
            record(label, mode, case, strict, response, sent)

    def record(label: str, mode: GenerationMode, case, strict: bool, response: requests.Response, sent: str) -> None:
        counts[label][response.status_code] += 1
        if mode is GenerationMode.POSITIVE and strict and response.status_code == 400:
            try:
                refused[label][response.json()["error"]["param"]] += 1
            except (ValueError, KeyError, TypeError):
                pass
        found = problems(response)
        if mode is GenerationMode.NEGATIVE and strict:
            try:
                case.validate_response(response, checks=[negative_data_rejection], headers=headers)
            except BaseExceptionGroup as e:  # schemathesis' failures, with their explanation
                found.append(f"{response.status_code} for a request the schema forbids: {str(e)[:300]}")
        failures.extend((label, mode.value, sent, p) for p in found)

    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception as e:  # nothing in this operation can be made invalid (no parameters, no body)
                if mode is GenerationMode.NEGATIVE:
                    continue
                raise AssertionError(f"{label}: {e}") from e

            @settings(max_examples=(EXAMPLES + 1) // 2, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=strategy, real_model=st.sampled_from(models + [None]))
            def run(case, real_model):
                if real_model and mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = real_model  # a served model, so valid requests reach the engine
                # requests drops a query parameter or header whose value is None: a negative case whose only fault
                # was such a part reaches the server valid, and its 200 says nothing of the server
                dropped = any(v is None for part in (case.query, case.headers) if isinstance(part, dict) for v in part.values())
                send(label, mode, case, strict=not (mode is GenerationMode.NEGATIVE and dropped))

            try:
                run()
            except Exception as e:  # a strategy that cannot generate (e.g. an unsatisfiable negative schema)
                if mode is GenerationMode.NEGATIVE and "Unsatisfiable" in type(e).__name__:
                    continue
                raise
        # schemathesis' coverage phase (as `schemathesis run` does): each field at its boundaries and in every wrong
        # JSON type, deterministically, which random generation may never reach (`"completion_window": {}` was a 500)
        generation = schema.config.generation_for(operation=op)
        with ThreadPoolExecutor(COVERAGE_CLIENTS) as pool:
            futures = [pool.submit(send, label, case.meta.generation.mode if case.meta else GenerationMode.NEGATIVE, case, False)
                       for case in schema.iter_coverage_cases(op, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                                              generation_config=generation)]
            for future in futures:
                future.result()  # a failure of the test itself (not of the server) is raised here
    for label, params in refused.items():
        print(f"  {label}: valid per the schema, refused naming {dict(sorted(params.items(), key=lambda kv: -kv[1])[:8])}")
    return {label: dict(c) for label, c in counts.items()}, failures, sent_types


def report(name: str, counts: dict, failures: list, took: float) -> None:
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n{name}: {len(counts)} operations, {total} requests in {took:.0f} s, {len(failures)} failures")
    for label, c in sorted(counts.items()):
        print(f"  {sum(c.values()):4d}  {label:45s} {dict(sorted(c.items(), key=str))}")
    for f in failures[:30]:
        print("  FAIL", *f)


def test_gateway_schema_fuzzing(gateway):
    t0 = time.time()
    doc = httpx.get(f"{gateway}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/files", "/v1/batches",
                 "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        assert path in doc["paths"], path
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    counts, failures, sent_types = fuzz(gateway, {"Authorization": f"Bearer {KEY}"}, [PUBLIC, f"{PUBLIC}-base"])
    report("gateway", counts, failures, time.time() - t0)
    # The run reaches the case a review found by hand (`"completion_window": {}` was a 500): a wrongly typed window.
    assert sent_types[("POST /v1/batches", "completion_window")] - {"string"}, sent_types[("POST /v1/batches", "completion_window")]
    assert len(counts) == sum(len(ops) for ops in doc["paths"].values())
    assert not failures
    r = httpx.post(f"{gateway}/v1/chat/completions", json={"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3, "ignore_eos": True}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # still serving


def test_trainer_schema_fuzzing(trainer):
    t0 = time.time()
    doc = httpx.get(f"{trainer}/openapi.json").json()
    assert "/v1/fine_tuning/jobs" in doc["paths"] and "/v1/files" in doc["paths"]
    counts, failures, _ = fuzz(trainer, {"Authorization": f"Bearer {KEY}"}, [MODEL])
    report("trainer", counts, failures, time.time() - t0)
    assert len(counts) == sum(len(ops) for ops in doc["paths"].values())
    assert not failures
