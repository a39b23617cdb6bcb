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

    count, undo = add_bias_apart_on_few_rows(layers)   # layers: the row-wise FP8 nn.Linear modules
    ...
    undo()                                             # their own forwards back
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from xstage_dit.features.instance_attr import set_on_instance

__all__ = ["FEW_ROWS", "LONGEST_RUNNING", "add_bias_apart_on_few_rows", "bias_apart"]

FEW_ROWS = 256
LONGEST_RUNNING = 5120  # the most input features of a biased layer measured to run at one row (Wan's 5120 -> *)


def _long(layer: torch.nn.Linear) -> bool:
    return layer.bias is not None and layer.in_features > LONGEST_RUNNING


def bias_apart(layer: torch.nn.Linear, rows: int) -> bool:
    """Whether `layer`'s row-wise FP8 GEMM on `rows` rows adds the bias after itself rather than in its epilogue."""
    return rows < FEW_ROWS and _long(layer)


def _forward(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    own = layer.forward  # what ran before (the class's, or a wrapper of the instance's own): many rows still go there

    def forward(x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features), as ``nn.Linear.forward``."""
        if bias_apart(layer, x.numel() // max(x.shape[-1], 1)):
            return F.linear(x, layer.weight, None) + layer.bias
        return own(x)

    return forward


def add_bias_apart_on_few_rows(layers: Iterable[torch.nn.Linear]) -> tuple[int, Callable[[], None]]:
    """Give each of `layers` with a bias and over `LONGEST_RUNNING` input features the few-rows forward (module
    docstring) -> (how many, the undo)."""
    undos = [set_on_instance(layer, "forward", _forward(layer)) for layer in layers if _long(layer)]

    def undo() -> None:
        for one in reversed(undos):
            one()

    return len(undos), undo
