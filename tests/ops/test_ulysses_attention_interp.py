"""The Triton kernels on the CPU under TRITON_INTERPRET=1: 1, 2 and 4 virtual ranks in one process
(several destination buffers behind one pointer table) against the fp32 reference.

The interpreter runs in a subprocess so TRITON_INTERPRET is set before triton is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES_SCRIPT = Path(__file__).with_name("_ulysses_interp_cases.py")


@pytest.fixture(scope="module")
def interp_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(CASES_SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["w1_bf16_tail", "w1_fp16_ptr", "w2_uneven_seq_and_heads", "w4_straddling_tiles",
                                  "w4_ptr_epilogue", "w4_empty_last_rank", "w2_head_dim_64",
                                  "w1_packed_qkv_view"])
def test_interpreted_kernel_matches_reference(interp_results, case):
    r = interp_results[case]
    assert r["shape_ok"], r
    assert not r["nan"], f"unwritten (NaN-poisoned) or NaN output: {r}"
    # bf16/fp16 operands and P rounded to the input dtype before the second product, as on the GPU.
    assert r["rel_err"] < 1.5e-2, r


def test_virtual_rank_lengths_follow_torch_chunk(interp_results):
    assert interp_results["w4_straddling_tiles"]["lengths"] == [23, 23, 23, 21]
    assert interp_results["w4_empty_last_rank"]["lengths"] == [1, 1, 1, 0]



def test_descriptor_allocator_is_installed_in_each_thread():
    # Triton keeps the tensor-descriptor scratch allocator in a ContextVar: a thread that did not set it sees
    # the null allocator, and a GPU launch fails there. Server workers launch from their own threads, so
    # every launch installs it (xstage_dit/ops/triton_alloc.py); the GPU test launches from a fresh thread.
    import threading

    from triton.runtime import _allocation

    from xstage_dit.ops.triton_alloc import _scratch, install_descriptor_allocator

    install_descriptor_allocator()
    assert _allocation._allocator.get() is _scratch
    seen = []

    def work():
        seen.append(_allocation._allocator.get() is _scratch)  # a fresh thread starts without it
        install_descriptor_allocator()
        seen.append(_allocation._allocator.get() is _scratch)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [False, True]
