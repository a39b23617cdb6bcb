"""FP8 for the routed experts that diffusers stores as 3-D tensors and runs as grouped GEMMs (the ``fp8`` feature's
second half; `features.fp8` converts the nn.Linear layers).

Which modules: those whose class the family record names in ``FeatureFacts.fp8_expert_classes`` (NucleusMoE's
``SwiGLUExperts``: ``gate_up_proj`` (E, hidden, 2 inter), ``down_proj`` (E, inter, hidden), grouped path
``_run_experts_grouped_mm(x, num_tokens_per_expert)``). HiDream's experts are nn.Linear modules: the linear half
converts them. MoE layers that expert parallelism swapped for xstage's EP layers (earlier in the stack) keep their
bf16 experts: their fused kernel is bf16.

How: each expert weight becomes e4m3 with a power-of-two scale per (expert, output column) and the module's grouped
path an instance attribute running `ops.moe.fp8_experts.fp8_swiglu_experts` (``torch._scaled_grouped_mm``, dynamic
per-row activation scales). The bf16 parameters wait on the CPU (or where they were, ``keep="device"``) and go back
on restore, bit for bit, with the grouped path that was there before (compile_fixes' or the class's).

Where it does not apply, the experts stay bf16 and the reason is kept (``Fp8ExpertsHandle.kept``): a GPU before
Hopper (the grouped FP8 GEMM is built for sm90+), the per-expert loop path (``use_grouped_mm=False``: its host
sync already rules out speed), dimensions not multiples of 16.
"""

from __future__ import annotations

import logging

import torch

from xstage_dit.families.registry import record_for_transformer

log = logging.getLogger(__name__)

__all__ = ["Fp8ExpertsHandle", "expert_modules"]

_GROUPED = "_run_experts_grouped_mm"


def expert_modules(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The (path, module) pairs of `transformer` whose class its family record names in ``fp8_expert_classes``."""
    record = record_for_transformer(transformer)
    classes = record.facts.fp8_expert_classes if record is not None else ()
    return [(path, m) for path, m in transformer.named_modules() if type(m).__name__ in classes]


def _refusal(module: torch.nn.Module) -> str | None:
    from xstage_dit.ops.moe.fp8_experts import grouped_fp8_unavailable

    if not getattr(module, "use_grouped_mm", False):
        return "the per-expert loop path (use_grouped_mm=False) stays bf16"
    shapes = [tuple(module.gate_up_proj.shape), tuple(module.down_proj.shape)]
    if any(d % 16 for shape in shapes for d in shape[1:]):
        return f"expert dims {shapes}: not multiples of 16"
    return grouped_fp8_unavailable(module.gate_up_proj.device)


class Fp8ExpertsHandle:
    """The converted expert modules of one transformer; ``restore()`` puts the bf16 experts and their grouped path
    back. converted: paths converted; kept: (path, why) left in bf16."""

    def __init__(self, transformer: torch.nn.Module, keep: str = "cpu"):
        self.converted: list[str] = []
        self.kept: list[tuple[str, str]] = []
        self._saved: list[tuple[torch.nn.Module, dict, object]] = []
        try:
            for path, module in expert_modules(transformer):
                why = _refusal(module)
                if why:
                    self.kept.append((path, why))
                    continue
                self._convert(module, keep)
                self.converted.append(path)
        except Exception:
            self.restore()
            raise
        if self.kept:
            log.info("fp8: %d expert modules kept in bf16 (%s)", len(self.kept), self.kept[0][1])

    def _convert(self, module: torch.nn.Module, keep: str) -> None:
        from xstage_dit.ops.moe.fp8_experts import fp8_swiglu_experts, quantize_expert_weight

        originals = {}
        quantized = {}
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(module, name)
            w8, descale = quantize_expert_weight(param)
            originals[name] = (param if keep == "device" else param.detach().to("cpu", copy=True), param.device,
                               param.requires_grad)
            quantized[name] = descale
            setattr(module, name, torch.nn.Parameter(w8, requires_grad=False))
        previous = module.__dict__.get(_GROUPED)
        self._saved.append((module, originals, previous))

        def run(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, module=module, scales=quantized) -> torch.Tensor:
            return fp8_swiglu_experts(x, num_tokens_per_expert, (module.gate_up_proj, scales["gate_up_proj"]),
                                      (module.down_proj, scales["down_proj"]))

        module.__dict__[_GROUPED] = run

    def restore(self) -> None:
        saved, self._saved = self._saved, []
        for module, originals, previous in reversed(saved):
            for name, (weight, device, requires_grad) in originals.items():
                if isinstance(weight, torch.nn.Parameter):
                    setattr(module, name, weight)
                else:
                    setattr(module, name, torch.nn.Parameter(weight.to(device), requires_grad=requires_grad))
            if previous is None:
                module.__dict__.pop(_GROUPED, None)
            else:
                module.__dict__[_GROUPED] = previous

    def describe(self) -> dict:
        return {"experts_fp8": len(self.converted), "experts_kept": len(self.kept)}
