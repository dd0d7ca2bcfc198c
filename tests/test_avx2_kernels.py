"""SwiftKV inside vLLM on the kernels an AVX2-only CPU runs, on any x86 machine: `scripts/emulate-avx2.sh` starts a
process in which vLLM loads its AVX2 kernel library (vllm._C_AVX2: attention, cache and activation kernels compiled
without AVX-512) and torch and oneDNN are held to AVX2. The machines this suite mostly runs on have AVX-512, where vLLM
loads another library, so without this the AVX2 path of the model plugin would run only where CI happens to land on
an AVX2-only CPU."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from harness.processes import tool_env

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# Run in the emulated process: the engine in-process, greedy tokens of prompts around block and step boundaries
# (mixed in one batch) against the reference model, and which kernel library the process mapped.
CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from harness.engines import generate, offline_llm, prompt
from swiftkv_core.hardware import cpu_compute_dtype
from swiftkv_core.modeling_llama_swiftkv import load_model

prompts = [prompt(n, seed=7) for n in (1, 31, 33, 65, 150)]
llm = offline_llm({model!r})
got = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, logprobs=None)]
ref = load_model({model!r})
expected = [ref.greedy_generate(p, len(g), swiftkv=True) for p, g in zip(prompts, got)]
libraries = sorted({{line.split("/")[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line}})
print(json.dumps({{"got": got, "expected": expected, "libraries": libraries, "dtype": cpu_compute_dtype()}}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="vLLM's AVX2 kernels are x86's")
def test_swiftkv_on_vllms_avx2_kernels_matches_the_reference(tiny_swiftkv):
    code = CHILD.format(tests=str(TESTS), model=str(tiny_swiftkv))
    r = subprocess.run([str(ROOT / "scripts" / "emulate-avx2.sh"), sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=600, cwd=ROOT, env=tool_env())
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["libraries"] == ["_C_AVX2.abi3.so"], out["libraries"]
    assert out["dtype"] == "float32"  # the platform's choice without native bf16
    assert out["got"] == out["expected"]
