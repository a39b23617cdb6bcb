"""Expert-sharded MoE transformers: each rank creates or reads only its own experts.

``load_pipeline(model, expert_shard=(rank, world))`` builds the MoE transformer with its routed experts
never materialised (meta device), then puts on every MoE layer the EP layer of `xstage_dit.features.ep_layers`
holding experts ``[rank*E/world, (rank+1)*E/world)`` only (``from_shard``). `parallelize` later binds those
layers to the EP group (see `xstage_dit.features.expert_parallel`).

Where the experts come from:

- built-in models (random weights): every expert is drawn from its own generator, seeded from
  (seed, layer name, expert index) (`expert_seed`), so an expert has the same values whether its rank builds
  it alone or the whole tensor is built (``expert_shard=None``, world 1);
- a local diffusers folder (real weights): the transformer is created empty (``accelerate.init_empty_weights``),
  every non-expert tensor is read from its safetensors files, and only this rank's experts are read
  (NucleusMoE's packed ``experts.gate_up_proj (E, H, 2I)`` / ``experts.down_proj (E, I, H)`` through
  ``safe_open(...).get_slice(name)[lo:hi]``; HiDream's ``experts.{e}.w1/w2/w3`` only for e in the range).

How a family's experts are laid out, made and read is its record's `ExpertFacts` (``families/<family>.py``);
this module is the mechanism they plug into.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

@dataclass(frozen=True)
class ExpertShard:
    """This rank's part of every MoE layer: experts ``[rank * E / world, (rank + 1) * E / world)``."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        for name in ("rank", "world"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"expected expert_shard {name} to be an int, got {value!r}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(
                f"expected expert_shard=(rank, world) with world >= 1 and 0 <= rank < world, got ({self.rank}, {self.world})"
            )

    @classmethod
    def of(cls, value) -> "ExpertShard | None":
        """None, an ExpertShard, or a (rank, world) pair."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(*value)
        raise ValueError(f"expected expert_shard=(rank, world) or None, got {value!r}")

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(lo, hi) expert range of this rank; ValueError unless world divides num_experts."""
        if num_experts % self.world:
            raise ValueError(
                f"expected the expert-shard world to divide the expert count, got world={self.world} for "
                f"num_experts={num_experts}"
            )
        per = num_experts // self.world
        return self.rank * per, (self.rank + 1) * per

    @property
    def pair(self) -> tuple[int, int]:
        return self.rank, self.world


def expert_seed(seed: int, layer_name: str, expert: int) -> int:
    """A 63-bit seed for one expert of one layer: stable across runs, processes and shardings."""
    digest = hashlib.sha256(f"{int(seed)}/{layer_name}/{int(expert)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_(gen: torch.Generator, shape, std: float, device) -> torch.Tensor:
    """An fp32 tensor of `shape` drawn from normal(0, std) with `gen` (a family's random experts)."""
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)


def uniform_(gen: torch.Generator, shape, bound: float, device) -> torch.Tensor:
    """An fp32 tensor of `shape` drawn from uniform(-bound, bound) with `gen` (a family's random experts)."""
    return torch.empty(shape, dtype=torch.float32, device=device).uniform_(-bound, bound, generator=gen)


def family_of(family: str):
    """The `ExpertFacts` of a MoE family's record (how its experts are stored, made and read); ValueError naming
    the MoE families otherwise."""
    from xstage_dit.families.registry import records

    moe = {name: r.experts for name, r in records().items() if r.experts is not None}
    if family not in moe:
        raise ValueError(f"expected a MoE model family in {sorted(moe)} for expert_shard, got {family!r}")
    return moe[family]


def _ep_cls(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _moe_layers(model: nn.Module, fam) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(qualified name, parent, attribute, layer) of every MoE layer of ``fam`` in ``model``."""
    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child).__name__ == fam.layer_class:
                found.append((f"{parent_name}.{child_name}" if parent_name else child_name, parent, child_name, child))
    return found


def _install_experts(model: nn.Module, fam, shard: ExpertShard | None, get_experts, *, dtype, device) -> int:
    """Give every MoE layer of ``model`` its experts: the full diffusers layer (``shard`` None or world 1)
    or the EP layer with this rank's experts. get_experts(layer_name, lo, hi, hidden, inter) -> (gate_up, down)."""
    layers = _moe_layers(model, fam)
    if not layers:
        raise ValueError(f"expected {fam.layer_class} layers in {type(model).__name__}, found none")
    for name, parent, attr, layer in layers:
        num_experts = fam.num_experts(layer)
        hidden, inter = fam.dims(layer)
        lo, hi = (shard or ExpertShard(0, 1)).experts(num_experts)
        gate_up, down = get_experts(name, lo, hi, hidden, inter)
        gate_up = gate_up.to(device=device, dtype=dtype)
        down = down.to(device=device, dtype=dtype)
        if shard is None or shard.world == 1:
            fam.materialize(layer, gate_up, down)
        else:
            setattr(parent, attr, _ep_cls(fam.ep_layer).from_shard(layer, gate_up, down, shard.pair))
    return len(layers)


def build_with_experts(factory: Callable[[], nn.Module], family: str, *, seed: int, shard, build_module, device,
                       dtype) -> nn.Module:
    """``build_module(factory)`` with the routed experts made per (seed, layer, expert), only this rank's.

    shard: None / (0, 1): diffusers MoE layers holding every expert; (rank, world): EP layers holding only
    their experts (the others are never created).
    """
    from xstage_dit._diffusers_private import check_diffusers_version

    check_diffusers_version()  # the meta-experts construction wraps diffusers' internal MoE classes
    fam = family_of(family)
    shard = ExpertShard.of(shard)
    with fam.meta_experts():
        model = build_module(factory, seed=seed, device=device, dtype=dtype)
    device = torch.device(device)
    if device.type != "meta":  # on meta everything is; nothing to tell apart
        _check_meta_experts(model, fam)

    def random(name, lo, hi, hidden, inter):
        if device.type == "meta":  # architecture only (parameter counts): the shapes of this rank's experts
            return (torch.empty(hi - lo, hidden, 2 * inter, device="meta"),
                    torch.empty(hi - lo, inter, hidden, device="meta"))
        return fam.random_experts(name, lo, hi, seed, hidden, inter, device, dtype)

    with torch.no_grad():
        _install_experts(model, fam, shard, random, dtype=dtype, device=device)
    if device.type != "meta":
        _check_materialized(model)
    return model


def _check_meta_experts(model: nn.Module, fam) -> None:
    """The routed experts, and only they, were built on meta (else diffusers' MoE classes changed)."""
    for name, _, _, layer in _moe_layers(model, fam):
        for pname, p in layer.named_parameters():
            if (p.device.type == "meta") != pname.startswith("experts."):
                raise RuntimeError(
                    f"expected only the routed experts of {name} ({fam.layer_class}) on the meta device during "
                    f"construction, got {pname} on {p.device}: diffusers' MoE layer changed; update "
                    "the family's ExpertFacts (xstage_dit/families/<family>.py)"
                )


def _check_materialized(model: nn.Module) -> None:
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise RuntimeError(f"expected every parameter materialised after loading, got {len(left)} on meta: {left[:4]}")


# ---------------------------------------------------------------------------------------------------------
# Local diffusers folders (safetensors)
# ---------------------------------------------------------------------------------------------------------


class _SafetensorsReader:
    """The tensors of a diffusers model folder, by name, across its (possibly sharded) safetensors files."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "diffusion_pytorch_model.safetensors.index.json"
        single = folder / "diffusion_pytorch_model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            raise ValueError(f"expected diffusion_pytorch_model.safetensors (or its index) in {str(folder)!r}, got none")
        self._files = [safe_open(str(folder / f), framework="pt") for f in files]
        self._where = {}
        for handle in self._files:
            for key in handle.keys():
                self._where[key] = handle

    def keys(self) -> list[str]:
        return list(self._where)

    def _handle(self, key: str):
        if key not in self._where:
            raise KeyError(f"expected tensor {key!r} in the safetensors files, got none of that name")
        return self._where[key]

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        return self._handle(key).get_tensor(key)

    def read_slice(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the first dim, without reading the rest of the tensor."""
        return self._handle(key).get_slice(key)[lo:hi]


def load_transformer_sharded(folder: str | Path, family: str, shard, *, dtype: torch.dtype, device) -> nn.Module:
    """The transformer of a local diffusers folder with only this rank's experts read (see module doc).

    folder: the pipeline folder (with ``transformer/config.json`` and safetensors weights).
    Returns the model on ``device`` in ``dtype``; with ``shard`` world > 1 its MoE layers are EP layers.
    """
    import diffusers
    from accelerate import init_empty_weights

    fam = family_of(family)
    shard = ExpertShard.of(shard)
    folder = Path(folder) / "transformer"
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with init_empty_weights():  # parameters on meta, buffers (rotary tables...) real
        model = cls.from_config(config)
    reader = _SafetensorsReader(folder)
    expert_prefixes = tuple(f"{name}.experts." for name, *_ in _moe_layers(model, fam))
    state = {}
    for key in reader.keys():
        if not key.startswith(expert_prefixes):
            state[key] = reader.read(key).to(dtype=dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not k.startswith(expert_prefixes)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"expected the safetensors of {str(folder)!r} to match {cls.__name__}, got missing {missing[:4]} and "
            f"unexpected {result.unexpected_keys[:4]}"
        )

    def read(name, lo, hi, hidden, inter):
        return fam.read_experts(reader, name, lo, hi)

    with torch.no_grad():
        _install_experts(model, fam, shard, read, dtype=dtype, device="cpu")
    _check_materialized(model)
    # nn.Module.to, not ModelMixin.to: diffusers' keep-in-fp32 warning is about its own loader (none here).
    nn.Module.to(model, device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    return model
