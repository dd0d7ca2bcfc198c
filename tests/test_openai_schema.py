"""Every response of the chat, completions, files, batches and fine-tuning routes against OpenAI's own schema (the
official `openai` package's types, generated from OpenAI's OpenAPI document), with no field OpenAI does not have
(harness/openai_schema.py): the gateway in-process over fake engines and the distillation service in-process, both
served over real HTTP and driven with the official client. Also the plumbing of the engines' cached-token figure
(usage.prompt_tokens_details.cached_tokens) to answers, streams and a batch's usage, over the fake engine's prefix
cache; on real engines in test_cached_tokens.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
from harness import served_gateway
from harness.batch import chat_line, finished, read_jsonl, submit, upload
from harness.openai_schema import ALLOWED_EXTENSIONS, ALLOWED_NULLS, assert_openai_shape
from harness.processes import free_port
from harness.training import MODEL, QUICK, records
from openai.types import Batch, Completion, FileDeleted, FileObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

LONG = "Tell me everything about the history of the river and its bridges. " * 12  # several 16-token blocks


def raw(response) -> dict:
    """The JSON body the server sent, as the client received it."""
    return json.loads(response.http_response.content)


def sse(response) -> list[dict]:
    """The events of a raw streamed response, [DONE] left out."""
    events = [line[5:].strip() for line in response.http_response.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def gateway(tiny_base, tmp_path_factory):
    with served_gateway(tiny_base, tmp_path_factory.mktemp("schema-gw"), fake={"tokens": 3},
                        batch={"poll_seconds": 0.1, "lease_seconds": 3}) as server:
        yield server


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return gateway.client()


# ---- the helper itself ---------------------------------------------------------------------------------------
def test_the_helper_fails_on_a_field_openai_does_not_have():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi", "refusal": None}, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}
    assert_openai_shape(body, ChatCompletion)
    for where, extra in ((body, "swiftkv_route"), (body["choices"][0]["message"], "reasoning"),
                         (body["usage"]["prompt_tokens_details"], "cached")):
        extra_body = json.loads(json.dumps(body))
        target = extra_body if where is body else (extra_body["choices"][0]["message"] if "role" in where else
                                                  extra_body["usage"]["prompt_tokens_details"])
        target[extra] = 1
        with pytest.raises(AssertionError, match=f"does not have: .*{extra}"):
            assert_openai_shape(extra_body, ChatCompletion)
    with pytest.raises(AssertionError, match="not a valid"):  # malformed, not only extra
        assert_openai_shape(body | {"object": "chat.completions"}, ChatCompletion)
    for (type_name, path), why in ALLOWED_EXTENSIONS.items() | {k: w for k, (_, w) in ALLOWED_NULLS.items()}.items():
        assert type_name and path and len(why) > 40  # each exception says why


# ---- chat and completions ------------------------------------------------------------------------------------
def test_chat_answers_and_chunks_have_openai_shape(client):
    whole = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=3, logprobs=True, top_logprobs=2, n=2)
    body = raw(whole)
    assert_openai_shape(body, ChatCompletion)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a prompt of under a block
    stream = client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                              max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                              logprobs=True)
    events = sse(stream)
    for event in events:
        assert_openai_shape(event, ChatCompletionChunk)
    assert events[-1]["choices"] == [] and "cached_tokens" in events[-1]["usage"]["prompt_tokens_details"]
    # vLLM's continuous usage stats: usage on every chunk, still OpenAI's shape
    for event in sse(client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})):
        assert_openai_shape(event, ChatCompletionChunk)


def test_completion_answers_and_chunks_have_openai_shape(client):
    body = raw(client.completions.with_raw_response.create(model="m", prompt="hello", max_tokens=3, logprobs=2, echo=False))
    assert_openai_shape(body, Completion)
    events = sse(client.completions.with_raw_response.create(model="m", prompt="hello", max_tokens=3, stream=True,
                                                             stream_options={"include_usage": True}))
    for event in events:
        assert_openai_shape(event, Completion)  # OpenAI streams text_completion objects


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_repeated_long_prompt_reports_cached_tokens(client, kind):
    """The engine's figure reaches usage.prompt_tokens_details.cached_tokens: 0 the first time, whole blocks of the
    prompt the second (the fake engine's prefix cache, 16-token blocks), in the answer and in the stream's usage."""
    prompt = f"{kind}: {LONG}"

    def ask(stream: bool = False):
        if kind == "chat":
            kw = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
            call, shape = client.chat.completions.with_raw_response.create, (ChatCompletionChunk if stream else ChatCompletion)
        else:
            kw = {"model": "m", "prompt": prompt, "max_tokens": 2}
            call, shape = client.completions.with_raw_response.create, Completion
        if stream:
            events = sse(call(stream=True, stream_options={"include_usage": True}, **kw))
            for event in events:
                assert_openai_shape(event, shape)
            return events[-1]["usage"]
        body = raw(call(**kw))
        assert_openai_shape(body, shape)
        return body["usage"]

    first, second, streamed = ask(), ask(), ask(stream=True)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"] and cached % 16 == 0, second
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
    # the SDK reads it where OpenAI puts it
    if kind == "chat":
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=1)
    else:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == cached


# ---- files and batches ---------------------------------------------------------------------------------------
def test_file_objects_have_openai_shape(client):
    f = client.files.with_raw_response.create(file=("in.jsonl", b'{"a": 1}\n'), purpose="batch")
    created = raw(f)
    assert_openai_shape(created, FileObject)
    assert_openai_shape(raw(client.files.with_raw_response.retrieve(created["id"])), FileObject)
    listed = raw(client.files.with_raw_response.list())
    assert listed["object"] == "list" and listed["data"]
    for item in listed["data"]:
        assert_openai_shape(item, FileObject)
    assert_openai_shape(raw(client.files.with_raw_response.delete(created["id"])), FileDeleted)


def test_batch_objects_have_openai_shape_and_sum_cached_tokens(client):
    """A batch's usage.input_tokens_details.cached_tokens is the sum of its lines' cached tokens (it was 0 always)."""
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"batch: {LONG}"}], max_tokens=1)  # cached now
    lines = [chat_line(f"c{i}", f"batch: {LONG}", max_tokens=2, model="m") for i in range(3)] + [chat_line("short", "hi", model="m")]
    b = submit(client, lines)
    assert_openai_shape(b, Batch)
    done = finished(client, b.id, timeout=60)
    assert done.status == "completed", done
    body = raw(client.batches.with_raw_response.retrieve(b.id))
    assert_openai_shape(body, Batch)
    out = read_jsonl(client, done.output_file_id)
    assert len(out) == 4
    for line in out:
        assert_openai_shape(line["response"]["body"], ChatCompletion)
    per_line = [line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in out]
    usage = body["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == sum(per_line) > 0, (per_line, usage)
    assert usage["input_tokens"] == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    listed = raw(client.batches.with_raw_response.list())
    for item in listed["data"]:
        assert_openai_shape(item, Batch)
    held = client.batches.create(input_file_id=upload(client, [chat_line("x", model="m")]), endpoint="/v1/chat/completions",
                                 completion_window="24h")
    try:
        assert_openai_shape(raw(client.batches.with_raw_response.cancel(held.id)), Batch)
    except openai.ConflictError:  # it finished first: nothing left to cancel
        pass


# ---- fine-tuning (the distillation service, in-process) ------------------------------------------------------
class ServedApp:
    """A FastAPI app served by uvicorn from a thread on a free port (its lifespan runs: the trainer's worker loop)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> "ServedApp":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "the trainer did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def trainer(tiny_base, tmp_path_factory, monkeypatch_module):
    from services.training.service import TrainerSettings, create_app

    for name in ("SWIFTKV_API_KEYS", "SWIFTKV_API_KEYS_FILE", "SWIFTKV_TRAINER_HOST", "SWIFTKV_TRAINER_ALLOWED_MODELS"):
        monkeypatch_module.delenv(name, raising=False)
    work = tmp_path_factory.mktemp("schema-trainer")
    (work / "models").mkdir()
    (work / "models" / MODEL).symlink_to(tiny_base, target_is_directory=True)
    app = create_app(TrainerSettings(data_dir=str(work / "data"), models_dir=str(work / "models"), checkpoint_every=2,
                                     events_every=1, eval_max_tokens=128, eval_prompts=1, threads=1, poll_seconds=0.2))
    with ServedApp(app) as served:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_fine_tuning_objects_have_openai_shape(trainer):
    f = raw(trainer.files.with_raw_response.create(file=("train.jsonl", records()), purpose="fine-tune"))
    assert_openai_shape(f, FileObject)
    method = {"type": "distillation", "distillation": {"hyperparameters": QUICK}}
    created = raw(trainer.fine_tuning.jobs.with_raw_response.create(model=MODEL, training_file=f["id"], method=method, seed=7))
    assert_openai_shape(created, FineTuningJob)
    assert created["method"] == {"type": "distillation", "distillation": {"hyperparameters": created["method"]["distillation"]["hyperparameters"]}}
    deadline = time.time() + 240
    while (job := raw(trainer.fine_tuning.jobs.with_raw_response.retrieve(created["id"])))["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.time() < deadline, job
        assert_openai_shape(job, FineTuningJob)
        time.sleep(0.5)
    assert job["status"] == "succeeded", job
    assert_openai_shape(job, FineTuningJob)
    for item in raw(trainer.fine_tuning.jobs.with_raw_response.list())["data"]:
        assert_openai_shape(item, FineTuningJob)
    events = raw(trainer.fine_tuning.jobs.with_raw_response.list_events(created["id"], limit=100))["data"]
    assert {e["type"] for e in events} == {"message", "metrics"}
    for event in events:
        assert_openai_shape(event, FineTuningJobEvent)
    checkpoints = raw(trainer.fine_tuning.jobs.checkpoints.with_raw_response.list(created["id"]))["data"]
    assert checkpoints
    for checkpoint in checkpoints:
        assert_openai_shape(checkpoint, FineTuningJobCheckpoint)
    # a job cancelled while queued or running
    second = trainer.fine_tuning.jobs.create(model=MODEL, training_file=f["id"], method=method)
    assert_openai_shape(raw(trainer.fine_tuning.jobs.with_raw_response.cancel(second.id)), FineTuningJob)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_answers_and_chunks_have_openai_shape(tiny_base, tmp_path):
    """An answer the pool's tool-call parser (vLLM's hermes) reads as a call: the message's tool_calls and the streamed
    tool_calls deltas in OpenAI's shape."""
    with served_gateway(tiny_base, tmp_path, {"base": {"tool_call_parser": "hermes"}}, fake={"text": TOOL_CALL, "tokens": 1},
                        batch=False) as server:
        client = server.client()
        body = raw(client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "weather?"}],
                                                                    tools=TOOLS, max_tokens=40))
        assert_openai_shape(body, ChatCompletion)
        assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather", body
        events = sse(client.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "weather?"}],
                                                                      tools=TOOLS, max_tokens=40, stream=True))
        for event in events:
            assert_openai_shape(event, ChatCompletionChunk)
        assert any(c["delta"].get("tool_calls") for e in events for c in e["choices"]), events


def test_cached_tokens_are_per_key(tiny_base, tmp_path):
    """Each key's prefix cache is its own (vLLM's cache_salt from a digest of the key): a prompt one key sent is not
    reported cached for another, and is for the key itself."""
    with served_gateway(tiny_base, tmp_path, keys=("sk-a", "sk-b"), batch=False) as server:
        a, b = server.client("sk-a"), server.client("sk-b")

        def cached(client) -> int:
            r = client.completions.create(model="m", prompt=f"keys: {LONG}", max_tokens=1)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached(a) == 0
        assert cached(b) == 0  # the same prompt, another key: nothing of a's is found
        assert cached(a) > 0 and cached(b) > 0
