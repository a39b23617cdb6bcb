"""Where adapters come from and whether one fits this pipeline: `catalog` (the adapters a config can serve, by
name), `read_adapter` (an adapter file read through diffusers' own converter and checked against the
transformer before anything in the model changes) and `content_digest` (what ranks compare).

The check is what makes a bad adapter fail cleanly: diffusers' loaders would otherwise inject part of an
adapter before failing, or (FLUX) widen the transformer's own weights for an adapter of other shapes. Here an
adapter is refused, naming the first problem, when it holds text-encoder weights (the prompt cache and the text
encoders serve every request alike), targets a module the transformer lacks (an adapter for another family),
targets something that is not a Linear layer, has shapes that do not match, a rank above ``max_lora_rank``, or
targets a layer another feature hooks (sequence parallelism gathers ``proj_out``'s output: a LoRA around it would
add a shard-sized delta to a gathered output).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from xstage_dit.features.lora.config import AdapterError, AdapterLimit, LoraServingConfig

log = logging.getLogger(__name__)

__all__ = ["AdapterFile", "base_linear", "catalog", "content_digest", "hooked", "read_adapter"]

SUFFIX = ".safetensors"
_LORA_PARTS = ("lora_A.weight", "lora_B.weight", "lora_B.bias")


def catalog(config: LoraServingConfig) -> dict[str, str]:
    """name -> path of every adapter `config` can serve: ``*.safetensors`` files and folders holding one under
    ``lora_dir`` (named by file stem / folder name), then `config.paths` (which win on a clash)."""
    found: dict[str, str] = {}
    if config.lora_dir is not None:
        for entry in sorted(os.listdir(config.lora_dir)):
            path = os.path.join(config.lora_dir, entry)
            if entry.endswith(SUFFIX) and os.path.isfile(path):
                found[entry[: -len(SUFFIX)]] = path
            elif os.path.isdir(path) and any(f.endswith(SUFFIX) for f in os.listdir(path)):
                found[entry] = path
    found.update(config.paths)
    return found


def content_digest(path: str) -> str:
    """sha256 (16 hex digits) of an adapter's bytes (a folder: its ``.safetensors`` files in name order): equal on
    every rank that reads the same adapter, whatever the path."""
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))
                                                  if f.endswith(SUFFIX)]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def hooked(module: torch.nn.Module) -> bool:
    """Whether another feature put a diffusers hook on `module` (an empty registry, which a pipeline call's
    ``cache_context`` leaves, does not count)."""
    return bool(getattr(getattr(module, "_diffusers_hook", None), "hooks", None))


def base_linear(module: torch.nn.Module) -> torch.nn.Module:
    """The layer a LoRA wraps: `module` itself, or a PEFT LoRA layer's ``base_layer``."""
    return getattr(module, "base_layer", module)


@dataclass(frozen=True)
class AdapterFile:
    """An adapter read and checked: name, path, digest, rank (the largest), targets (module names in the
    transformer), num_bytes (its weights at the pipeline's dtype)."""

    name: str
    path: str
    digest: str
    rank: int
    targets: tuple[str, ...]
    num_bytes: int


def _state_dict(pipe: Any, name: str, path: str) -> dict:
    reader = getattr(type(pipe), "lora_state_dict", None)
    if reader is None:
        raise AdapterError(f"adapter {name!r}: {type(pipe).__name__} has no diffusers LoRA loader")
    try:
        out = reader(path)
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: diffusers' or safetensors' error, named
        reason = str(exc).replace(path, "<file>").splitlines()[0][:300] if str(exc) else ""  # no server paths
        raise AdapterError(f"adapter {name!r}: could not be read as a LoRA ({type(exc).__name__}: {reason})") from None
    state = out[0] if isinstance(out, tuple) else out
    if not isinstance(state, dict) or not state:
        raise AdapterError(f"adapter {name!r}: expected LoRA weights, got an empty file")
    return state


def read_adapter(pipe: Any, transformer: torch.nn.Module, name: str, path: str, max_rank: int) -> AdapterFile:
    """Read `path` with the pipeline's own converter (diffusers/PEFT, kohya and the other community formats it
    knows) and check every key against `transformer` (module docstring); nothing in the model changes.
    AdapterError naming the first problem."""
    state = _state_dict(pipe, name, path)
    prefix = getattr(type(pipe), "transformer_name", "transformer") + "."
    ranks: dict[str, int] = {}
    num_bytes, itemsize = 0, next(transformer.parameters()).element_size()
    for key, tensor in state.items():
        if key.endswith(".alpha") or key.endswith("alpha"):
            continue
        if not key.startswith(prefix):
            raise AdapterError(f"adapter {name!r}: expected transformer weights only (text-encoder "
                                          f"LoRAs are not served), got {key!r}")
        module_name, part = _split(key[len(prefix):])
        if part is None:
            raise AdapterError(f"adapter {name!r}: expected LoRA weights (lora_A / lora_B), got {key!r}")
        module = _module(transformer, name, module_name)
        rank = _check_shape(name, module_name, part, module, tensor)
        if rank is not None:
            ranks[module_name] = max(rank, ranks.get(module_name, 0))
        num_bytes += tensor.numel() * itemsize
    if not ranks:
        raise AdapterError(f"adapter {name!r}: expected LoRA weights for {type(transformer).__name__}, "
                                      f"got none")
    rank = max(ranks.values())
    if rank > max_rank:
        raise AdapterLimit(f"adapter {name!r}: expected rank <= max_lora_rank={max_rank}, got {rank}")
    return AdapterFile(name, path, content_digest(path), rank, tuple(sorted(ranks)), num_bytes)


def _split(key: str) -> tuple[str, str | None]:
    for part in _LORA_PARTS:
        if key.endswith("." + part):
            return key[: -len(part) - 1], part
    return key, None


def _expert_parallel_owner(transformer: torch.nn.Module, module_name: str) -> tuple[str, int] | None:
    """(path, ep) of the expert-parallel MoE layer above `module_name` (which it replaced: its experts are this
    rank's shard, stored as one tensor), or None."""
    from xstage_dit.features.ep_layers import is_expert_parallel_layer

    parts = module_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:end])
        try:
            module = transformer.get_submodule(path)
        except AttributeError:
            continue
        return (path, module.shard[1]) if is_expert_parallel_layer(module) else None
    return None


def _module(transformer: torch.nn.Module, name: str, module_name: str) -> torch.nn.Module:
    try:
        module = transformer.get_submodule(module_name)
    except AttributeError:
        sharded = _expert_parallel_owner(transformer, module_name)
        if sharded is not None:
            raise AdapterError(f"adapter {name!r}: targets {module_name!r}, a routed expert of {sharded[0]!r}, whose "
                               f"experts expert parallelism shards over {sharded[1]} ranks: LoRA on routed experts is "
                               "not served under expert parallelism; expected an adapter on the attention, dense and "
                               "shared-expert layers, or ep=1") from None
        raise AdapterError(f"adapter {name!r}: targets {module_name!r}, which "
                                      f"{type(transformer).__name__} does not have (an adapter for another model "
                                      f"family?)") from None
    base = base_linear(module)
    if not isinstance(base, torch.nn.Linear):
        raise AdapterError(f"adapter {name!r}: expected Linear layers, got {module_name!r}, a "
                                      f"{type(base).__name__}")
    if hooked(module) or hooked(base):
        raise AdapterError(f"adapter {name!r}: targets {module_name!r}, whose call another feature hooks "
                                      f"(sequence parallelism gathers its output): not served under this "
                                      f"configuration")
    return base


def _check_shape(name: str, module_name: str, part: str, base: torch.nn.Linear, tensor: torch.Tensor) -> int | None:
    """The rank a lora_A / lora_B tensor implies (None for a bias); AdapterError when it does not fit `base`."""
    if part == "lora_A.weight":
        ok, rank, want = tensor.dim() == 2 and tensor.shape[1] == base.in_features, tensor.shape[0], \
            f"(rank, {base.in_features})"
    elif part == "lora_B.weight":
        ok, rank, want = tensor.dim() == 2 and tensor.shape[0] == base.out_features, tensor.shape[-1], \
            f"({base.out_features}, rank)"
    else:
        ok, rank, want = tensor.dim() == 1 and tensor.shape[0] == base.out_features, None, f"({base.out_features},)"
    if not ok:
        raise AdapterError(f"adapter {name!r}: {module_name}.{part}: expected shape {want} for "
                                      f"{type(base).__name__}({base.in_features}, {base.out_features}), got "
                                      f"{tuple(tensor.shape)} (an adapter for another model size?)")
    return rank
