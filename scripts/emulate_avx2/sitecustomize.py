"""Loaded by every Python process that scripts/emulate-avx2.sh starts: vLLM's CPU platform believes the CPU has no
AVX-512, so it loads its AVX2 kernels (vllm._C_AVX2) and refuses what needs AVX-512, as on an AVX2-only machine.
torch's own kernels and oneDNN are held to AVX2 by ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA (set by the script),
this project's dtype choice by SWIFTKV_CPU_FEATURES. The patch waits for vLLM's platform module: torch is not
imported by processes that never import vLLM."""

import importlib.abc
import importlib.util
import sys


class _AfterVllmCpuPlatform(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch.cpu

            torch.cpu._is_avx512_supported = lambda: False
            torch.cpu._is_avx512_bf16_supported = lambda: False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterVllmCpuPlatform())
