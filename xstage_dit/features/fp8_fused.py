"""Row-wise FP8's activation quantization fused with the tanh-GELU and concatenation in front of it.

torchao's row-wise linear layer quantizes its input itself: under torch.compile Inductor makes that an amax kernel and
a cast kernel, each recomputing the GELU that precedes it. At FLUX's widest rows (the single block's ``proj_out``
input, ``cat([attn_out, gelu(proj_mlp(x))])``: 4,608 x 15,360) the two took 257 us where one pass at memory speed
takes ~75 us, ~7 ms of a 101 ms FP8 step (fp8/NOTES.md, twenty-fourth session). Here `ops.fp8_rows` reads the
GELU's input (and the concatenation's other part) once and writes the e4m3 rows and their scales, and the layer's
own float8 weight multiplies them in ``torch._scaled_mm``, as torchao's layer would.

Where (`fuse_rows`), for layers FP8 made row-wise (`row_wise_fp8`):

- every diffusers ``FeedForward`` of ``GELU(approximate="tanh")``, no-op dropout, linear: FLUX's double blocks,
  Wan's and Qwen-Image's blocks. ``forward`` becomes proj -> fused quantization -> the last linear's FP8 GEMM.
- FLUX's ``FluxSingleTransformerBlock``: its forward (diffusers 0.42.1's, `_flux_single_forward`) with
  ``proj_out(cat([attn, act_mlp(mlp)]))`` as one fused quantization and GEMM.

The quantization is ``approx=True`` on a GPU (the hardware tanh, a reciprocal product: one e4m3 step off torchao's
bytes in 0.02-0.16 % of them, where Inductor's own fusion of torchao's layer, keeping the GELU in fp32, moves ~1.6 %);
on a CPU the reference, torchao's bytes exactly (tests/features/test_fp8_fused.py compares the fused forwards
with the unfused ones bit for bit there).
"""

from __future__ import annotations

import types
from typing import Callable

import torch

from xstage_dit._torch_private import scaled_mm
from xstage_dit.features.fp8_few_rows import bias_apart
from xstage_dit.features.instance_attr import set_on_instance
from xstage_dit.ops.fp8_rows import MAX_ROW_WIDTH, quantize_rows

__all__ = ["fuse_rows", "fused_linear", "row_wise_fp8"]


def row_wise_fp8(layer: torch.nn.Module) -> bool:
    """Whether `layer` is an nn.Linear whose weight is torchao's row-wise dynamic float8 (e4m3, per-row activation
    scales, no upper bound): the layer whose input quantization `fused_linear` reproduces."""
    if not isinstance(layer, torch.nn.Linear):
        return False
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    weight = layer.weight
    kwargs = getattr(weight, "act_quant_kwargs", None)
    return (isinstance(weight, Float8Tensor) and kwargs is not None and isinstance(kwargs.granularity, PerRow)
            and kwargs.float8_dtype == torch.float8_e4m3fn and kwargs.hp_value_ub is None
            and tuple(weight.scale.shape) == (weight.shape[0], 1) and layer.in_features <= MAX_ROW_WIDTH)


def fused_linear(layer: torch.nn.Linear, a: torch.Tensor | None, b: torch.Tensor | None, gelu_b: bool
                 ) -> torch.Tensor:
    """``layer(cat([a, gelu_tanh(b) if gelu_b else b], -1))`` for a `row_wise_fp8` layer, its input quantized in one
    pass. a: (..., Ka), b: (..., Kb) of one dtype (either None), Ka + Kb = layer.in_features -> (..., out_features)
    in that dtype."""
    first = a if a is not None else b
    lead = first.shape[:-1]
    weight = layer.weight
    floor = weight.act_quant_kwargs.hp_value_lb
    q, scale = quantize_rows(_rows(a), _rows(b), gelu_b, approx=first.is_cuda, amax_floor=floor or 0.0)
    apart = bias_apart(layer, q.shape[0])  # cuBLASLt refuses some biased GEMMs of few rows (`fp8_few_rows`)
    out = scaled_mm(q, weight.qdata.t(), scale, weight.scale.t(), bias=None if apart else layer.bias,
                    out_dtype=first.dtype, use_fast_accum=weight.mm_config.use_fast_accum)
    if apart:
        out = out + layer.bias
    return out.reshape(*lead, out.shape[-1])


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """t (..., K) as (M, K) rows the kernel reads: a row stride of their own, but columns one after another."""
    if t is None:
        return None
    t = t.reshape(-1, t.shape[-1])
    return t if t.shape[-1] < 2 or t.stride(-1) == 1 else t.contiguous()


def _feed_forward_forward(ff: torch.nn.Module) -> Callable:
    proj, out = ff.net[0].proj, ff.net[2]

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return fused_linear(out, None, proj(hidden_states), gelu_b=True)

    return forward


def _fusable_feed_forward(module: torch.nn.Module) -> bool:
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    net = list(module.net) if type(module) is FeedForward else []
    if len(net) not in (3, 4):
        return False
    dropouts = [net[1], *net[3:]]  # FeedForward: act, dropout, linear[, final dropout]; all no-ops to be skipped
    return (type(net[0]) is GELU and net[0].approximate == "tanh" and row_wise_fp8(net[2])
            and all(type(d) is torch.nn.Dropout and d.p == 0 for d in dropouts))


def _flux_single_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         temb: torch.Tensor, image_rotary_emb=None, joint_attention_kwargs=None):
    """diffusers 0.42.1's ``FluxSingleTransformerBlock.forward``, its ``proj_out(cat([attn, act_mlp(mlp)]))`` one
    `fused_linear`. hidden_states (B, S_img, D), encoder_hidden_states (B, S_txt, D) -> the same two, updated."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.proj_mlp(norm_hidden_states)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                            **joint_attention_kwargs)

    gate = gate.unsqueeze(1)
    hidden_states = gate * fused_linear(self.proj_out, attn_output, mlp_hidden_states, gelu_b=True)
    hidden_states = residual + hidden_states
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)

    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


def _fusable_flux_single(module: torch.nn.Module) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    act = getattr(module, "act_mlp", None)
    return (type(module) is FluxSingleTransformerBlock and type(act) is torch.nn.GELU and act.approximate == "tanh"
            and row_wise_fp8(module.proj_out))


def fuse_rows(transformer: torch.nn.Module) -> tuple[list[str], Callable[[], None]]:
    """Every fusable module of `transformer` (module docstring) given its fused forward on the instance -> (their
    paths, the undo that puts their own forwards back)."""
    paths, undos = [], []
    for path, module in transformer.named_modules():
        if _fusable_feed_forward(module):
            forward = _feed_forward_forward(module)
        elif _fusable_flux_single(module):
            forward = types.MethodType(_flux_single_forward, module)
        else:
            continue
        undos.append(set_on_instance(module, "forward", forward))
        paths.append(path)

    def undo() -> None:
        for one in reversed(undos):
            one()

    return paths, undo
