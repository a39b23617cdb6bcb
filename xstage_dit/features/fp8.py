"""FP8 linear layers in the denoising transformer, through torchao (the stack's ``fp8`` feature).

    stack = build_stack(pipe, StackConfig(fp8=Fp8Config("row")))   # or EngineConfig(quantize="fp8")
    pipe(prompt)                                                     # the transformer's GEMMs in float8
    stack.restore()                                                  # the original bf16 weights, bit for bit

Why torchao: it is what users of diffusers run for FP8 today (``quantize_`` with
``Float8DynamicActivationFloat8WeightConfig``), its tensor subclass composes with ``torch.compile`` (the
activation's scale and cast fuse into the neighbouring kernels) and with our hooks (a hook sees an ``nn.Linear``
whose weight is a ``Float8Tensor``; ``F.linear`` dispatches to ``torch._scaled_mm``).

Granularity (`GRANULARITIES`):

- ``row``: activations scaled per row (token), weights per output channel, both dynamic float8 e4m3, the
  scaled GEMM on Hopper's FP8 tensor cores. What the peers ship.
- ``tensor``: one scale per activation tensor and one per weight: fewer scales, coarser.
- ``block``: activations scaled per 1 x 128 block of each token, weights per 128 x 128 block (the DeepSeek-V3
  recipe; torchao's Triton block-scaled GEMM): finer than row-wise along the contraction; layers whose features
  are not multiples of 128 stay in their dtype.
- ``weight``: weights stored in float8 (per channel), upcast for a bf16 GEMM: half the weight memory, no FP8
  GEMM (the only mode that runs on a CPU; the tests use it to check apply and restore there).

Which layers: every ``nn.Linear`` of each transformer, except those the family record names in
``FeatureFacts.fp8_skip`` (module-path patterns, e.g. the final projection) and those whose shapes the FP8
GEMM cannot take (input or output features not a multiple of 16; of 128 block-wise; row-wise, the layers
``FeatureFacts.fp8_row_refused`` names, where cuBLASLt finds no algorithm). Row-wise, a biased layer with a long
contraction adds its bias after the GEMM on inputs of few rows, where cuBLASLt refuses the bias epilogue
(`features.fp8_few_rows`). MoE expert weights stored
as 3-D tensors (grouped GEMMs: NucleusMoE) run on torch's grouped FP8 GEMM where the family record names their class
(``FeatureFacts.fp8_expert_classes``, `features.fp8_experts`; Hopper and newer, granularities other than "weight",
row-wise either way); HiDream's experts are nn.Linear modules and convert as linear layers.

Restore: the original weights are kept on the CPU while FP8 is on (the GPU holds only the float8 copy) and
copied back on restore, so the pipeline returns bit-identical and the GPU memory to what it was.

Attention (``Fp8Config.attention``, off by default): "auto" makes the 8-bit attention kernels
(``xstage_dit.ops.attention.fp8_kernels``: cuDNN's FP8 SDPA on e4m3 q, k, v with per-tensor scales computed on
the fly; SageAttention's int8 Q K^T) candidates of the attention kernel sweep, chosen per shape where measured
faster than the 16-bit kernels; a kernel's name forces it wherever it takes the shape. It needs the attention
kernel choice (the parallel features with schedule "auto": the engine's default); its error against the fp32
reference is ``benchmarks/bench_fp8_error.py --attention``'s table.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch

from xstage_dit.families.registry import record_for_transformer
from xstage_dit.features.fp8_few_rows import FEW_ROWS, add_bias_apart_on_few_rows
from xstage_dit.features.fp8_fused import fuse_rows
from xstage_dit.schedule.attention_kernel import FP8_ATTENTION

__all__ = ["ACTIVATION_AMAX_FLOOR", "FP8_ATTENTION", "GRANULARITIES", "Fp8Config", "Fp8Handle", "apply", "fp8_layers",
           "refuse_fp8_with_lora", "require_fp8_device", "row_refused_layers"]

GRANULARITIES = ("row", "tensor", "block", "weight")
_BLOCK = 128  # block-wise: 1 x 128 activation blocks, 128 x 128 weight blocks
_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) onwards
# The least amax a dynamic activation scale is computed from (torchao's activation_value_lb). Without one a row of
# zeros gets scale 0 and quantizes to NaN (0 / 0): Wan pads its text embeddings to 512 tokens with zeros, and its
# cross-attention's key / value projections turned every latent NaN (tiny Wan, CPU and H100, 2026-12-07). 2**-15 is
# exact in bf16 and fp16 and its scale (2**-15 / 448) is nonzero in both; only rows whose every |x| < 3e-5 move.
ACTIVATION_AMAX_FLOOR = 2.0 ** -15


@dataclass(frozen=True)
class Fp8Config:
    """granularity: one of `GRANULARITIES` ("row": per-token activations x per-channel weights, dynamic).
    keep: where the original weights wait for restore ("cpu": off the GPU; "device": where they were, for a
    restore without copies at the cost of keeping both).
    attention: one of `FP8_ATTENTION`: "off" (16-bit attention kernels only), "auto" (the 8-bit kernels join the
    attention kernel sweep) or an 8-bit kernel's name ("cudnn-fp8", "sage": that kernel wherever it takes the shape).
    fuse_rows: row-wise only: the tanh-GELU feed-forwards and FLUX's single blocks quantize their widest activations
    in one pass (`features.fp8_fused`); False: torchao's layers quantize every input themselves (for measuring).
    experts: the grouped-GEMM experts the family record names (``FeatureFacts.fp8_expert_classes``) run the grouped
    FP8 GEMM too; False: they stay in their dtype (for measuring what they add: NucleusMoE's grouped FP8 GEMM was
    only 1.19x bf16's on an H100, fp8/NOTES.md).
    """

    granularity: str = "row"
    keep: str = "cpu"
    attention: str = "off"
    fuse_rows: bool = True
    experts: bool = True

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"expected fp8 granularity in {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.attention not in FP8_ATTENTION:
            raise ValueError(f"expected fp8 attention in {', '.join(FP8_ATTENTION)}, got {self.attention!r}")
        if self.keep not in ("cpu", "device"):
            raise ValueError(f"expected fp8 keep 'cpu' or 'device', got {self.keep!r}")
        for name in ("fuse_rows", "experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected fp8 {name} True or False, got {getattr(self, name)!r}")

    def torchao_config(self):
        """The torchao config of this granularity (torchao imported here: only FP8 runs need it)."""
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerBlock,
                                          PerRow, PerTensor)

        # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for the whole
        # process and never back; every kernel compiled after it (any model's, the VAE's) is then tuned at its
        # first launch: 110-130 s per new set of kernels on an H100 and a 417 s server start (fp8/NOTES.md), for
        # ~1 % of step time in bf16. Tuning stays a compile option, scoped to the graphs that ask for it.
        if self.granularity == "weight":
            return Float8WeightOnlyConfig(set_inductor_config=False)
        granularity = {"row": PerRow(), "tensor": PerTensor(),
                       "block": [PerBlock([1, _BLOCK]), PerBlock([_BLOCK, _BLOCK])]}[self.granularity]
        floor = None if self.granularity == "block" else ACTIVATION_AMAX_FLOOR  # block-wise: not measured with one
        return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False,
                                                         activation_value_lb=floor)


def require_fp8_device(device: torch.device, granularity: str) -> None:
    """ValueError naming `device` where an FP8 GEMM cannot run (a CPU, a GPU before compute capability 8.9);
    weight-only FP8 runs anywhere."""
    if granularity == "weight":
        return
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"FP8 {granularity}-wise GEMMs need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper "
                         f"or newer), got device {device}; fp8 granularity 'weight' runs anywhere")
    capability = torch.cuda.get_device_capability(device)
    if capability < _MIN_CAPABILITY:
        raise ValueError(f"FP8 {granularity}-wise GEMMs need compute capability >= 8.9, got "
                         f"{torch.cuda.get_device_name(device)} (sm{capability[0]}{capability[1]}) on {device}")


def refuse_fp8_with_lora(quantize: str, lora: bool) -> None:
    """ValueError where FP8 (`quantize` "fp8") meets LoRA adapters (`lora`): PEFT's LoRA layers wrap the base
    nn.Linear and read its weight, and on torchao's Float8Tensor weights that path is neither tested here nor
    measured, so the combination is refused rather than guessed. `EngineConfig` checks it, and the CLI before any
    rank starts."""
    if quantize == "fp8" and lora:
        raise ValueError("expected quantize 'none' with LoRA adapters (lora_dir / preload_loras): LoRA on FP8 "
                         "linear layers is not supported, got quantize 'fp8'")


def row_refused_layers(transformer: torch.nn.Module) -> dict[str, str]:
    """Path -> the family record's ``fp8_row_refused`` pattern it matches, for each linear layer of `transformer`
    torch's row-wise FP8 GEMM refuses: what row-wise FP8 keeps in its dtype here and in the benchmark's peer
    recipe (`bench.fp8_contenders.peer_fp8`)."""
    record = record_for_transformer(transformer)
    patterns = record.facts.fp8_row_refused if record is not None else ()
    out = {}
    for path, module in transformer.named_modules():
        pattern = next((p for p in patterns if fnmatch.fnmatchcase(path, p)), None)
        if isinstance(module, torch.nn.Linear) and pattern is not None:
            out[path] = pattern
    return out


def fp8_layers(transformer: torch.nn.Module, granularity: str = "row"
               ) -> tuple[list[tuple[str, torch.nn.Linear]], list[tuple[str, str]]]:
    """The (path, layer) pairs FP8 of `granularity` converts in `transformer`, and the (path, why) pairs it leaves
    in their dtype."""
    multiple = _BLOCK if granularity == "block" else 16
    record = record_for_transformer(transformer)
    skip = record.facts.fp8_skip if record is not None else ()
    refused = row_refused_layers(transformer) if granularity == "row" else {}
    chosen, kept = [], []
    for path, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        pattern = next((p for p in skip if fnmatch.fnmatchcase(path, p)), None)
        refusal = refused.get(path)
        if pattern is not None:
            kept.append((path, f"the family record's fp8_skip {pattern!r}"))
        elif refusal is not None:
            kept.append((path, f"torch's row-wise FP8 GEMM refuses it (the family record's fp8_row_refused "
                               f"{refusal!r})"))
        elif module.in_features % multiple or module.out_features % multiple:
            kept.append((path, f"{module.in_features} -> {module.out_features} features: not multiples of "
                               f"{multiple}"))
        else:
            chosen.append((path, module))
    return chosen, kept


class Fp8Handle:
    """The converted layers of one transformer and their original weights; ``restore()`` puts them back."""

    def __init__(self, transformer: torch.nn.Module, config: Fp8Config):
        self.transformer = transformer
        self.config = config
        chosen, self.kept = fp8_layers(transformer, config.granularity)
        self.paths = [path for path, _ in chosen]
        self._originals: list[tuple[torch.nn.Linear, torch.nn.Parameter | torch.Tensor, torch.device, bool]] = []
        for _, layer in chosen:
            weight = layer.weight
            saved = weight if config.keep == "device" else weight.detach().to("cpu", copy=True)
            self._originals.append((layer, saved, weight.device, weight.requires_grad))
        wanted = {id(layer) for _, layer in chosen}
        from torchao.quantization import quantize_

        from xstage_dit.features.fp8_experts import Fp8ExpertsHandle, expert_modules

        self.experts, self.fused, self._unfuse, self.bias_apart, self._join_bias = None, [], None, 0, None
        try:
            quantize_(transformer, config.torchao_config(), filter_fn=lambda module, _fqn: id(module) in wanted)
            if config.granularity != "weight" and config.experts and expert_modules(transformer):
                self.experts = Fp8ExpertsHandle(transformer, config.keep)
            if config.granularity == "row":
                self.bias_apart, self._join_bias = add_bias_apart_on_few_rows(layer for _, layer in chosen)
            if config.granularity == "row" and config.fuse_rows:
                self.fused, self._unfuse = fuse_rows(transformer)
        except Exception:
            self.restore()  # a layer converted before the failure goes back too
            raise

    def restore(self) -> None:
        unfuse, self._unfuse, self.fused = getattr(self, "_unfuse", None), None, []
        if unfuse is not None:
            unfuse()
        join_bias, self._join_bias, self.bias_apart = getattr(self, "_join_bias", None), None, 0
        if join_bias is not None:
            join_bias()
        experts, self.experts = getattr(self, "experts", None), None
        if experts is not None:
            experts.restore()
        originals, self._originals = self._originals, []
        for layer, saved, device, requires_grad in originals:
            if isinstance(saved, torch.nn.Parameter):
                layer.weight = saved
            else:
                layer.weight = torch.nn.Parameter(saved.to(device), requires_grad=requires_grad)

    def describe(self) -> dict:
        out = {"granularity": self.config.granularity, "layers": len(self.paths), "kept": len(self.kept)}
        if self.config.granularity == "row":
            out["fused_row_quantization"] = len(self.fused)
            out["bias_apart_under_rows"] = {"layers": self.bias_apart, "rows": FEW_ROWS}
        if self.experts is not None:
            out.update(self.experts.describe())
        return out


def _use_fp8_attention(config: Fp8Config, ctx) -> Callable[[], None] | None:
    """The 8-bit attention kernels made candidates of the attention kernel choice the stack built first
    (``ctx.attention_kernels``); ValueError naming what is missing where there is none to extend."""
    if config.attention == "off":
        return None
    chooser = ctx.attention_kernels
    if chooser is None:
        schedule = None if ctx.parallel is None else ctx.parallel.schedule
        raise ValueError(f"fp8 attention {config.attention!r} is a candidate of the attention kernel choice: expected "
                         f"the parallel features with schedule 'auto', got "
                         f"{'no parallel features' if schedule is None else f'schedule {schedule!r}'}")
    for transformer in ctx.transformers:
        device = next(transformer.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"fp8 attention {config.attention!r} runs 8-bit attention kernels on a CUDA GPU, got "
                             f"device {device}")
    return chooser.use_fp8_attention(config.attention)


def apply(pipe, config: Fp8Config | None, ctx) -> Callable[[], None] | None:
    """The stack's FP8 feature: every transformer's eligible linear layers in float8 (`fp8_layers`); ctx.fp8 holds
    the handles (what `describe` reports); with ``config.attention`` on, the 8-bit attention kernels become
    candidates of the attention kernel choice. ValueError naming the device where FP8 GEMMs cannot run, or what
    FP8 attention lacks."""
    if config is None:
        return None
    for transformer in ctx.transformers:
        require_fp8_device(next(transformer.parameters()).device, config.granularity)
    attention_undo = _use_fp8_attention(config, ctx)
    handles: list[Fp8Handle] = []
    try:
        for transformer in ctx.transformers:
            handles.append(Fp8Handle(transformer, config))
    except Exception:
        for handle in reversed(handles):
            handle.restore()
        if attention_undo is not None:
            attention_undo()
        raise
    ctx.fp8 = handles

    def undo() -> None:
        for handle in reversed(handles):
            handle.restore()
        if attention_undo is not None:
            attention_undo()
        ctx.fp8 = []

    return undo
