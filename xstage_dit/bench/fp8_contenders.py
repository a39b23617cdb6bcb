"""The FP8 contenders of the end-to-end benchmark (issue 41): the peers' FP8 path on plain diffusers
(`PlainDiffusersFp8`, its recipe `peer_fp8`) and the xstage stack with FP8 linear layers, with FP8 attention too,
bare and served."""

from __future__ import annotations

import torch

from xstage_dit.bench.contenders import PlainDiffusers, XStage, XStageServed, fp8_refusal
from xstage_dit.bench.session import Bench


class PlainDiffusersFp8(PlainDiffusers):
    """The FP8 path diffusers users run: torchao's float8 row-wise dynamic quantization of every linear layer of
    the transformer (`peer_fp8`: ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` with the amax
    floor that keeps a zero row finite), then the bench's compile as for plain diffusers. Restore copies the bf16
    weights back (kept on the CPU)."""

    family = "diffusers-fp8"

    def __init__(self, compile: bool):
        super().__init__(compile)
        self._undo = None

    def check(self, b: Bench) -> str | None:
        return fp8_refusal(b)

    def apply(self, b: Bench) -> None:
        kept = peer_refused_layers(b.pipe.transformer)
        if kept:
            self.info["fp8_kept_bf16"] = kept
        self._undo = peer_fp8(b.pipe.transformer)
        super().apply(b)

    def restore(self, b: Bench) -> None:
        super().restore(b)
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def peer_fp8(transformer: torch.nn.Module):
    """The peers' FP8 recipe on `transformer`: torchao's float8 row-wise dynamic quantization of every linear layer
    torch's row-wise FP8 GEMM takes (all but `peer_refused_layers`) (``quantize_(transformer,
    Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=2**-15))``), torchao's defaults as users run them but for the one knob a user must set: they
    also turn on Inductor's coordinate-descent tuning for the process, so the peer's compiled kernels are tuned at
    their first launch. The knob, torchao's own floor on a dynamic scale's amax (the one our FP8 feature sets,
    `features.fp8.ACTIVATION_AMAX_FLOOR`): without it a row of zeros quantizes to 0/0, and Wan's zero-padded text
    rows made every latent NaN, which also ran 13.6 % faster on the H100 (NaN operands draw less power:
    fp8/NOTES.md). Returns the undo, which puts the bf16 weights back (kept on the CPU meanwhile) and the Inductor
    config as it was (rows measured later compile as they would alone)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    from xstage_dit._torch_private import inductor_config_restorer
    from xstage_dit.features.fp8 import ACTIVATION_AMAX_FLOOR

    refused = peer_refused_layers(transformer)
    linears = [m for path, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and path not in refused]
    weights = [(m, m.weight.device, m.weight.detach().to("cpu", copy=True)) for m in linears]
    wanted = {id(m) for m in linears}
    restore_inductor_config = inductor_config_restorer()
    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                                     activation_value_lb=ACTIVATION_AMAX_FLOOR),
              filter_fn=lambda module, _fqn: id(module) in wanted)

    def undo() -> None:
        for module, device, weight in weights:
            module.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
        restore_inductor_config()

    return undo


def peer_refused_layers(transformer: torch.nn.Module) -> list[str]:
    """The linear layers of `transformer` the peers' recipe leaves in bf16: those torch's row-wise FP8 GEMM refuses
    (`features.fp8.row_refused_layers`, which our feature keeps too). Without them NucleusMoE's peer row does not run
    at all; a user of the recipe must leave them out the same way."""
    from xstage_dit.features.fp8 import row_refused_layers

    return list(row_refused_layers(transformer))


class XStageFp8(XStage):
    """``xstage-calibrated`` with the transformer's linear layers in float8 (``EngineConfig(quantize="fp8")``,
    row-wise: `xstage_dit.features.fp8`)."""

    quantize = "fp8"

    def __init__(self, compile: bool):
        super().__init__(compile, "auto")
        self.family = "xstage-fp8"


class XStageFp8Served(XStageServed):
    """``xstage-served`` with FP8 linear layers: what ``xstage-dit serve --quantize fp8`` answers."""

    quantize = "fp8"

    def __init__(self, compile: bool, serve=None):
        super().__init__(compile, serve)
        self.family = "xstage-fp8-served"


class XStageFp8Attention(XStageFp8):
    """``xstage-fp8`` with FP8 attention too (``EngineConfig(fp8_attention="auto")``: the 8-bit attention kernels
    join the kernel sweep and run where they measured faster than the 16-bit ones)."""

    fp8_attention = "auto"

    def __init__(self, compile: bool):
        super().__init__(compile)
        self.family = "xstage-fp8-attn"


class XStageFp8AttentionServed(XStageFp8Served):
    """``xstage-fp8-served`` with FP8 attention too: what ``xstage-dit serve --quantize fp8 --fp8-attention auto``
    answers."""

    fp8_attention = "auto"

    def __init__(self, compile: bool, serve=None):
        super().__init__(compile, serve)
        self.family = "xstage-fp8-attn-served"
