"""Which requests of a step a dual-mode SwiftKV engine runs as the base model (swiftkv_core/dual_mode.py).

vLLM passes a model no per-request information: it sees the step's tokens and attention metadata. The model runner
holds each request's SamplingParams, in the order of the metadata's `query_start_loc`. So a dual-mode model installs
one wrapper around the runner's `_model_forward` (its documented override point for model execution): before every
forward it publishes a bool per scheduled request (True: base mode, from `extra_args`), which the model reads from
`base_requests()` during that forward. Nothing changes for any other model: the wrapper publishes only while a
dual-mode model has installed it, in the worker process that runs the model.
"""

from __future__ import annotations

import functools

import torch

from ..dual_mode import is_base

_current: torch.Tensor | None = None  # this step's base-mode flag per request, None outside a dual-mode forward


def base_requests() -> torch.Tensor | None:
    """Per scheduled request of the running step, in the attention metadata's order: True where it runs in base mode.
    None when no request of the step does (or in the engine's dummy and profiling runs)."""
    return _current


def install() -> None:
    """Wrap the model runner's `_model_forward` once per process (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner inherits it

    forward = GPUModelRunner._model_forward
    if getattr(forward, "_swiftkv_request_modes", False):
        return

    @functools.wraps(forward)
    def model_forward(self, *args, **kwargs):
        global _current
        _current = _flags(self)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _current = None

    model_forward._swiftkv_request_modes = True
    GPUModelRunner._model_forward = model_forward


def _flags(runner) -> torch.Tensor | None:
    requests = getattr(runner, "requests", {})
    flags = []
    for req_id in runner.input_batch.req_ids:
        state = requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        flags.append(is_base(getattr(params, "extra_args", None)))
    if not any(flags):
        return None
    return torch.tensor(flags, dtype=torch.bool, device=runner.device)
