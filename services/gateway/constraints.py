"""Structured-output constraints (response_format's JSON schema, vLLM's structured_outputs, the JSON schema a
tool choice derives) checked at the edge with vLLM's own xgrammar validation, so a malformed one is a 400 naming
its field and never reaches an engine.

vLLM parses a constraint in its frontend but compiles it in the engine core process (StructuredOutputManager,
a thread of the scheduler), with the one backend the engine's first structured request chose. With the
default backend `auto`, the frontend falls back to guidance for what xgrammar refuses; an engine that already
chose xgrammar then fails that request in the core (vLLM issue #43920: vllm 0.32 fails the one request,
earlier releases killed the engine core). Refusing here what xgrammar refuses keeps every engine on xgrammar
and every malformed constraint a 400 before it is routed.
"""

from __future__ import annotations

from services.common.errors import bad_request

from .tools import vllm_installed, vllm_refusals

CHECKED_BACKENDS = ("auto", "xgrammar")


def checked_here(cfg) -> bool:
    """Whether every pool compiles with xgrammar (vLLM's `auto` or `xgrammar`) and vLLM is installed here: the
    edge then checks with the same validation. A pool set to another backend keeps that backend's own validation,
    in its engine; without vLLM (the gateway image) every constraint is checked by the engine that serves it."""
    if not vllm_installed():
        return False
    for pool in cfg.pools.values():
        so = pool.engine_args.get("structured_outputs_config") or {}
        if not isinstance(so, dict) or so.get("backend", "auto") not in CHECKED_BACKENDS:
            return False
    return True


def check(structured: dict, param: str) -> None:
    """vLLM's xgrammar validation of StructuredOutputsParams fields (parsing, not compiling: milliseconds, and
    xgrammar releases the GIL); a refusal is a 400 naming `param`. Runs on the gateway's CPU pool."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(**structured)))
    except (*vllm_refusals(), RecursionError) as e:  # a JSON schema given as a string may nest past the stack
        raise bad_request(f"{param}: not accepted by the structured-output backend (xgrammar): {e}", param=param)
