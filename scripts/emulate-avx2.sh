#!/usr/bin/env bash
# Run a command as on an AVX2-only CPU (no AVX-512, no native bf16, no AMX), on a machine that has AVX-512:
#   scripts/emulate-avx2.sh bash .ci/run        scripts/emulate-avx2.sh make test
# torch and oneDNN kernels held to AVX2, vLLM's AVX2 kernel library, float32 engines (the project's choice without
# native bf16). The silicon is still this machine's (clock, caches, memory): a timing is an estimate for an AVX2
# machine, not its measurement. Two tests compare the project's CPU detection with the real CPU's and are left out.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$here/emulate_avx2${PYTHONPATH:+:$PYTHONPATH}"
export SWIFTKV_CPU_FEATURES=avx2,fma ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} --deselect tests/test_hardware.py::test_real_cpu_agrees_with_torch
  --deselect tests/test_vllm_swiftkv.py::test_swiftkv_fp8_kv_cache"
exec "$@"
