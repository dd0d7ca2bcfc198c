"""`swiftkv distill --device`: the choice of device and its refusals. The CUDA path itself (training, a resume from a
saved state) runs on a GPU machine through `scripts/frontier_cuda.py --smoke`; here torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from swiftkv_core.distill import DistillConfig, DistillError, distill, resolve_device, use_bf16


def test_auto_is_the_cpu_without_a_gpu():
    assert not torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused_with_the_way_out(name):
    with pytest.raises(DistillError, match="sees no CUDA device; use --device cpu"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps", ""])
def test_unknown_device_names_the_choices(name):
    with pytest.raises(DistillError, match=r"auto, cpu or cuda\[:N\]"):
        resolve_device(name)


def test_explicit_precision_does_not_depend_on_the_device():
    assert use_bf16("bf16", torch.device("cpu")) and not use_bf16("fp32", torch.device("cpu"))


def test_a_run_refuses_a_missing_gpu_before_loading_anything(tmp_path):
    cfg = DistillConfig(base=str(tmp_path / "no-model"), out=str(tmp_path / "run"), data=str(tmp_path / "no-data"),
                        num_key_value_layers=2, device="cuda")
    with pytest.raises(DistillError, match="no CUDA device"):
        distill(cfg)
    assert not (tmp_path / "run").exists()
