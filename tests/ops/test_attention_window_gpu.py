"""GPU checks of the peer window and of every kernel writing the post-attention All-to-All through it.

Marked `gpu` (`multigpu` for ranks on separate GPUs): skipped, and counted, without the hardware. A kernel
that refuses a case says why (the skip reason); FA4 and cuDNN-frontend cases skip visibly where the `gpu`
extra is not installed. Fresh random inputs, NaN-poisoned windows, fp32 reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.helpers.tolerances import rel_err

BF16_TOL = 2e-2

CASES = [
    # batch, seq_len, heads, head_dim, ranks, dtype (the families of test_ulysses_attention_gpu.py + heads 30)
    (2, 4608, 24, 128, 1, torch.bfloat16),   # FLUX 1024^2, CFG batch 2
    (2, 4608, 24, 128, 8, torch.bfloat16),
    (1, 32760, 4, 128, 4, torch.bfloat16),   # Wan 480p x 81 frames
    (1, 75600, 8, 128, 8, torch.bfloat16),   # Wan 720p x 81 frames
    (1, 4607, 6, 128, 4, torch.bfloat16),    # S not divisible by P
    (2, 1000, 5, 64, 2, torch.float16),      # H not divisible by P, head_dim 64
    (1, 333, 7, 64, 4, torch.bfloat16),      # both, short
    (1, 70, 8, 128, 8, torch.bfloat16),      # shards shorter than a tile
    (1, 336, 8, 128, 4, torch.bfloat16),
    (1, 512, 8, 64, 4, torch.float16),
    (1, 1000, 8, 128, 8, torch.bfloat16),
    (1, 4608, 30, 128, 4, torch.bfloat16),   # heads 30 at P = 4 and 8 (uneven head split)
    (2, 4607, 30, 128, 8, torch.bfloat16),
]
KERNELS = ["triton", "fa4", "fa4-m64", "fa4-split", "fa4-gqa", "fa4-gqa-unpacked", "cudnn"]


def _kernel_or_skip(name, geom, dtype):
    from xstage_dit.ops.attention.kernels import make_kernel

    kernel = make_kernel(name)
    reason = kernel.supports(geom, dtype, torch.device("cuda"), True)
    if reason:
        pytest.skip(f"{name} refuses: {reason}")
    return kernel


@pytest.mark.gpu
def test_local_window_maps_slots_uniformly():
    from xstage_dit.comm.peer_window import PeerWindow

    w = PeerWindow.local(4, 2, 3 << 20, torch.device("cuda"))
    assert w.slot_bytes % (2 << 20) == 0 and w.slot_bytes >= 3 << 20
    slots = {(s, o): w.slot_tensor(s, o, torch.float32, (1000,)) for s in range(2) for o in range(4)}
    for (s, o), t in slots.items():
        t.copy_(torch.arange(1000, device="cuda", dtype=torch.float32) + 1000 * (s * 4 + o))
    flat = w.view(torch.float32, (8, 1000), (w.slot_bytes // 4, 1))
    expect = torch.arange(8000, device="cuda", dtype=torch.float32).view(8, 1000)
    assert torch.equal(flat, expect)
    # A strided write through the window view is what the slot tensors hold.
    flat[:, 7] = -1.0
    assert all(float(t[7]) == -1.0 for t in slots.values())
    w.close()
    assert w.closed
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.view(torch.float32, (1,), (1,))


@pytest.mark.gpu
def test_window_finalizer_releases_the_mapping():
    import gc

    from xstage_dit.comm.peer_window import PeerWindow

    free0, _ = torch.cuda.mem_get_info()
    for _ in range(3):
        w = PeerWindow.local(8, 1, 256 << 20, torch.device("cuda"))
        del w
        gc.collect()
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 < 256 << 20, (free0, free1)  # 2 GiB a window: released each time


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("batch, seq_len, heads, head_dim, world, dtype", CASES)
def test_kernel_through_window_matches_reference(kernel_name, batch, seq_len, heads, head_dim, world, dtype):
    from xstage_dit.ops.attention.reference import attention_reference
    from xstage_dit.ops.attention.window import WindowGeometry
    from xstage_dit.ops.attention.window_path import window_attention_virtual_ranks

    length = -(-seq_len // world)
    probe = WindowGeometry(world, batch, seq_len, heads, head_dim, length * heads * head_dim)
    kernel = _kernel_or_skip(kernel_name, probe, dtype)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    run = window_attention_virtual_ranks(q, k, v, world_size=world, kernel=kernel)
    try:
        out = torch.cat(run.outs, dim=1)
        assert out.shape == q.shape
        assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
        assert rel_err(out, attention_reference(q, k, v)) < BF16_TOL
        geom = run.geom
        for b, o, first, end in geom.padding_rows():
            pad = run.window.slot_tensor(b, o, dtype, (length, heads, head_dim))[first:end]
            assert torch.isnan(pad).all(), f"{kernel_name} wrote padding rows of owner {o}"
    finally:
        run.window.close()


def _launch_window(kernel_name, world, seq_len, heads, batch, extra_env):
    from _ulysses_launch import launch

    worker = Path(__file__).with_name("_window_worker.py")
    return launch(worker, world, [kernel_name, str(batch), str(seq_len), str(heads), "128", "bfloat16"],
                  timeout_s=300, extra_env=extra_env)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("seq_len, heads, batch", [(4608, 8, 1), (999, 5, 2)])
def test_two_processes_sharing_the_gpu_through_a_real_window(kernel_name, seq_len, heads, batch):
    """Two ranks as two processes on one GPU, the window over their symmetric buffers (a real remap of
    the peer's allocation): equal to one process bit for bit, matches the reference, no NaN survives."""
    from xstage_dit.ops.attention.window import WindowGeometry

    _kernel_or_skip(kernel_name, WindowGeometry(2, batch, seq_len, heads, 128, -(-seq_len // 2) * heads * 128),
                    torch.bfloat16)
    results = _launch_window(kernel_name, 2, seq_len, heads, batch,
                             {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"})
    for r in results:
        for attempt in (0, 1):
            assert r[f"equal_to_single_process_{attempt}"], r
            assert r[f"rel_err_{attempt}"] < BF16_TOL, r
            assert not r[f"nan_{attempt}"], r
            assert r.get(f"padding_untouched_{attempt}", True), r


@pytest.mark.multigpu
@pytest.mark.parametrize("kernel_name", KERNELS)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_window_between_separate_gpus(kernel_name, world):
    """Ranks on separate GPUs: access set for this device on memory that lives on the peer."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    from xstage_dit.ops.attention.window import WindowGeometry

    _kernel_or_skip(kernel_name, WindowGeometry(world, 2, 4607, 24, 128, -(-4607 // world) * 24 * 128),
                    torch.bfloat16)
    results = _launch_window(kernel_name, world, 4607, 24, 2, {})
    for r in results:
        assert r["devices"] >= world
        for attempt in (0, 1):
            assert r[f"equal_to_single_process_{attempt}"] and not r[f"nan_{attempt}"], r
            assert r[f"rel_err_{attempt}"] < BF16_TOL, r


@pytest.mark.gpu
def test_kernel_sweep_chooses_a_kernel_that_takes_the_shape(tmp_path):
    """The machine's sweep (calibration.kernel_sweep) over the ops' timing closures, then the choice
    (schedule.attention_kernel): measured, cached, and a kernel that takes the shape."""
    from xstage_dit.calibration import kernel_sweep as ks
    from xstage_dit.ops.attention.kernels import refusals
    from xstage_dit.ops.attention.window import WindowGeometry
    from xstage_dit.ops.attention.window_path import sweep_cases
    from xstage_dit.schedule.attention_kernel import choose_attention_kernel, shape_family

    problems = [dict(batch=1, seq_len=4608, heads=24, head_dim=128, world_size=8, dtype=torch.bfloat16,
                     device="cuda"),
                dict(batch=2, seq_len=4607, heads=24, head_dim=128, world_size=4, dtype=torch.bfloat16,
                     device="cuda")]
    families = [shape_family(batch=p["batch"], seq_len=p["seq_len"], heads_local=p["heads"] // p["world_size"],
                             head_dim=128, world_size=p["world_size"], dtype_name="bfloat16") for p in problems]

    def time_fn(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    key = ks.sweep_key(torch.cuda.get_device_name(), {"torch": torch.__version__})
    sweep = ks.load_or_sweep(key, lambda missing: sweep_cases(problems), families, time_fn, cache_dir=tmp_path)
    assert sweep.source == "measured" and set(families) <= set(sweep.timings_ms)
    assert ks.load_or_sweep(key, lambda missing: pytest.fail("re-measured"), families, time_fn,
                            cache_dir=tmp_path).source == "cache"
    for prob, family in zip(problems, families):
        length = -(-prob["seq_len"] // prob["world_size"])
        geom = WindowGeometry(prob["world_size"], prob["batch"], prob["seq_len"], 24, 128, length * 24 * 128)
        answers = refusals(geom, torch.bfloat16, torch.device("cuda"), True)
        choice = choose_attention_kernel(sweep.timings_ms[family], answers)
        assert choice.name is not None and answers[choice.name] is None, choice
        assert sweep.timings_ms[family]["triton"] > 0
        assert sweep.timings_ms[family]["sdpa"] > 0  # the serial path's attention at the same heads: the reference


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_name", KERNELS)
def test_world1_public_op_runs_the_chosen_kernel(kernel_name):
    """A one-GPU user gets the chosen kernel (schedule "fused:<kernel>") on a plain output."""
    from xstage_dit.ops.attention import attention_reference, ulysses_attention
    from xstage_dit.ops.attention.window import WindowGeometry

    _kernel_or_skip(kernel_name, WindowGeometry(1, 2, 4608, 24, 128, 4608 * 24 * 128), torch.bfloat16)
    q, k, v = (torch.randn(2, 4608, 24, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = ulysses_attention(q, k, v, schedule=f"fused:{kernel_name}")
    assert out.shape == q.shape and not torch.isnan(out).any()
    assert rel_err(out, attention_reference(q, k, v)) < BF16_TOL
