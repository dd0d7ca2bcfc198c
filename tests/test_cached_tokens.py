"""usage.prompt_tokens_details.cached_tokens on real engines: the prompt tokens vLLM read from its prefix cache
(its num_cached_tokens), as the in-process engines report them through the gateway (answers, the streamed usage chunk,
a batch's usage summed over its lines), and as a vLLM server started with --enable-prompt-tokens-details reports them to
the remote backend. The run's shared engines (conftest: `platform`, `vllm_server`); vLLM's CPU backend caches whole
blocks of 128 tokens. The plumbing over the fake engine: test_openai_schema.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from harness.batch import chat_line, finished, read_jsonl, submit
from harness.engines import KEY, UPSTREAM, UPSTREAM_KEY, prompt
from harness.openai_schema import assert_openai_shape
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.serving.backend import GenerateRequest, SamplingOptions
from services.serving.remote import RemoteBackend

pytestmark = pytest.mark.engine
BASE = "tiny-base"  # the base pool by its own name: every request of a test on one engine (and its one prefix cache)
BLOCK = 128


def text(seed: int, words: int = 90) -> str:
    """A prompt of about 250 tokens no other test sends (the engines are shared by the run)."""
    rng = random.Random(seed)
    vocabulary = ["river", "town", "ledger", "harbor", "quarry", "lantern", "meadow", "copper", "signal", "orchard", "basin"]
    return " ".join(rng.choice(vocabulary) for _ in range(words)) + f" ({seed}). Summarize."


@pytest.fixture(scope="module")
def client(platform):
    return platform.client(KEY)


def usage_of(raw) -> dict:
    return json.loads(raw.http_response.content)["usage"]


def test_a_second_request_with_the_same_long_prompt_reports_cached_tokens(client):
    messages = [{"role": "user", "content": text(101)}]
    first = client.chat.completions.with_raw_response.create(model=BASE, messages=messages, max_tokens=2)
    assert_openai_shape(json.loads(first.http_response.content), ChatCompletion)
    usage = usage_of(first)
    assert usage["prompt_tokens"] > 2 * BLOCK and usage["prompt_tokens_details"] == {"cached_tokens": 0}, usage
    second = client.chat.completions.create(model=BASE, messages=messages, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // BLOCK * BLOCK >= 2 * BLOCK, second.usage  # every whole block
    # streamed: the final usage chunk carries it
    events = [json.loads(line[5:]) for line in client.chat.completions.with_raw_response.create(
        model=BASE, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}).http_response.iter_lines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    for event in events:
        assert_openai_shape(event, ChatCompletionChunk)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_completions_report_cached_tokens_too(client):
    body = {"model": BASE, "prompt": text(202), "max_tokens": 2}
    first = client.completions.with_raw_response.create(**body)
    assert_openai_shape(json.loads(first.http_response.content), Completion)
    assert usage_of(first)["prompt_tokens_details"]["cached_tokens"] == 0
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 2 * BLOCK


def test_a_batch_reports_the_sum_of_its_lines_cached_tokens(client):
    content = text(303)
    client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": content}], max_tokens=1)  # now cached
    b = submit(client, [chat_line(f"l{i}", content, max_tokens=2, model=BASE) for i in range(3)] + [chat_line("other", text(304), model=BASE)])
    done = finished(client, b.id, timeout=240)
    assert done.status == "completed", done
    out = read_jsonl(client, done.output_file_id)
    per_line = {line["custom_id"]: line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in out}
    assert all(per_line[f"l{i}"] >= 2 * BLOCK for i in range(3)), per_line
    batch = json.loads(client.batches.with_raw_response.retrieve(b.id).http_response.content)
    assert_openai_shape(batch, Batch)
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(per_line.values()), (batch["usage"], per_line)


def test_the_remote_backend_reads_a_vllm_servers_figure(vllm_server):
    """vLLM's server, started with --enable-prompt-tokens-details (as the chart starts its engine servers), reports the
    figure on its final usage chunk: the remote backend passes it on."""
    ids = prompt(300, seed=77)

    async def run():
        backend = RemoteBackend("base", vllm_server, UPSTREAM, api_key=UPSTREAM_KEY)
        try:
            await backend.start()
            figures = []
            for i in range(2):
                request = GenerateRequest(f"c{i}", ids, SamplingOptions(max_tokens=4, ignore_eos=True))
                outs = [o async for o in backend.generate(request)]
                assert sum(c.num_tokens for o in outs for c in o.choices) == 4
                figures.append([o.cached_tokens for o in outs if o.cached_tokens is not None])
            return figures
        finally:
            await backend.stop()

    first, second = asyncio.run(run())
    assert first == [0] and second == [(300 - 1) // BLOCK * BLOCK], (first, second)
