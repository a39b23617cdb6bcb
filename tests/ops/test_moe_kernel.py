"""Tile schedules, the EP plan, and the Triton MoE kernels under TRITON_INTERPRET=1 with virtual
ranks (in a subprocess, so the interpreter flag is set before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xstage_dit.ops.moe import MoEKernelConfig, build_ep_plan, expert_mlp_combine
from xstage_dit.schedule.moe_tiles import L1_TILE, L2_TILE, TileSchedule, build_schedule, check_schedule, row_blocks

ROOT = Path(__file__).resolve().parents[2]

# world, experts, hidden, intermediate (tails on every tile dim), tokens per rank (uneven, one token),
# top-k, lead (0 = wave-by-wave), dtype.
INTERP_CASES = [
    {"world": 1, "E": 3, "H": 32, "I": 24, "tokens_per_rank": [37], "top_k": 2, "lead": 0, "seed": 3},
    {"world": 1, "E": 3, "H": 32, "I": 24, "tokens_per_rank": [37], "top_k": 2, "lead": 2, "seed": 3},
    {"world": 2, "E": 4, "H": 40, "I": 40, "tokens_per_rank": [13, 9], "top_k": 2, "lead": 0, "seed": 1},
    {"world": 2, "E": 4, "H": 40, "I": 40, "tokens_per_rank": [13, 9], "top_k": 2, "lead": 1, "seed": 1},
    {"world": 4, "E": 8, "H": 48, "I": 40, "tokens_per_rank": [13, 9, 1, 20], "top_k": 3, "lead": 1, "seed": 2,
     "dtype": "float32"},
    {"world": 4, "E": 8, "H": 48, "I": 40, "tokens_per_rank": [13, 9, 1, 20], "top_k": 3, "lead": 0, "seed": 2},
    # Static tile stride instead of the atomic ticket.
    {"world": 2, "E": 4, "H": 40, "I": 40, "tokens_per_rank": [13, 9], "top_k": 2, "lead": 2, "seed": 4, "ticket": False},
    # TMA tensor descriptors (use_desc): K tails in Linear-1 (H = 40) and Linear-2 (I = 24, 40), partial row
    # blocks, both schedules, fp32, static stride, and a block_k above the tails.
    {"world": 1, "E": 3, "H": 32, "I": 24, "tokens_per_rank": [37], "top_k": 2, "lead": 0, "seed": 3, "use_desc": True},
    {"world": 2, "E": 4, "H": 40, "I": 40, "tokens_per_rank": [13, 9], "top_k": 2, "lead": 1, "seed": 1,
     "use_desc": True},
    {"world": 4, "E": 8, "H": 48, "I": 40, "tokens_per_rank": [13, 9, 1, 20], "top_k": 3, "lead": 1, "seed": 2,
     "dtype": "float32", "use_desc": True},
    {"world": 2, "E": 4, "H": 40, "I": 40, "tokens_per_rank": [13, 9], "top_k": 2, "lead": 2, "seed": 4, "ticket": False,
     "use_desc": True, "block_k": 32},
    # Given expert layouts: empty experts (first, middle, last), one-row experts, partial blocks of 16.
    {"kind": "direct", "world": 2, "E": 6, "H": 40, "I": 24, "tokens_per_rank": [], "top_k": 0, "lead": 0, "seed": 6,
     "rows_per_expert": [0, 17, 1, 0, 33, 0], "use_desc": True},
    {"kind": "direct", "world": 2, "E": 6, "H": 40, "I": 24, "tokens_per_rank": [], "top_k": 0, "lead": 1, "seed": 6,
     "rows_per_expert": [0, 17, 1, 0, 33, 0], "use_desc": True},
    {"kind": "direct", "world": 2, "E": 6, "H": 40, "I": 24, "tokens_per_rank": [], "top_k": 0, "lead": 1, "seed": 6,
     "rows_per_expert": [0, 17, 1, 0, 33, 0]},
    {"kind": "direct", "world": 2, "E": 5, "H": 64, "I": 48, "tokens_per_rank": [], "top_k": 0, "lead": 2, "seed": 7,
     "rows_per_expert": [5, 0, 16, 31, 2], "use_desc": True, "block_k": 32, "dtype": "float32"},
]


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ops" / "moe_interp_worker.py"), json.dumps(INTERP_CASES)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS ") :])


@pytest.mark.parametrize("case", range(len(INTERP_CASES)))
def test_kernels_match_reference_under_interpreter(interp_results, case):
    res = interp_results[case]
    tol = 1e-5 if INTERP_CASES[case].get("dtype") == "float32" else 2e-3
    assert res["dispatch_max_abs"] == 0.0, res  # push dispatch is a copy: bit-exact
    assert res["unwritten_ranks"] == 0, res  # every slot of every virtual rank written (NaN-poisoned)
    assert res["combine_rel"] < tol, res
    assert res["reduce_rel"] < tol, res
    assert res["e2e_rel"] < 5 * tol, res
    assert res["leads"] == [INTERP_CASES[case]["lead"]] * INTERP_CASES[case]["world"]
    assert res.get("overwritten_ranks", 0) == 0, res  # nothing stored past the table's rows


def test_desc_operands_validated():
    from xstage_dit.ops.moe.fused import _check_desc_operands

    x = torch.zeros(8, 40, dtype=torch.float16)
    gu = torch.zeros(2, 40, 48, dtype=torch.float16)
    down = torch.zeros(2, 24, 40, dtype=torch.float16)
    _check_desc_operands(x, gu, down, torch.zeros(8, 24, dtype=torch.float16), 40, 24)
    with pytest.raises(ValueError, match="expected intermediate .* multiple of 16 bytes for use_desc, got 20 x 2 B"):
        _check_desc_operands(x, torch.zeros(2, 40, 40, dtype=torch.float16), torch.zeros(2, 20, 40, dtype=torch.float16),
                             torch.zeros(8, 32, dtype=torch.float16)[:, :20], 40, 20)  # fmt: skip
    with pytest.raises(ValueError, match="expected expert strides of gate_up / down"):
        _check_desc_operands(x, torch.zeros(40, 2, 48, dtype=torch.float16).transpose(0, 1), down,
                             torch.zeros(8, 24, dtype=torch.float16), 40, 24)  # fmt: skip



def test_use_desc_auto_falls_back_to_pointer_loads_and_true_insists(monkeypatch):
    from xstage_dit.ops.moe.fused import _resolve_use_desc

    x = torch.zeros(8, 40, dtype=torch.float16)
    gu, down = torch.zeros(2, 40, 48, dtype=torch.float16), torch.zeros(2, 24, 40, dtype=torch.float16)
    h = torch.zeros(8, 24, dtype=torch.float16)
    assert _resolve_use_desc(None, x, gu, down, h, 40, 24) is False  # CPU: no TMA
    assert _resolve_use_desc(False, x, gu, down, h, 40, 24) is False
    assert _resolve_use_desc(True, x, gu, down, h, 40, 24) is True  # operands meet the constraints
    bad_h = torch.zeros(8, 32, dtype=torch.float16)[:, :20]
    with pytest.raises(ValueError, match="multiple of 16 bytes for use_desc"):
        _resolve_use_desc(True, x, torch.zeros(2, 40, 40, dtype=torch.float16),
                          torch.zeros(2, 20, 40, dtype=torch.float16), bad_h, 40, 20)
    assert MoEKernelConfig().use_desc is None and MoEKernelConfig().num_stages is None
    with pytest.raises(ValueError, match="expected num_stages >= 1 or None, got 0"):
        MoEKernelConfig(num_stages=0)

def test_row_blocks_uneven_and_empty_experts():
    assert row_blocks([0, 5, 5, 21], 8) == [(0, 0, 5), (2, 5, 13), (2, 13, 21)]
    with pytest.raises(ValueError, match="non-decreasing"):
        row_blocks([0, 5, 3], 8)


@pytest.mark.parametrize("lead", [0, 1, 2, 3])
def test_schedules_are_complete_and_deadlock_free(lead):
    g = torch.Generator().manual_seed(lead)
    sizes = torch.randint(0, 300, (9,), generator=g).tolist()
    offsets = [0] + torch.tensor(sizes).cumsum(0).tolist()
    s = build_schedule(offsets, hidden=200, intermediate=150, block_m=64, block_n1=32, block_n2=64, lead=lead, num_programs=7)
    check_schedule(s)
    assert s.n1 == 5 and s.n2 == 4
    kinds = s.tiles[:, 0].tolist()
    if lead == 0:
        # Wave-by-wave: within each wave all Linear-1 tiles precede all Linear-2 tiles, no mixing.
        changes = sum(1 for a, b in zip(kinds, kinds[1:]) if a != b)
        num_waves = -(-s.num_blocks // s.wave_blocks)
        assert changes == 2 * num_waves - 1
    else:
        # Interleaved: Linear-1 tiles of later waves sit between Linear-2 tiles.
        first_l2 = kinds.index(L2_TILE)
        assert L1_TILE in kinds[first_l2:]


def _reference_order(expert_offsets, *, hidden, intermediate, block_m, block_n1, block_n2, lead, num_programs):
    """The schedule's definition written as loops (the module docstring), for the array version to match."""
    blocks = [(e, r, min(r + block_m, expert_offsets[e + 1])) for e in range(len(expert_offsets) - 1)
              for r in range(expert_offsets[e], expert_offsets[e + 1], block_m)]
    n1, n2 = -(-intermediate // block_n1), -(-hidden // block_n2)
    wb = max(1, -(-num_programs // n1))
    waves = [list(range(b, min(b + wb, len(blocks)))) for b in range(0, len(blocks), wb)]
    l1 = lambda w: [(L1_TILE, b, n) for b in waves[w] for n in range(n1)] if w < len(waves) else []  # noqa: E731
    l2 = lambda w: [(L2_TILE, b, n) for b in waves[w] for n in range(n2)]  # noqa: E731

    def merge(a2, a1):
        if not a2 or not a1:
            return a2 + a1
        out, j = [], 0
        for i, t in enumerate(a2):
            out.append(t)
            while j < (i + 1) * len(a1) // len(a2):
                out.append(a1[j])
                j += 1
        return out + a1[j:]

    if lead == 0:
        order = [t for w in range(len(waves)) for t in l1(w) + l2(w)]
    else:
        order = [t for w in range(min(lead, len(waves))) for t in l1(w)]
        order += [t for w in range(len(waves)) for t in merge(l2(w), l1(w + lead))]
    return blocks, order


@pytest.mark.parametrize("lead", [0, 1, 2, 5])
@pytest.mark.parametrize("seed", range(4))
def test_array_schedule_equals_the_loop_definition(lead, seed):
    g = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 40, (1,), generator=g))
    sizes = torch.randint(0, 400, (experts,), generator=g)
    sizes[torch.rand(experts, generator=g) < 0.2] = 0  # empty experts
    offsets = [0] + sizes.cumsum(0).tolist()
    shape = dict(hidden=int(torch.randint(16, 600, (1,), generator=g)),
                 intermediate=int(torch.randint(16, 600, (1,), generator=g)), block_m=[16, 64, 128][seed % 3],
                 block_n1=32, block_n2=64, lead=lead, num_programs=int(torch.randint(1, 140, (1,), generator=g)))
    s = build_schedule(offsets, **shape)
    blocks, order = _reference_order(offsets, **shape)
    assert [tuple(r) for r in s.blocks.tolist()] == blocks
    assert [tuple(r) for r in s.tiles.tolist()] == order
    check_schedule(s)


def test_schedule_of_a_nucleusmoe_layer_is_cheap_host_work():
    """Built on every MoE layer call (routing moves the offsets), behind a host sync: it must stay small."""
    g = torch.Generator().manual_seed(0)
    offsets = [0] + torch.randint(100, 400, (128,), generator=g).cumsum(0).tolist()
    best = min(_timed(lambda: build_schedule(offsets, hidden=2048, intermediate=1344, block_m=128, block_n1=128,
                                             block_n2=128, lead=2, num_programs=132)) for _ in range(5))
    assert best < 3e-3, f"expected the tile table of ~8.5K tiles in under 3 ms, took {best * 1e3:.1f} ms"


def _timed(fn):
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_check_schedule_rejects_bad_orders():
    s = build_schedule([0, 64], hidden=64, intermediate=64, block_m=64, block_n1=32, block_n2=64, lead=0,
                       num_programs=4)
    bad = TileSchedule(s.tiles.flip(0).contiguous(), s.blocks, s.n1, s.n2, 0, s.wave_blocks)
    with pytest.raises(ValueError, match="Linear-1 tiles of block 0 before"):
        check_schedule(bad)
    missing = TileSchedule(s.tiles[:-1], s.blocks, s.n1, s.n2, 0, s.wave_blocks)
    with pytest.raises(ValueError, match="expected 3 tiles"):
        check_schedule(missing)


def test_expert_mlp_combine_needs_a_lead_handed_down():
    """The op does not choose its tile order: without a lead (argument or config) it refuses, naming it."""
    x = torch.zeros(4, 16)
    args = (x, torch.zeros(1, 16, 32), torch.zeros(1, 16, 16), [0, 4], torch.ones(4), torch.zeros(4, dtype=torch.int32),
            torch.arange(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected a lead int >= 0 .*got None"):
        expert_mlp_combine(*args)
    with pytest.raises(ValueError, match="expected a lead int >= 0 .*got -1"):
        expert_mlp_combine(*args, lead=-1)


def test_plan_offsets_consistent_across_ranks():
    """Every rank derives the same offsets from the counts: what s pushes to d lands where d expects it."""
    g = torch.Generator().manual_seed(5)
    world, E, k = 4, 8, 3
    tokens = [7, 0, 12, 5]
    pairs = []
    for n in tokens:
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else torch.zeros(0, k, dtype=torch.long)
        pairs.append((torch.arange(n).repeat_interleave(k), idx.reshape(-1), torch.rand(n * k, generator=g)))
    counts = torch.stack([torch.bincount(p[1], minlength=E) for p in pairs])
    plans = [build_ep_plan(*pairs[r], counts, rank=r, num_tokens=tokens[r]) for r in range(world)]
    for s in range(world):
        ps = plans[s]
        for j in range(len(ps.send_token_idx)):
            d, row = int(ps.push_dest_rank[j]), int(ps.push_dest_row[j])
            pd = plans[d]
            assert int(pd.combine_dest_rank[row]) == s and int(pd.combine_dest_row[row]) == j
            e_local = int(ps.send_expert[j]) - d * (E // world)
            assert pd.expert_offsets[e_local] <= row < pd.expert_offsets[e_local + 1]
        assert ps.slot_offsets[-1] == len(ps.send_token_idx)


def test_kernel_config_validates():
    with pytest.raises(ValueError, match="expected block_n2 a power of two >= 16, got 96"):
        MoEKernelConfig(block_n2=96)


def test_combine_reduce_custom_op_opcheck():
    from xstage_dit.ops.moe.custom_ops import moe_combine_reduce_op

    g = torch.Generator().manual_seed(4)
    offs = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    slots = torch.tensor([4, 0, 3, 1, 2], dtype=torch.int32)
    buf = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    shared = torch.randn(3, 8, generator=g).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.xstage_dit.moe_combine_reduce, (buf, offs, slots, shared))
    out = moe_combine_reduce_op(buf, offs, slots, shared)
    want = shared.float().clone()
    want[0] += buf[4].float() + buf[0].float()
    want[2] += buf[3].float() + buf[1].float() + buf[2].float()
    assert torch.allclose(out.float(), want.to(torch.bfloat16).float())
