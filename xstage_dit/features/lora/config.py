"""`LoraServingConfig` (what the LoRA feature serves) and `adapter_list` (a request's adapters, checked).

An adapter is named by its file or folder under ``lora_dir`` (``style.safetensors`` -> ``style``; a diffusers
LoRA folder ``style/`` holding ``pytorch_lora_weights.safetensors`` -> ``style``); a request names adapters,
never paths. ``paths`` adds adapters by path (the CLI's ``--lora /path/file.safetensors``), named by file stem.

A request's adapter list is a tuple of ``(name, scale)`` pairs, in the order the request gave them (the order
the LoRA deltas are summed in), each scale in [`MIN_SCALE`, `MAX_SCALE`]: scale 0 is allowed (the adapter is
loaded and contributes nothing), negative scales subtract an adapter (a documented use of "negative" LoRAs).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["ADAPTER_ERRORS", "AdapterError", "AdapterLimit", "AdapterMemory", "UnknownAdapter", "from_failure",
           "LoraServingConfig", "MIN_SCALE", "MAX_SCALE", "MODES", "adapter_list", "parse_adapter_arg"]

MIN_SCALE, MAX_SCALE = -4.0, 4.0  # a LoRA scale outside this is a typo (a percentage, a rank), not a style
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64
DEFAULT_PER_REQUEST = 2
MODES = ("auto", "fused", "unfused")  # `fused.choose_mode` decides "auto"; `fused` says why fused pays


class AdapterError(ValueError):
    """An adapter request or load that cannot be served (a malformed request, a bad file, another model's adapter,
    mismatched shapes): the server answers `status`. Subclasses say which kind; their class name travels between
    ranks with the message (`comm.agreement.fail_together`), so every rank raises the same kind (`from_failure`)."""

    status = 400


class UnknownAdapter(AdapterError):
    """No adapter of that name in the catalog."""

    status = 404


class AdapterLimit(AdapterError):
    """More adapters than allowed, a scale out of range, a rank above ``max_lora_rank``."""


class AdapterMemory(AdapterError):
    """The adapter does not fit in the device's memory (the server answers 507)."""

    status = 507


ADAPTER_ERRORS = {cls.__name__: cls for cls in (AdapterError, UnknownAdapter, AdapterLimit, AdapterMemory)}


def from_failure(exc: BaseException) -> AdapterError | None:
    """The adapter error a peer rank raised, as this rank's own kind, from a `RankFailed` message
    ("... failed on rank R of W: UnknownAdapter: ..."); None when the failure was no adapter error."""
    match = re.search(r"failed on rank \d+ of \d+: (\w+): ", str(exc))
    cls = ADAPTER_ERRORS.get(match.group(1)) if match else None
    return None if cls is None else cls(str(exc))


def _int_at_least(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"expected {name} to be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class LoraServingConfig:
    """What the LoRA feature serves (validated on construction; ValueError naming a bad value).

    lora_dir: the folder whose ``.safetensors`` files and diffusers LoRA folders are the adapters (None: only
        `paths`). Scanned on each listing, so an adapter copied there later is found without a restart.
    paths: name -> file or folder of adapters given by path (the CLI); they shadow a same-named one in lora_dir.
    max_loras: adapters resident at once; loading one more evicts the least recently used one not in use.
    max_lora_rank: the largest adapter rank accepted; with `hotswap` the rank every slot is padded to.
    preload: adapter names loaded at start-up (in order; more than max_loras is an error).
    max_per_request: adapters one request may combine (<= max_loras: they are resident together); with `hotswap`
        the number of slots compiled in (each costs a rank-`max_lora_rank` pass per LoRA layer of a LoRA request).
    hotswap: compiled pipelines: adapters are copied into slots that exist before compile (no recompile per
        adapter); False: each resident adapter is a diffusers/PEFT adapter of its own (``set_adapters``).
    """

    lora_dir: str | None = None
    paths: dict = field(default_factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    preload: tuple[str, ...] = ()
    max_per_request: int = DEFAULT_PER_REQUEST
    hotswap: bool = False
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"expected lora_dir to be a folder, got {self.lora_dir!r}")
        for name, path in dict(self.paths).items():
            if not isinstance(name, str) or not name or not os.path.exists(path):
                raise ValueError(f"expected adapter paths name -> existing file or folder, got {name!r}: {path!r}")
        _int_at_least("max_loras", self.max_loras, 1)
        _int_at_least("max_lora_rank", self.max_lora_rank, 1)
        _int_at_least("max_per_request", self.max_per_request, 1)
        if self.max_per_request > self.max_loras:
            raise ValueError(f"expected max_per_request <= max_loras ({self.max_loras}: a request's adapters are "
                             f"resident together), got {self.max_per_request}")
        object.__setattr__(self, "preload", tuple(self.preload))
        if len(self.preload) > self.max_loras:
            raise ValueError(f"expected at most max_loras={self.max_loras} preloaded adapters, got {len(self.preload)}")
        if not isinstance(self.hotswap, bool):
            raise ValueError(f"expected hotswap True or False, got {self.hotswap!r}")
        if self.mode not in MODES:
            raise ValueError(f"expected lora mode in {', '.join(MODES)}, got {self.mode!r}")

    def facts(self) -> dict:
        """What every rank must be configured alike with (`comm.agreement.check_agreement` at stack build)."""
        return {"max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank, "preload": self.preload,
                "max_per_request": self.max_per_request, "hotswap": self.hotswap, "mode": self.mode,
                "names": tuple(sorted(self.paths)) + (("<dir>",) if self.lora_dir else ())}


def _scale(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AdapterLimit(f"{where}: expected a scale in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {value!r}")
    if not MIN_SCALE <= value <= MAX_SCALE:
        raise AdapterLimit(f"{where}: expected a scale in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {value:g}")
    return float(value)


def adapter_list(entries: Iterable | None, max_per_request: int) -> tuple[tuple[str, float], ...]:
    """A request's adapters as ``((name, scale), ...)``: each entry a name (scale 1.0), a ``(name, scale)`` pair
    or a mapping with ``name`` and optional ``scale``. AdapterError (kind "limit") for more than
    `max_per_request` adapters, a name twice, a scale out of range; ("invalid") for a malformed entry."""
    out: list[tuple[str, float]] = []
    for i, entry in enumerate(entries or ()):
        where = f"lora[{i}]"
        if isinstance(entry, str):
            name, scale = entry, 1.0
        elif isinstance(entry, dict):
            name, scale = entry.get("name"), entry.get("scale", 1.0)
        elif isinstance(entry, (tuple, list)) and len(entry) == 2:
            name, scale = entry
        else:
            name, scale = getattr(entry, "name", None), getattr(entry, "scale", 1.0)
        if not isinstance(name, str) or not name.strip() or "/" in name or "\\" in name or name in (".", ".."):
            raise AdapterError(f"{where}.name: expected an adapter name (no path), got {name!r}")
        out.append((name, _scale(1.0 if scale is None else scale, f"{where}.scale")))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise AdapterLimit(f"lora: expected each adapter once, got {names}")
    if len(out) > max_per_request:
        raise AdapterLimit(f"lora: expected at most {max_per_request} adapters in one request, got {len(out)}")
    return tuple(out)


def parse_adapter_arg(text: str) -> tuple[str, float]:
    """``NAME[:SCALE]`` (the CLI's ``--lora``; NAME may be a path) -> (NAME, SCALE); ValueError naming a bad one."""
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            return head, _scale(float(tail), f"--lora {text}")
        except ValueError:
            if os.path.exists(text):  # a path holding ':' and no scale
                return text, 1.0
            raise ValueError(f"expected NAME[:SCALE] with a number in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {text!r}")
    if not text:
        raise ValueError("expected NAME[:SCALE], got an empty value")
    return text, 1.0
