"""Interpreter cases of the one-pass row quantizer (`xstage_dit.ops.fp8_rows.kernel`), run in a subprocess with
TRITON_INTERPRET=1 on CPU tensors: each case's kernel output against `quantize_rows_reference`. Prints one JSON
object: case -> {"q_bytes_differing", "scale_differing", "q_shape", "scale_shape"}.

The flag comes from `tests.helpers.interp.run_interp_script`'s environment, never from this module: the test process
imports `CASES` from here, and a flag set at import would turn the interpreter on for every later Triton kernel of
that worker (CI, 2026-12-07: nine MoE and kernel-choice tests failed that way).
"""

from __future__ import annotations

import json

import torch

from xstage_dit.ops.fp8_rows.kernel import quantize_rows_triton
from xstage_dit.ops.fp8_rows.reference import quantize_rows_reference

CASES = {  # rows, Ka, Kb, gelu_b, dtype, how the values are drawn
    "m1_a17_b0": (1, 17, 0, False, torch.bfloat16, "randn"),
    "m3_a0_b33_gelu": (3, 0, 33, True, torch.bfloat16, "randn"),
    "m37_a24_b100_gelu": (37, 24, 100, True, torch.bfloat16, "randn"),
    "m5_a1_b1_gelu": (5, 1, 1, True, torch.bfloat16, "randn"),
    "m2_a0_b1_gelu_width1": (2, 0, 1, True, torch.bfloat16, "randn"),
    "m7_a48_b80_gelu_wide_values": (7, 48, 80, True, torch.bfloat16, "wide"),
    "m4_a64_b0_pow2": (4, 64, 0, False, torch.bfloat16, "randn"),
    "m6_a19_b45_nogelu": (6, 19, 45, False, torch.bfloat16, "wide"),
    "m9_a30_b70_gelu_fp16": (9, 30, 70, True, torch.float16, "randn"),
    "m3_a20_b0_fp16_tiny": (3, 20, 0, False, torch.float16, "tiny"),
    "m4_a10_b21_gelu_zero_rows": (4, 10, 21, True, torch.bfloat16, "zero_rows"),
    "m4_a10_b21_gelu_zero_rows_floor": (4, 10, 21, True, torch.bfloat16, "zero_rows"),  # amax floor 2**-15
    "m3_a20_b0_fp16_tiny_floor": (3, 20, 0, False, torch.float16, "tiny"),
    "m8_a40_b23_fp32_gelu": (8, 40, 23, True, torch.float32, "randn"),
    "m2_a300_b0_huge": (2, 300, 0, False, torch.bfloat16, "huge"),
}


def draw(rows: int, cols: int, dtype: torch.dtype, how: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=gen)
    if how == "wide":  # magnitudes over 2**-30 .. 2**30 within each row: e4m3's subnormals and saturation
        x = x * torch.exp2(torch.randint(-30, 30, (rows, cols), generator=gen).float())
    elif how == "tiny":  # fp16: subnormal inputs, scales among fp16's subnormals, a scale of 0 (a NaN row)
        x = x * torch.tensor([3e-5, 1e-4, 1e-8] * rows)[:rows, None]
    elif how == "huge":  # up to the dtype's largest finite value: x / scale over 448, saturated
        x = (x.clamp(-1, 1) * torch.finfo(dtype).max)
    elif how == "zero_rows":  # rows 0 and 2 all zeros (torchao: scale 0, NaN), -0.0 in row 1
        x[::2] = 0.0
        x[1, ::3] = -0.0
    return x.to(dtype)


def main() -> None:
    gen = torch.Generator().manual_seed(1234)
    out = {}
    for name, (rows, ka, kb, gelu_b, dtype, how) in CASES.items():
        a = draw(rows, ka, dtype, how, gen) if ka or name.startswith("m3_a0") else None
        b = draw(rows, kb, dtype, how, gen) if kb else None
        floor = 2.0 ** -15 if name.endswith("_floor") else 0.0
        q, scale = quantize_rows_triton(a, b, gelu_b, amax_floor=floor)
        q_ref, scale_ref = quantize_rows_reference(a, b, gelu_b, floor)
        out[name] = {
            "q_bytes_differing": int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()),
            "scale_differing": int((scale.view(torch.int32) != scale_ref.view(torch.int32)).sum()),
            "q_shape": list(q.shape), "scale_shape": list(scale.shape), "ref_shape": list(q_ref.shape),
            "q_contiguous": q.is_contiguous(),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
