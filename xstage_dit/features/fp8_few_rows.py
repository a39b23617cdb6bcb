"""Row-wise FP8 layers with a bias, called on few rows: the bias added after the GEMM instead of in it.

torch's row-wise FP8 GEMM (``torch._scaled_mm``, cuBLASLt) finds no algorithm ("CUBLAS_STATUS_NOT_SUPPORTED") for
a layer with a bias and a long contraction when it sees few rows. `bench_fp8_error.py probe-rows` on an H100
(torch 2.11, fp8/NOTES.md) found, for every such layer of the FP8 models: 8192 -> 2048 runs from 64 rows, 12288 or
15360 -> 3072 from 43, 13824 -> 5120 from 26; and each ran at 16 rows without its bias. Few rows are ordinary in
serving: FLUX's feed-forward at a 64 x 64 request sees 16 image tokens, Wan's at a small one as few, a timestep
embedder one row a sample. Every biased shape with at most `LONGEST_RUNNING` input features ran at one row. So
each biased row-wise FP8 layer with more input features than that takes inputs of under `FEW_ROWS` rows as
``linear(x, w, None) + bias``: the product a GEMM without the bias epilogue runs, the bias one add after it
(``FEW_ROWS`` is 4x the largest threshold measured: shapes not probed may need more, and a few-row GEMM costs
microseconds either way). Other inputs run as torchao made the layer, bias in the epilogue: under torch.compile the
row count is static, so a compiled graph of many rows is the one it was before, and so are the shorter layers.

How: such a layer is marked (``fp8_bias_apart``) and its class swapped to `Fp8FewRowsLinear`, whose forward is
`linear`; `fp8_fused.fused_linear` and batch invariance's linear rule read the same mark (`bias_apart`). A class, not
an instance ``forward``: batch invariance swaps the class of plain Linear layers (this one's too) and leaves any
layer with a ``forward`` of its own out of its rule.

    count, undo = add_bias_apart_on_few_rows(layers)   # layers: the row-wise FP8 nn.Linear modules
    ...
    undo()                                             # their classes back, unmarked
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F

__all__ = ["FEW_ROWS", "LONGEST_RUNNING", "Fp8FewRowsLinear", "add_bias_apart_on_few_rows", "bias_apart", "linear"]

FEW_ROWS = 256
LONGEST_RUNNING = 5120  # the most input features of a biased layer measured to run at one row (Wan's 5120 -> *)
MARK = "fp8_bias_apart"


def bias_apart(layer: torch.nn.Module, rows: int) -> bool:
    """Whether `layer`'s row-wise FP8 GEMM on `rows` rows adds the bias after itself rather than in its epilogue:
    a layer `add_bias_apart_on_few_rows` marked, under `FEW_ROWS` rows."""
    return rows < FEW_ROWS and getattr(layer, MARK, False)


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, layer.weight, layer.bias)``, the bias added after the GEMM where `bias_apart` says so.
    x (..., in_features) -> (..., out_features)."""
    if bias_apart(layer, x.numel() // max(x.shape[-1], 1)):
        return F.linear(x, layer.weight, None) + layer.bias
    return F.linear(x, layer.weight, layer.bias)


class Fp8FewRowsLinear(torch.nn.Linear):
    """A marked row-wise FP8 Linear layer, run by `linear` (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def _takes_it(layer: torch.nn.Module) -> bool:
    return (type(layer) is torch.nn.Linear and "forward" not in vars(layer) and layer.bias is not None
            and layer.in_features > LONGEST_RUNNING)


def _unmark(layer: torch.nn.Linear) -> None:
    if type(layer) is Fp8FewRowsLinear:  # another feature's class swapped over it puts ours back on its restore
        layer.__class__ = torch.nn.Linear
    vars(layer).pop(MARK, None)


def add_bias_apart_on_few_rows(layers: Iterable[torch.nn.Linear]) -> tuple[int, Callable[[], None]]:
    """Mark each plain nn.Linear of `layers` with a bias and over `LONGEST_RUNNING` input features and give it the
    `Fp8FewRowsLinear` class -> (how many, the undo)."""
    taken = [layer for layer in layers if _takes_it(layer)]
    for layer in taken:
        setattr(layer, MARK, True)
        layer.__class__ = Fp8FewRowsLinear

    def undo() -> None:
        for layer in taken:
            _unmark(layer)

    return len(taken), undo
