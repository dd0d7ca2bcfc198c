"""The CPU-feature check: dtype choice and refused engine settings, for both kinds of CPU this project
runs on (AVX-512 with native bf16, and AVX2 only), whichever kind runs the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from swiftkv_core.hardware import (
    FEATURES_ENV,
    UnsupportedSetting,
    check_engine_args,
    cpu_info,
    engine_args_for_machine,
    resolve_dtype,
)

AVX2_ONLY = "avx2,fma"
AVX512_BF16 = "avx2,fma,avx512f,avx512_vnni,avx512_bf16"
AMX = "avx2,fma,amx_tile,amx_bf16"


def test_real_cpu_agrees_with_torch(monkeypatch):
    """Without the override the flags are the machine's, and agree with what vLLM's kernels check."""
    torch = pytest.importorskip("torch")
    monkeypatch.delenv(FEATURES_ENV, raising=False)
    info = cpu_info()
    assert not info.overridden and info.model
    assert info.avx512 == torch.cpu._is_avx512_supported()
    assert info.amx == torch.cpu._is_amx_tile_supported()
    assert info.model in info.summary()


@pytest.mark.parametrize(
    "flags, dtype, fp8",
    [(AVX2_ONLY, "float32", False), (AVX512_BF16, "bfloat16", True), (AMX, "bfloat16", True), ("avx2,avx512f", "float32", True)],
)
def test_auto_dtype_and_fp8_follow_the_flags(monkeypatch, flags, dtype, fp8):
    monkeypatch.setenv(FEATURES_ENV, flags)
    assert cpu_info().overridden
    assert resolve_dtype("auto", on_cpu=True) == dtype
    assert resolve_dtype(None, on_cpu=True) == dtype
    assert resolve_dtype("auto", on_cpu=False) == "auto"  # GPUs: the model's own dtype
    assert resolve_dtype("float16", on_cpu=True) == "float16"  # explicit choices pass through
    if fp8:
        check_engine_args({"kv_cache_dtype": "fp8"}, on_cpu=True)
    else:
        with pytest.raises(UnsupportedSetting) as e:
            check_engine_args({"kv_cache_dtype": "fp8_e4m3"}, on_cpu=True, where="pools.prefill.engine_args")
        message = str(e.value)
        assert "pools.prefill.engine_args.kv_cache_dtype: fp8_e4m3" in message
        assert "AVX-512 or AMX" in message and "kv_cache_dtype: auto" in message
    check_engine_args({"kv_cache_dtype": "fp8"}, on_cpu=False)  # GPUs have their own FP8 path


def test_engine_args_for_machine_resolves_and_keeps_the_rest(monkeypatch):
    monkeypatch.setenv(FEATURES_ENV, AVX2_ONLY)
    args = {"dtype": "auto", "max_model_len": 512}
    assert engine_args_for_machine(args, on_cpu=True) == {"dtype": "float32", "max_model_len": 512}
    assert args["dtype"] == "auto"  # the caller's dict is not changed


def _fp8_config(tmp_path: Path, tiny_base: Path, tiny_swiftkv: Path) -> Path:
    engine_args = {"dtype": "auto", "kv_cache_dtype": "fp8", "max_model_len": 256}
    config = {
        "model": "tiny",
        "port": 0,
        "pools": {
            "prefill": {"model": str(tiny_swiftkv), "engine_args": engine_args},
            "decode": {"model": str(tiny_base), "engine_args": {"dtype": "auto", "max_model_len": 256}},
        },
    }
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_serve_refuses_fp8_kv_on_a_cpu_without_avx512(tmp_path, tiny_base, tiny_swiftkv):
    """`swiftkv serve` exits with the reason before any engine starts: no worker stack trace."""
    config = _fp8_config(tmp_path, tiny_base, tiny_swiftkv)
    env = {**os.environ, FEATURES_ENV: AVX2_ONLY}
    swiftkv = Path(sys.executable).with_name("swiftkv")
    proc = subprocess.run([str(swiftkv), "serve", "--config", str(config), "--engine", "inprocess"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pools.prefill.engine_args.kv_cache_dtype: fp8 needs a CPU with AVX-512 or AMX" in proc.stderr
    assert "Traceback" not in proc.stderr and "EngineCore" not in proc.stderr
