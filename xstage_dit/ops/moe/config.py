"""Tile shapes and launch shape of the persistent expert-MLP kernel (``MoEKernelConfig``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MoEKernelConfig", "interpreting", "default_config", "config_to_ints", "config_from_ints"]


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile shapes and launch shape of the persistent expert-MLP kernel.

    block_m rows per block; block_n1 intermediate columns per Linear-1 tile (gate and up each);
    block_n2 hidden columns per Linear-2 tile; block_k reduction step. num_programs: persistent grid
    size (default: the device's SM count, from ``DeviceFacts``). lead: None = the lead handed down by
    the schedule (``xstage_dit.schedule.moe``); an int fixes it (0 = wave-by-wave).
    use_desc: TMA tensor-descriptor loads of x, weights and the SwiGLU output (sm_90+; rows and weight
    rows 16-byte aligned, expert stride of each weight = its K rows). None (default): descriptors where
    the GPU and the operands allow them, else pointer loads; True: descriptors or ValueError.
    num_stages: software-pipeline depth; None: 4 with descriptors, 3 with pointer loads (each the
    fastest timed for its path). No warp-specialization option:
    Triton 3.6 does not specialize a K loop inside the persistent tile loop (see ``kernel.py``).
    """

    # Defaults: the fastest of the configs timed at the NucleusMoE shape (TMA descriptors with 4 stages; pointer
    # loads with 3), benchmarks/results/moe/NOTES.md ("TMA descriptors"). The static stride was faster still at
    # 1 rank but needs every program resident, so the atomic ticket stays the default.
    block_m: int = 128
    block_n1: int = 128
    block_n2: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int | None = None
    num_programs: int | None = None
    lead: int | None = None
    wave_blocks: int | None = None
    ticket: bool = True  # False: static tile stride (no atomic per tile; needs every program resident)
    use_desc: bool | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n1", "block_n2", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"expected {name} a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"expected num_warps in (1, 2, 4, 8, 16), got {self.num_warps}")
        if self.lead is not None and self.lead < 0:
            raise ValueError(f"expected lead >= 0 or None, got {self.lead}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"expected num_stages >= 1 or None, got {self.num_stages}")


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU, programs one after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config() -> MoEKernelConfig:
    """The config used when none is given: the H200 default, or 16-wide tiles the interpreter runs quickly."""
    return MoEKernelConfig(16, 16, 16, 16, 4, 1) if interpreting() else MoEKernelConfig()


# Field order of ``config_to_ints``: a custom op's schema takes ints, not a dataclass.
_CONFIG_FIELDS = ("block_m", "block_n1", "block_n2", "block_k", "num_warps", "num_stages", "num_programs", "lead",
                  "wave_blocks", "ticket", "use_desc")


def config_to_ints(config: MoEKernelConfig | None) -> list[int]:
    """``config`` as ints for a custom op's schema (None -> -1, bools -> 0 / 1); ``[]`` for None (the default)."""
    if config is None:
        return []
    return [-1 if v is None else int(v) for v in (getattr(config, f) for f in _CONFIG_FIELDS)]


def config_from_ints(values: list[int]) -> MoEKernelConfig | None:
    """Inverse of ``config_to_ints``: ``[]`` -> None; ValueError on a list of another length."""
    if not values:
        return None
    if len(values) != len(_CONFIG_FIELDS):
        raise ValueError(f"expected {len(_CONFIG_FIELDS)} config ints ({', '.join(_CONFIG_FIELDS)}), got {len(values)}")
    kw = {f: (None if v == -1 else v) for f, v in zip(_CONFIG_FIELDS, values)}
    kw["ticket"] = bool(kw["ticket"])
    kw["use_desc"] = None if kw["use_desc"] is None else bool(kw["use_desc"])
    return MoEKernelConfig(**kw)
