"""The Responses API (/v1/responses) through the official `openai` client: the real gateway app served over HTTP from this
process (uvicorn in a thread) over fake engines, its stored responses in the Batch API's SQLite database. Every Response,
stream event and input-item page is validated against the `openai` package's own types and walked for fields those
types do not declare (harness.openai_schema: their models would keep such fields silently in `model_extra`)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest
from harness import metric, scrape
from harness.batch import finished, read_jsonl, submit
from harness.gateway import InProcessGateway, ThreadedServer, platform_config
from harness.openai_schema import assert_openai_shape
from harness.postgres import fresh_postgres_database
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent

from services.serving.backend import ChoiceDelta, Output
from services.serving.fake import FakeBackend

KEY, OTHER, FULL, LIMITED = "sk-resp-main", "sk-resp-other", "sk-resp-full", "sk-resp-limited"
PUBLIC = "tiny"
QUOTA = 64 * 1024
MAX_CHAIN = 4


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, tiny_base, tmp_path_factory):
    """One pool of fake engines (no tool-call parser), the Batch API with a small storage quota per key; the store on
    the embedded SQLite file, then on a fresh PostgreSQL database."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database("swiftkv_responses")) if request.param == "postgresql" else None
        cfg = platform_config(tiny_base, ("base",), 512, data_dir=str(tmp_path_factory.mktemp("responses")), model=PUBLIC,
                              database_url=url, batch={"max_storage_bytes_per_key": QUOTA, "poll_seconds": 0.1},
                              responses={"max_chain_length": MAX_CHAIN})
        keys = (KEY, OTHER, FULL, f"{LIMITED} prompt_tokens_per_minute=4000")
        yield stack.enter_context(ThreadedServer(InProcessGateway(cfg, {"base": FakeBackend("base", tokens=None)}, keys=keys)))


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return served.client(KEY)


@pytest.fixture
def engine(served):
    engine = served.served.backends["base"]
    yield engine
    engine.script = None


def answer(*pieces: str, finish: str = "stop"):
    """A fake engine's script: these pieces of text, one token each, then `finish`."""
    def script(request):
        return [Output([ChoiceDelta(0, p, 1, finish if i == len(pieces) - 1 else None)]) for i, p in enumerate(pieces)]
    return script


# ---- strict checks against the openai package's types (harness.openai_schema: validated, then walked for fields
# the types do not declare) ----------------------------------------------------------------------------
def checked(data: dict) -> Response:
    return assert_openai_shape(data, Response)


def create(client: openai.OpenAI, **kw) -> Response:
    raw = client.responses.with_raw_response.create(model=PUBLIC, **kw)
    return checked(raw.http_response.json())


def stream_events(served, key: str = KEY, **body) -> list:
    """The raw SSE of a streamed response, each event validated strictly; `event:` lines match the data's type."""
    events = []
    with httpx.stream("POST", f"{served.base}/v1/responses", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": PUBLIC, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(assert_openai_shape(data, ResponseStreamEvent))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


# ---- create ----------------------------------------------------------------------------------------
def test_a_string_input_answers_a_response(client, engine):
    engine.script = answer("Paris", " is", " the capital.")
    resp = create(client, input="What is the capital of France?", instructions="Answer briefly.", max_output_tokens=16,
                  metadata={"topic": "geo"}, user="u1", temperature=0.5)
    assert resp.status == "completed" and resp.output_text == "Paris is the capital."
    assert resp.id.startswith("resp_") and resp.model == PUBLIC and resp.metadata == {"topic": "geo"}
    assert resp.usage.output_tokens == 3 and resp.usage.input_tokens > 0
    assert resp.usage.input_tokens_details.cached_tokens >= 0 and resp.usage.output_tokens_details.reasoning_tokens == 0
    sent = engine.requests[-1]
    assert sent.sampling.max_tokens == 16 and sent.sampling.temperature == 0.5


def test_items_input_and_incomplete_at_max_output_tokens(client, engine):
    resp = create(client, input=[{"role": "developer", "content": "Be terse."},
                                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Count."}]},
                                 {"role": "assistant", "content": "1 2"}, {"role": "user", "content": "Go on."}],
                  max_output_tokens=5)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 5


def test_unserved_fields_are_a_400_naming_them(client):
    cases = [({"tools": [{"type": "web_search"}]}, "tools.0.type"), ({"background": True}, "background"),
             ({"reasoning": {"effort": "low"}}, "reasoning"), ({"conversation": "conv_1"}, "conversation"),
             ({"include": ["file_search_call.results"]}, "include.0"),
             ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0.type"),
             ({"text": {"verbosity": "low"}}, "text.verbosity"), ({"temperature": 3}, "temperature"),
             ({"tool_choice": "required"}, "tool_choice"), ({"frobnicate": 1}, "frobnicate")]
    for extra, param in cases:
        body = {"input": "hi"} | extra
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=PUBLIC, **{k: v for k, v in body.items() if k != "frobnicate"},
                                    extra_body={"frobnicate": 1} if "frobnicate" in extra else None)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)


def test_bad_input_is_a_400_naming_the_field(served):
    cases = [({"input": []}, "input"), ({"input": [1]}, "input.0"), ({"input": [{"role": "user"}]}, "input.0.content"),
             ({"input": [{"role": "user", "content": "x"}] * 2049}, "input"),
             ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}] * 4097}]}, "input"), ({"max_output_tokens": 0}, "max_output_tokens"),
             ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"), ({"previous_response_id": "../etc"}, "previous_response_id"),
             ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"), ({"stream_options": {}}, "stream_options"),
             ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
             ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments")]
    for extra, param in cases:
        r = httpx.post(f"{served.base}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                       json={"model": PUBLIC, "input": "hi"} | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text[:300])
    r = httpx.post(f"{served.base}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": PUBLIC, "input": "hi", "previous_response_id": "resp_nothing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.get(f"{served.base}/v1/responses/resp_x/input_items?limit=0", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


# ---- streaming -------------------------------------------------------------------------------------
def test_a_streamed_response_follows_openais_event_sequence(served, engine):
    engine.script = answer("Hel", "lo", "!")
    events = stream_events(served, input="Say hello.")
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "Hello!" and done.usage.output_tokens == 3
    assert events[7].text == "Hello!"
    # stored like a whole answer
    again = checked(served.client(KEY).responses.with_raw_response.retrieve(done.id).http_response.json())
    assert again.output_text == "Hello!"


def test_a_streamed_response_through_the_client(client, engine):
    engine.script = answer("a", "b")
    with client.responses.stream(model=PUBLIC, input="x", max_output_tokens=2) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_text == "ab"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(served, engine):
    engine.script = answer("a", "b", finish="length")
    events = stream_events(served, input="x", max_output_tokens=2)
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


# ---- stored responses and conversations ------------------------------------------------------------
def test_a_conversation_by_previous_response_id(client, engine, served):
    engine.script = answer("Paris.")
    rules = "Answer briefly, in one word, and never explain the answer you give to the question."
    first = create(client, input="Capital of France?", instructions=rules)
    engine.script = answer("Berlin.")
    second = create(client, input="And of Germany?", previous_response_id=first.id, instructions=rules)
    assert second.previous_response_id == first.id and second.output_text == "Berlin."
    prompt = served.served.gateway.prompter.decode(engine.requests[-1].prompt_token_ids)
    # the whole history in order, rendered with the chat template
    assert prompt.index(rules) < prompt.index("Capital of France?") < prompt.index("Paris.") < prompt.index("And of Germany?")
    # the second turn's prompt starts with the first one's: the engine's prefix cache has it (the fake one counts it)
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.input_tokens_details.cache_write_tokens == second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens
    engine.script = answer("Rome.")
    third = create(client, input="And of Italy?", previous_response_id=second.id)
    prompt = served.served.gateway.prompter.decode(engine.requests[-1].prompt_token_ids)
    assert rules not in prompt and "Berlin." in prompt  # instructions are not carried over (as OpenAI's are not)
    assert third.output_text == "Rome."


def test_a_deleted_response_breaks_its_conversation(client, engine):
    engine.script = answer("ok")
    first = create(client, input="one")
    second = create(client, input="two", previous_response_id=first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=PUBLIC, input="three", previous_response_id=second.id)
    assert e.value.body["param"] == "previous_response_id" and first.id in e.value.body["message"]


def test_logprobs_in_output_text_and_stream_deltas(client, served):
    resp = create(client, input="x", max_output_tokens=2, top_logprobs=2)  # the fake engine: "x" tokens with logprobs
    part = resp.output[0].content[0]
    assert len(part.logprobs) == 2 and len(part.logprobs[0].top_logprobs) == 2 and part.logprobs[0].token == "x"
    events = stream_events(served, input="x", max_output_tokens=2, include=["message.output_text.logprobs"])
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(len(d.logprobs) == 1 for d in deltas)


def test_retrieve_list_input_items_and_delete(client, engine):
    engine.script = answer("ok")
    resp = create(client, input=[{"role": "user", "content": f"item {i}"} for i in range(5)])
    got = checked(client.responses.with_raw_response.retrieve(resp.id).http_response.json())
    assert got.id == resp.id and got.output_text == "ok"
    raw = client.responses.input_items.with_raw_response.list(resp.id, limit=2, order="asc").http_response.json()
    page = assert_openai_shape(raw, ResponseItemList)
    assert [i.content[0].text for i in page.data] == ["item 0", "item 1"] and page.has_more
    everything = [i.content[0].text for i in client.responses.input_items.list(resp.id, order="asc", limit=2)]
    assert everything == [f"item {i}" for i in range(5)]  # the client pages with `after`
    assert [i.content[0].text for i in client.responses.input_items.list(resp.id)][0] == "item 4"  # newest first
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_another_keys_response_is_a_404(client, served, engine):
    engine.script = answer("mine")
    resp = create(client, input="secret")
    other = served.client(OTHER)
    for call in (lambda: other.responses.retrieve(resp.id), lambda: other.responses.delete(resp.id),
                 lambda: other.responses.input_items.list(resp.id),
                 lambda: other.responses.create(model=PUBLIC, input="more", previous_response_id=resp.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(resp.id).id == resp.id


def test_rebuilding_a_conversation_is_charged_before_it_is_read(served, engine):
    """The chain's stored bytes are taken from the key's prompt tokens before the store is read: a key whose bucket
    cannot hold them gets its 429 at no rebuilding cost (rebuilt, this history would not even fit in the context)."""
    limited = served.client(LIMITED)
    engine.script = answer("x " * 2500)  # one "token" of 5,000 characters: a long history, cheap to make
    first = limited.responses.create(model=PUBLIC, input="Talk.")
    sent = len(engine.requests)
    with pytest.raises(openai.RateLimitError) as e:
        limited.responses.create(model=PUBLIC, input="More.", previous_response_id=first.id)
    assert e.value.body["code"] == "rate_limit_exceeded" and "prompt tokens" in e.value.body["message"]
    assert len(engine.requests) == sent


def test_a_client_that_leaves_mid_stream_aborts_the_engine_and_stores_nothing(served, engine):
    engine.script = answer(*["tok "] * 100)
    engine.delay = 0.1
    aborted = engine.aborted
    try:
        with httpx.stream("POST", f"{served.base}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"model": PUBLIC, "input": "Go on and on.", "stream": True}) as r:
            lines = r.iter_lines()
            resp_id = None
            for line in lines:
                if line.startswith("data: ") and '"response.output_text.delta"' in line:
                    break
                if line.startswith("data: ") and resp_id is None:
                    resp_id = json.loads(line[6:])["response"]["id"]
        deadline = time.time() + 10
        while engine.aborted == aborted:
            assert time.time() < deadline, "the engine request was not aborted"
            time.sleep(0.05)
    finally:
        engine.delay = 0.0
    with pytest.raises(openai.NotFoundError):
        served.client(KEY).responses.retrieve(resp_id)


def test_an_expired_response_is_gone_holds_no_quota_and_is_swept(client, engine, served):
    from sqlalchemy import func, select, update

    from services.common.files import held
    from services.gateway.responses_store import responses

    engine.script = answer("old")
    resp = create(client, input="x")
    store = served.served.gateway.responses.store()
    owner = served.served.gateway.keys.identify(f"Bearer {KEY}")
    before = store.used(owner)
    with store.engine.begin() as conn:  # its time is up (batch.file_expiry_seconds is at least an hour)
        conn.execute(update(responses).where(responses.c.id == resp.id).values(expires_at=int(time.time()) - 1))
        conn.execute(update(held).where(held.c.object_id == resp.id).values(expires_at=int(time.time()) - 1))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    assert store.used(owner) < before
    assert store.sweep() >= 1
    with store.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(responses).where(responses.c.id == resp.id)).scalar_one() == 0


def test_store_false_keeps_nothing(client, engine):
    engine.script = answer("gone")
    resp = create(client, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_a_chain_longer_than_the_limit_is_a_400(client, engine):
    engine.script = answer("ok")
    previous = None
    for _ in range(MAX_CHAIN):
        previous = create(client, input="next", previous_response_id=previous).id if previous else create(client, input="first").id
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=PUBLIC, input="one too many", previous_response_id=previous)
    assert e.value.body["param"] == "previous_response_id" and "responses.max_chain_length" in e.value.body["message"]


def test_a_key_at_its_quota_is_refused_before_generation(served, engine):
    full = served.client(FULL)
    engine.script = answer("kept")
    kept = full.responses.create(model=PUBLIC, input="hi")
    with pytest.raises(openai.APIStatusError) as e:  # a stored response holds bytes against the key's uploads too
        full.files.create(file=("big.jsonl", b"x" * QUOTA), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "storage_quota_exceeded"
    full.responses.delete(kept.id)  # and gives them back when deleted
    full.files.create(file=("big.jsonl", b"x" * QUOTA), purpose="batch")
    sent = len(engine.requests)
    with pytest.raises(openai.APIStatusError) as e:
        full.responses.create(model=PUBLIC, input="hi")
    assert e.value.status_code == 413 and e.value.body["code"] == "storage_quota_exceeded"
    assert len(engine.requests) == sent  # refused before any generation
    engine.script = answer("fine")
    assert full.responses.create(model=PUBLIC, input="hi", store=False).output_text == "fine"  # store false needs no room


def test_a_conversation_too_long_for_the_context_is_a_400_or_truncated(client, engine, served):
    engine.script = answer("ok")
    words = []
    while len(served.served.gateway.prompter.encode("".join(words), False)) < 190:  # turns of 190 tokens: three fill 512
        words.append(f"word{len(words)} ")
    long = "".join(words)
    first = create(client, input=long)
    second = create(client, input=long, previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=PUBLIC, input=long, previous_response_id=second.id)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input"
    assert "the limit is 511 tokens" in e.value.body["message"], e.value.body
    kept = create(client, input=long, previous_response_id=second.id, truncation="auto")
    assert kept.status == "completed" and kept.truncation == "auto"


# ---- tools and structured output -------------------------------------------------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_function_call_round_trip(client, engine):
    engine.script = answer('{"city": "Paris"}')
    resp = create(client, input="Weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    call = resp.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert engine.requests[-1].sampling.structured == {"json": WEATHER["parameters"]}
    engine.script = answer("Sunny in Paris.")
    final = create(client, previous_response_id=resp.id, tools=[WEATHER], tool_choice="none",
                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert final.output_text == "Sunny in Paris."
    # the same round trip with the items given back by the client, without the store
    engine.script = answer("Sunny.")
    again = create(client, store=False, tools=[WEATHER], tool_choice="none", input=[{"role": "user", "content": "Weather in Paris?"}, *[
        o.model_dump(exclude_none=True) for o in resp.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert again.output_text == "Sunny."


def test_auto_tool_calls_through_a_pools_tool_call_parser(tiny_base, tmp_path):
    """tool_choice auto (the default with tools) on a pool with vLLM's hermes parser: the calls the model writes in its
    format come back as function_call items, whole and streamed."""
    pytest.importorskip("vllm")
    cfg = platform_config(tiny_base, {"base": {"tool_call_parser": "hermes"}}, 512, data_dir=str(tmp_path), model=PUBLIC)
    engine = FakeBackend("base")
    engine.script = answer("<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>")
    with ThreadedServer(InProcessGateway(cfg, {"base": engine})) as server:
        resp = create(server.client(), input="Weather in Paris?", tools=[WEATHER])
        assert [o.type for o in resp.output] == ["function_call"] and json.loads(resp.output[0].arguments) == {"city": "Paris"}
        events = stream_events(server, input="Weather in Paris?", tools=[WEATHER])
        done = events[-1].response
        assert done.status == "completed" and done.output[-1].type == "function_call" and done.output[-1].name == "get_weather"
        added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert len(added) == 1 and json.loads(args) == {"city": "Paris"}


def test_required_tool_calls_stream_as_function_call_events(served, engine):
    engine.script = answer('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    events = stream_events(served, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required")
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = events[-1].response
    assert done.output[0].type == "function_call" and json.loads(done.output[0].arguments) == {"city": "Oslo"}


def test_json_schema_output(client, engine):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"], "additionalProperties": False}
    engine.script = answer('{"capital": "Paris"}')
    resp = create(client, input="Capital of France as JSON.",
                  text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}})
    assert json.loads(resp.output_text) == {"capital": "Paris"}
    assert engine.requests[-1].sampling.structured == {"json": schema}
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "capital"


# ---- the Batch API ---------------------------------------------------------------------------------
def test_a_batch_of_responses_lines(client, engine):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": PUBLIC, "input": f"question {i}", "max_output_tokens": 3}} for i in range(3)]
    b = finished(client, submit(client, lines, endpoint="/v1/responses").id, timeout=60)
    assert b.status == "completed" and b.request_counts.completed == 3, b
    out = read_jsonl(client, b.output_file_id)
    for line in out:
        resp = checked(line["response"]["body"])
        assert resp.status == "incomplete" and resp.usage.output_tokens == 3
        assert client.responses.retrieve(resp.id).id == resp.id  # stored (store defaults to true)
    assert b.usage.input_tokens > 0 and b.usage.output_tokens == 9


def test_latency_metrics_carry_the_route(client, engine, served):
    engine.script = answer("a", "b", "c")
    create(client, input="hi")
    m = scrape(served.base)
    assert metric(m, "swiftkv_time_to_first_token_seconds_count", pool="base", source="live", route="responses") >= 1
    assert metric(m, "swiftkv_time_per_output_token_seconds_count", pool="base", source="live", route="responses") >= 1
    client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert metric(scrape(served.base), "swiftkv_time_to_first_token_seconds_count", pool="base", route="chat") >= 1


def test_openapi_describes_the_routes(served):
    doc = httpx.get(f"{served.base}/openapi.json").json()
    assert {"post"} <= set(doc["paths"]["/v1/responses"]) and "ResponsesRequest" in doc["components"]["schemas"]
    assert {"get", "delete"} <= set(doc["paths"]["/v1/responses/{response_id}"])
    assert "get" in doc["paths"]["/v1/responses/{response_id}/input_items"]
