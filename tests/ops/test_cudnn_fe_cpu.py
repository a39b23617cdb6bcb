"""The cuDNN-frontend window kernel's CPU-side parts (its GPU behaviour is in test_attention_window_gpu.py):
it refuses what it cannot write, naming why, and an execution failing inside a CUDA-graph capture names the
plan."""

from __future__ import annotations

import torch

from xstage_dit.ops.attention.cudnn_fe import CudnnWindowKernel, _plan_label
from xstage_dit.ops.attention.window import WindowGeometry


def test_refusals_name_the_reason():
    kernel = CudnnWindowKernel()
    geom = WindowGeometry(4, 1, 4608, 24, 128, 4608 * 24 * 128)
    assert "peer window" in kernel.supports(geom, torch.bfloat16, torch.device("cuda"), has_window=False)
    assert "CUDA device" in kernel.supports(geom, torch.bfloat16, torch.device("cpu"), has_window=True)
    assert "float32" in kernel.supports(geom, torch.float32, torch.device("cuda"), has_window=True)
    odd = WindowGeometry(4, 1, 4607, 24, 128, 4608 * 24 * 128)
    assert "S=4607 not divisible by P=4" in kernel.supports(odd, torch.bfloat16, torch.device("cuda"), True)
    head = WindowGeometry(4, 1, 4608, 24, 96, 4608 * 24 * 96)
    assert "head_dim" in kernel.supports(head, torch.bfloat16, torch.device("cuda"), True)


class _Graph:
    def get_plan_name_at_index(self, index):
        return f"eng{index}_k2=1"

    def get_behavior_notes(self):
        return ["RUNTIME_COMPILATION"]


class _Mute:
    def get_plan_name_at_index(self, index):
        raise RuntimeError("not built")

    def get_behavior_notes(self):
        raise RuntimeError("no candidate")


def test_plan_label_names_what_the_frontend_can_tell():
    assert _plan_label(_Graph(), 3) == "#3 eng3_k2=1 ['RUNTIME_COMPILATION']"
    assert _plan_label(_Mute(), 3) == "#3"  # never raises inside the error it describes
    assert "not tuned" in _plan_label(_Graph(), None)
