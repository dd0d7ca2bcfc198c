"""The CPU-feature check: dtype choice and refused engine settings, for both kinds of CPU this project
runs on (AVX-512 with native bf16, and AVX2 only), whichever kind runs the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.config import load_config
from swiftkv_core.hardware import (
    ALLOCATOR_ENV,
    BIND_ENV,
    FEATURES_ENV,
    UnsupportedSetting,
    allowed_cpus,
    check_cpu_cores,
    check_cpu_cores_fit,
    check_engine_args,
    cpu_info,
    engine_args_for_machine,
    format_cpu_list,
    parse_cpu_list,
    plan_cpu_binding,
    preload_tcmalloc,
    resolve_dtype,
    spread_cores,
    tcmalloc_library,
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
            check_engine_args({"kv_cache_dtype": "fp8_e4m3"}, on_cpu=True, where="pools.swiftkv.engine_args")
        message = str(e.value)
        assert "pools.swiftkv.engine_args.kv_cache_dtype: fp8_e4m3" in message
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
            "swiftkv": {"model": str(tiny_swiftkv), "engine_args": engine_args},
            "base": {"model": str(tiny_base), "engine_args": {"dtype": "auto", "max_model_len": 256}},
        },
    }
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_serve_refuses_fp8_kv_on_a_cpu_without_avx512(tmp_path, tiny_base, tiny_swiftkv):
    """`swiftkv serve` exits with the reason before any engine starts: no worker stack trace."""
    config = _fp8_config(tmp_path, tiny_base, tiny_swiftkv)
    env = {**os.environ, FEATURES_ENV: AVX2_ONLY}
    swiftkv = Path(sys.executable).with_name("swiftkv")
    proc = subprocess.run([str(swiftkv), "serve", "--config", str(config), "--engine", "inprocess"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pools.swiftkv.engine_args.kv_cache_dtype: fp8 needs a CPU with AVX-512 or AMX" in proc.stderr
    assert "Traceback" not in proc.stderr and "EngineCore" not in proc.stderr


# ---- CPU placement (cpu_cores) ------------------------------------------------------------------------------
# That each in-process engine's worker really computes on its cores: test_gateway.py, on the platform's engines.


def _pools_yaml(tmp_path: Path, cpu_cores, engine_args: dict | None = None) -> Path:
    path = tmp_path / "cores.yaml"
    pool = {"model": "m", "cpu_cores": cpu_cores, "engine_args": engine_args or {}}
    path.write_text(yaml.safe_dump({"pools": {"base": pool}}))
    return path


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("nobind", "nobind"), ("0-1", "0-1"), (1, "1"), (" 0,2-3 ", "0,2-3")])
def test_cpu_cores_forms_accepted_at_config_load(tmp_path, value, expected):
    assert load_config(_pools_yaml(tmp_path, value)).pools["base"].cpu_cores == expected


@pytest.mark.parametrize(
    "value, engine_args, says",
    [
        ("all", {}, "'all' is not a list of CPU ids"),
        ("0-", {}, "is not a list of CPU ids"),
        ("3-1", {}, "from the lower CPU id to the higher"),
        ("", {}, "is not a list of CPU ids"),
        ("0|1", {}, "names 2 CPU list(s), and the engine has 1 worker(s)"),
        ("0", {"tensor_parallel_size": 2}, "names 1 CPU list(s), and the engine has 2 worker(s)"),
        (True, {}, "valid string"),
    ],
)
def test_malformed_cpu_cores_are_refused_at_config_load(tmp_path, value, engine_args, says):
    with pytest.raises(ValueError) as e:
        load_config(_pools_yaml(tmp_path, value, engine_args))
    assert "cpu_cores" in str(e.value) and says in str(e.value)


def test_cpu_lists_round_trip():
    assert parse_cpu_list("5,0-2") == [0, 1, 2, 5]
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    check_cpu_cores("0-3|4-7", world_size=2)


def test_cpu_ids_outside_this_process_are_refused():
    allowed = allowed_cpus()
    check_cpu_cores_fit(format_cpu_list(allowed))
    outside = max(allowed) + 1
    with pytest.raises(UnsupportedSetting) as e:
        check_cpu_cores_fit(f"0|{outside}", "pools.base.cpu_cores")
    assert str(e.value).startswith(f"pools.base.cpu_cores: CPU {outside} is not available here")
    assert f"CPUs {format_cpu_list(allowed)}" in str(e.value)


@pytest.mark.parametrize(
    "cores, engines, shares, reserved",
    [
        ([[0], [1]], 2, [[0], [1]], []),  # 2 cores, 2 engines: one core each, none left over
        ([[0], [1]], 3, [[0], [1], [0]], []),  # more engines than cores: they share
        ([[0]], 2, [[0], [0]], []),
        ([[i] for i in range(8)], 2, [[0, 1, 2], [3, 4, 5, 6]], [7]),  # one core left to schedulers and the gateway
        ([[0, 8], [1, 9], [2, 10], [3, 11], [4, 12]], 2, [[0, 1], [2, 3]], [4, 12]),  # SMT: whole cores, one thread each
    ],
)
def test_engines_get_their_own_cores(cores, engines, shares, reserved):
    assert spread_cores(cores, engines) == (shares, reserved)


def test_binding_plan(monkeypatch, caplog):
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.setenv(FEATURES_ENV, AVX2_ONLY)
    cpus = allowed_cpus()
    both = {"swiftkv": "auto", "base": "auto"}
    assert plan_cpu_binding(both, {}, on_cpu=False) == {"swiftkv": None, "base": None}  # GPUs: untouched
    assert plan_cpu_binding({"base": "auto"}, {}, on_cpu=True) == {"base": None}  # one engine: vLLM's own binding
    with caplog.at_level("INFO", logger="swiftkv.hardware"):
        plan = plan_cpu_binding(both, {}, on_cpu=True)
    assert set(plan) == set(both) and all(plan.values())
    shares = [set(parse_cpu_list(plan[name])) for name in both]
    assert shares[0] | shares[1] <= set(cpus)
    assert len(cpus) < 2 or not shares[0] & shares[1]
    assert f"pool swiftkv: cpu_cores auto -> {plan['swiftkv']} (2 in-process engines" in caplog.text
    assert "vector flags (from SWIFTKV_CPU_FEATURES): avx2 fma" in caplog.text  # logged with the CPU, like dtype auto
    # An explicit list passes through and the auto engine gets the rest; nobind claims nothing.
    assert plan_cpu_binding({"swiftkv": str(cpus[0]), "base": "auto"}, {}, on_cpu=True, cpus=[0, 1]) == {"swiftkv": "0", "base": "1"}
    assert plan_cpu_binding({"swiftkv": "nobind", "base": "auto"}, {}, on_cpu=True, cpus=[0, 1, 2]) == {"swiftkv": "nobind", "base": "0-1"}
    # Several workers per engine: vLLM's own binding (one list per worker is the operator's to give).
    assert plan_cpu_binding(both, {"base": 2}, on_cpu=True) == {"swiftkv": None, "base": None}
    # The operator's VLLM_CPU_OMP_THREADS_BIND wins over auto.
    monkeypatch.setenv(BIND_ENV, "nobind")
    assert plan_cpu_binding(both, {}, on_cpu=True) == {"swiftkv": None, "base": None}


@pytest.mark.slow
def test_serve_refuses_cpu_cores_this_machine_lacks(tmp_path, tiny_base):
    """`swiftkv serve --engine inprocess` with CPU ids outside its affinity mask exits with the reason before any
    engine starts; garbage is refused as an invalid config."""
    outside = max(allowed_cpus()) + 6
    swiftkv = Path(sys.executable).with_name("swiftkv")
    for value, says in ((outside, f"pools.base.cpu_cores: CPU {outside} is not available here"),
                        ("cores please", "cpu_cores: 'cores please' is not a list of CPU ids")):
        config = tmp_path / "platform.yaml"
        config.write_text(yaml.safe_dump({"model": "tiny", "port": 0, "pools": {
            "base": {"model": str(tiny_base), "cpu_cores": value, "engine_args": {"max_model_len": 256}}}}))
        proc = subprocess.run([str(swiftkv), "serve", "--config", str(config), "--engine", "inprocess"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert says in proc.stderr
        assert "Traceback" not in proc.stderr and "EngineCore" not in proc.stderr


def test_tcmalloc_preload(monkeypatch, caplog):
    """The system's tcmalloc goes first in LD_PRELOAD, unless one is already there or SWIFTKV_CPU_ALLOCATOR=system;
    without one installed, LD_PRELOAD stays and the log says what to install."""
    import ctypes.util

    caplog.set_level("INFO", logger="swiftkv.hardware")
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so")
    installed = tcmalloc_library()
    added = preload_tcmalloc()
    assert added == installed
    assert os.environ["LD_PRELOAD"] == (f"{installed}:/opt/libother.so" if installed else "/opt/libother.so")
    assert ("tcmalloc preloaded" if installed else "install tcmalloc") in caplog.text
    assert preload_tcmalloc() is None  # already there: nothing added twice

    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so.4")
    assert preload_tcmalloc() is None and os.environ["LD_PRELOAD"] == "/usr/lib/libtcmalloc.so.4"
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert preload_tcmalloc() is None and "LD_PRELOAD" not in os.environ

    monkeypatch.delenv(ALLOCATOR_ENV)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # a machine without it
    assert preload_tcmalloc() is None and "LD_PRELOAD" not in os.environ
    assert "libtcmalloc-minimal4" in caplog.text
