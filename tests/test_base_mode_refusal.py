"""A SwiftKV engine not started in dual mode refuses base-mode requests at admission (the vLLM plugin's request
validator) instead of answering them with the SwiftKV model under a `mode=base` header."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402

from swiftkv_core.dual_mode import CONFIG_FIELD, MODE_ARG  # noqa: E402
from swiftkv_core.vllm.engine_config import FrontEndOnly, SwiftKVEngineConfig  # noqa: E402


def _validator(dual_mode: bool, processors=None):
    """The request validator SwiftKVEngineConfig installs on an engine (dual mode or not)."""
    hf_config = SimpleNamespace(**({CONFIG_FIELD: True} if dual_mode else {}))
    vllm_config = SimpleNamespace(
        speculative_config=None, parallel_config=SimpleNamespace(pipeline_parallel_size=1), kv_transfer_config=None,
        cache_config=SimpleNamespace(kv_offloading_size=None),
        attention_config=SimpleNamespace(backend=None, backend_per_kind={}),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
        model_config=SimpleNamespace(hf_config=hf_config, logits_processors=processors))
    SwiftKVEngineConfig.verify_and_update_config(vllm_config)
    validators = [p for p in vllm_config.model_config.logits_processors if "RequestValidator" in str(p)]
    assert len(validators) == 1, vllm_config.model_config.logits_processors
    return resolve_obj_by_qualname(validators[0].replace(":", "."))


def _base():
    return SamplingParams(max_tokens=4, extra_args={MODE_ARG: "base"})


def test_an_engine_not_in_dual_mode_refuses_a_base_mode_request():
    validator = _validator(dual_mode=False)
    with pytest.raises(VLLMValidationError, match="not started in dual mode") as e:
        validator.validate_params(_base())
    assert e.value.parameter == "extra_args"
    validator.validate_params(SamplingParams(max_tokens=4))  # SwiftKV-mode requests are served as before
    validator.validate_params(SamplingParams(max_tokens=4, extra_args={MODE_ARG: "swiftkv"}))


def test_a_dual_mode_engine_admits_base_mode_requests():
    _validator(dual_mode=True).validate_params(_base())


def test_the_validator_is_not_listed_twice_and_stays_out_of_engine_processes():
    from swiftkv_core.vllm.engine_config import SwiftKVRequestValidator

    validator = _validator(dual_mode=False, processors=[SwiftKVRequestValidator.FQCN])  # a dual one named by hand
    with pytest.raises(VLLMValidationError):
        validator.validate_params(_base())
    import pickle

    assert pickle.loads(pickle.dumps(FrontEndOnly([validator.FQCN, "x:Y"]))) == ["x:Y"]


@pytest.mark.engine
def test_vllms_engine_without_the_override_refuses_a_base_mode_request(offline_engines, tiny_swiftkv):
    llm = offline_engines.get(tiny_swiftkv)
    with pytest.raises(VLLMValidationError, match="not started in dual mode"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], [_base()], use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=2, ignore_eos=True)], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the engine serves SwiftKV-mode requests as before
