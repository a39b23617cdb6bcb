"""`LoraManager`: the resident adapters of one pipeline (least recently used evicted past ``max_loras``), and the
adapter set of the next call.

Eager pipelines (``hotswap`` off): each resident adapter is a diffusers/PEFT adapter of its own
(``pipe.load_lora_weights(path, adapter_name=...)``); a call's set is ``pipe.set_adapters(names, scales)``, no
set is ``transformer.disable_lora()`` (the LoRA layers then call their base layer alone: the bytes of a pipeline
without LoRA), eviction is ``pipe.delete_adapters``. The image of adapter A at scale s is the one diffusers' own
``load_lora_weights`` + ``set_adapters`` give. Compiled pipelines: `slots.HotswapSlots` (why, there).

Fused (``mode`` "fused", or "auto" where `fused.choose_mode` says so): a call's set is merged into the base weights
(`fused.FusedWeights`, from each adapter's own A and B: the PEFT adapter's in eager pipelines, the harvested
tensors with hot-swap) and the LoRA layers are off: the image is diffusers' ``set_adapters`` + ``fuse_lora`` one,
the cost and the compiled graph those of a call without LoRA. Auto decides per activation, one decision for every
rank (an all-gather of each rank's verdict: fused only where the copy fits on all).

`activate` is transactional over ranks: every rank loads what it lacks and switches; if any rank failed (a corrupt
file, out of memory, a merge), every rank raises the same error and puts back what it had (its new adapters deleted,
the previous set active, the weights as they were); eviction happens only once every rank succeeded; then the
ranks compare what they hold (names, file digests, scales, the mode in use, the merged set) with
`comm.agreement.check_agreement`.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from xstage_dit.comm.agreement import RankFailed, check_agreement, fail_together
from xstage_dit.features.lora import slots as slot_ops
from xstage_dit.features.device_memory import DeviceMemory
from xstage_dit.features.lora.fused import FusedWeights, choose_mode
from xstage_dit.features.lora.config import (AdapterError, AdapterMemory, LoraServingConfig, UnknownAdapter,
                                             adapter_list, from_failure)
from xstage_dit.features.lora.store import AdapterFile, catalog, read_adapter

log = logging.getLogger(__name__)

__all__ = ["LoraManager", "Resident"]

_STAGING = "xstage_staging"


@dataclass
class Resident:
    """A resident adapter: its checked file, its PEFT adapter name (eager), and its per-layer A, B, alpha, rank
    (layer name -> `fused.LayerAdapter`: the PEFT adapter's own tensors in eager pipelines, the only copy with
    hot-swap), what a slot or a merge takes."""

    file: AdapterFile
    peft_name: str | None = None
    tensors: dict = field(default_factory=dict, repr=False)

    @property
    def plain(self) -> bool:
        return all(layer.plain for layer in self.tensors.values())


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers warns on every load of a transformer-only adapter that the text encoder got no keys, and PEFT that
    a model holding adapters gets one more: both are what this module does on purpose."""
    from diffusers.utils import logging as dlogging

    before = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*peft_config.*")
            warnings.filterwarnings("ignore", message=".*was active which is now deleted.*")
            yield
    finally:
        dlogging.set_verbosity(before)


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class LoraManager:
    """The LoRA state of `pipe` (module docstring). Thread-safe: the HTTP thread lists (without waiting) while the
    worker loads.

    invariant: batch invariance's per-layer patch for the adapters' own Linear layers (None: no batch invariance).
    """

    def __init__(self, pipe: Any, transformer: torch.nn.Module, config: LoraServingConfig,
                 invariant: Callable[[torch.nn.Module], Any] | None = None) -> None:
        if not callable(getattr(pipe, "load_lora_weights", None)):
            raise ValueError(f"expected a pipeline with diffusers' LoRA loader (load_lora_weights), got "
                             f"{type(pipe).__name__}")
        self.pipe, self.transformer, self.config, self.invariant = pipe, transformer, config, invariant
        self.device = next(transformer.parameters()).device
        self._resident: collections.OrderedDict[str, Resident] = collections.OrderedDict()  # oldest first
        self._active: tuple[tuple[str, float], ...] = ()
        self._mode: str | None = None  # the mode the active set runs in (None: no set)
        self._told: set[str] = set()  # the auto modes logged once
        self.fused = FusedWeights(transformer)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._attrs_before = set(vars(transformer))
        self.slots: slot_ops.HotswapSlots | None = None
        if config.hotswap:
            # Fused mode never runs the slots (the LoRA layers stay off), but they keep the LoRA layers in place from
            # before compile, so an adapter loaded later changes no module the graphs were traced with: one slot of
            # rank 1 does that.
            fused_only = config.mode == "fused"
            with _quiet_diffusers():
                self.slots = slot_ops.HotswapSlots(pipe, transformer, 1 if fused_only else config.max_per_request,
                                                   1 if fused_only else config.max_lora_rank)
            slot_ops.patch_modules(self.slots.modules(), invariant)
            self.slots.enable(False)

    @property
    def graph_variants(self) -> int:
        """Compiled graphs per input shape: LoRA layers off and on with hot-swap slots that may run (mode not
        "fused"), else one."""
        return 2 if self.slots is not None and self.config.mode != "fused" else 1

    # ----- what there is -----
    def available(self) -> dict[str, str]:
        """name -> path of every adapter that can be served (the folder is read again on each call)."""
        return catalog(self.config)

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first. Without the lock (a copy made under the GIL): the HTTP
        thread lists while the worker holds the lock through a load of seconds."""
        return list(self._resident.copy())

    @property
    def active(self) -> tuple[tuple[str, float], ...]:
        return self._active

    @property
    def mode_in_use(self) -> str | None:
        """"fused" or "unfused": how the active set runs (None: no adapter active)."""
        return self._mode

    def describe(self) -> list[dict]:
        """One row per adapter: name, resident, active scale (None), the mode it runs in (None unless active), rank
        and digest where resident."""
        resident, active, mode = dict(self._resident.copy()), dict(self._active), self._mode  # no lock: `resident`
        rows = []
        for name in sorted(set(self.available()) | set(resident)):
            held = resident.get(name)
            rows.append({"name": name, "resident": held is not None, "active_scale": active.get(name),
                         "mode": mode if name in active else None,
                         "rank": held.file.rank if held else None, "digest": held.file.digest if held else None})
        return rows

    def fingerprint(self) -> tuple:
        """What every rank must hold alike before a forward: the active (name, digest, scale) in order, the resident
        set, the mode in use and the set merged into the weights."""
        with self._lock:
            active = tuple((n, self._resident[n].file.digest, s) for n, s in self._active)
            return active, tuple(sorted(self._resident)), self._mode, self.fused.merged

    # ----- loading -----
    def load(self, name: str, group=None) -> AdapterFile:
        """Make `name` resident (least recently used evicted past ``max_loras``) without changing the active set;
        on every rank of `group` (None: all ranks) together. Returns its checked file."""
        with self._lock:
            self._transact([(name, None)], switch=False, group=group)
            return self._resident[name].file

    def activate(self, adapters: Iterable | None, group=None) -> tuple[tuple[str, float], ...]:
        """The adapter set of the next calls: ``[(name, scale), ...]`` (or names, or ``{"name", "scale"}``); empty or
        None: no LoRA. Loads what is not resident, on every rank of `group` together (module docstring).
        AdapterError subclasses name what failed; the previous state is kept then."""
        wanted = adapter_list(adapters, self.config.max_per_request)
        with self._lock:
            if wanted != self._active or any(n not in self._resident for n, _ in wanted):
                self._transact(wanted, switch=True, group=group)
            self._agree(group)
            return self._active

    def _transact(self, wanted, *, switch: bool, group) -> None:
        added: list[str] = []
        previous, previous_mode = self._active, self._mode
        copies = set(self.fused.saved)
        try:
            try:
                with fail_together(group, what="lora"):
                    for name, _ in wanted:
                        if name not in self._resident:
                            self._resident[name] = self._load(name)
                            added.append(name)
                if switch:
                    mode = self._decide(wanted, group)  # a collective: outside the blocks
                    with fail_together(group, what="lora"):
                        self._switch(wanted, mode)
                elif added:  # diffusers made the adapter it loaded the active one: put the set back
                    self._switch(previous, previous_mode)
            except RankFailed as exc:
                raise (from_failure(exc) or exc) from None
        except BaseException:
            for name in added:
                self._drop(name)
            self._switch(previous, previous_mode)
            self.fused.drop_copies(keep=copies)
            raise
        if switch:
            self._active, self._mode = tuple(wanted), mode
        for name, _ in wanted:
            self._resident.move_to_end(name)
        self._evict()

    def _decide(self, wanted, group) -> str | None:
        """The mode of `wanted` on every rank of `group` (None for no set): `fused.choose_mode` on each rank, fused
        only where every rank can (one all-gather of the verdicts with auto at world > 1); logged once per mode."""
        if not wanted:
            return None
        try:
            layers = {layer for name, _ in wanted for layer in self._resident[name].tensors}
            copy_bytes = self.fused.copy_bytes(layers)
            memory = DeviceMemory.of(self.device) if self.device.type == "cuda" and copy_bytes else None
            mode, why = choose_mode(self.config.mode, self.device.type, copy_bytes, memory,
                                    all(self._resident[name].plain for name, _ in wanted))
        except Exception as exc:  # noqa: BLE001 - every rank must reach the all-gather below: the safe mode
            mode, why = "unfused", f"the memory check failed ({type(exc).__name__}: {exc})"
        if self.config.mode == "auto" and dist.is_initialized() and dist.get_world_size(group) > 1:
            verdicts: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(verdicts, mode, group=group)
            if mode == "fused" and "unfused" in verdicts:
                mode, why = "unfused", f"another rank's saved copy does not fit (ranks: {verdicts})"
        if self.config.mode == "auto" and mode not in self._told:
            self._told.add(mode)
            log.info("lora: auto mode runs adapters %s: %s", mode, why)
        return mode

    def _agree(self, group) -> None:
        check_agreement({"lora adapters": self.fingerprint()}, group, what="lora")

    def _load(self, name: str) -> Resident:
        path = self.available().get(name)
        if path is None:
            names = ", ".join(sorted(self.available())) or "none"
            raise UnknownAdapter(f"lora: no adapter {name!r} (available: {names})")
        file = read_adapter(self.pipe, self.transformer, name, path, self.config.max_lora_rank)
        self._check_fits(file)
        peft_name = _STAGING if self.slots is not None else f"xstage_lora_{next(self._ids)}"
        try:
            with _quiet_diffusers():
                self.pipe.load_lora_weights(path, adapter_name=peft_name)
            if self.slots is None:
                slot_ops.patch_modules(self._adapter_modules(peft_name), self.invariant)
                # fused mode merges plain LoRAs only; unfused and auto serve the others with their LoRA layers
                tensors = slot_ops.harvest(self.transformer, peft_name, strict=self.config.mode == "fused")
                return Resident(file, peft_name=peft_name, tensors=tensors)
            return Resident(file, tensors=slot_ops.harvest(self.transformer, peft_name))
        except torch.OutOfMemoryError:
            oom = True
        except Exception as exc:  # noqa: BLE001 - diffusers' or PEFT's refusal, named
            text = (str(exc).replace(path, "<file>").splitlines() or [""])[0][:300]  # no server paths in answers
            oom, reason = False, f"{type(exc).__name__}: {text}"
        finally:
            if self.slots is not None:  # the staging adapter never stays: no forward may see its modules
                self._delete_peft(_STAGING)
        self._delete_peft(peft_name)
        _free_device_memory(self.device)
        if oom:
            raise AdapterMemory(f"lora: adapter {name!r} ({file.num_bytes / 2**20:.1f} MiB) does not fit in the "
                                f"memory of {self.device}")
        raise AdapterError(f"lora: adapter {name!r} could not be loaded ({reason})")

    def _check_fits(self, file: AdapterFile) -> None:
        """Refuse an adapter larger than the device's free memory (CUDA) before anything is allocated."""
        if self.device.type != "cuda":
            return
        available = DeviceMemory.of(self.device).available
        if file.num_bytes > available:
            raise AdapterMemory(f"lora: adapter {file.name!r} ({file.num_bytes / 2**20:.1f} MiB) does not fit in "
                                f"the free memory of {self.device} ({available / 2**20:.1f} MiB)")

    def _adapter_modules(self, peft_name: str) -> list[torch.nn.Module]:
        layers = slot_ops.lora_layers(self.transformer).values()
        return [d[peft_name] for layer in layers for d in (layer.lora_A, layer.lora_B) if peft_name in d]

    def _delete_peft(self, peft_name: str) -> None:
        if any(peft_name in names for names in self.pipe.get_list_adapters().values()):
            with _quiet_diffusers():
                self.pipe.delete_adapters(peft_name)

    def _drop(self, name: str) -> None:
        held = self._resident.pop(name, None)
        if held is None:
            return
        if held.peft_name is not None:
            self._delete_peft(held.peft_name)
        if self.slots is not None:
            for i, holds in enumerate(self.slots.holds):
                if holds == name:
                    self.slots.put(i, None, {})

    def _evict(self) -> None:
        """Least recently used adapters out until at most ``max_loras`` are resident (never an active one)."""
        active, evicted = {n for n, _ in self._active}, False
        for name in list(self._resident):
            if len(self._resident) <= self.config.max_loras:
                break
            if name not in active:
                log.info("lora: evicting %r (least recently used of %d resident)", name, len(self._resident))
                self._drop(name)
                evicted = True
        if evicted:  # a collection costs a loaded process hundreds of ms: only when memory was let go
            _free_device_memory(self.device)

    # ----- switching -----
    def _switch(self, wanted, mode: str | None) -> None:
        """Make `wanted` the set the next calls run, in `mode` ("fused" or "unfused"; anything with no set)."""
        if wanted and mode == "fused":
            if self.slots is not None:
                self.slots.enable(False)
            else:
                self.transformer.disable_lora()
            try:
                self.fused.write(wanted, {name: self._resident[name].tensors for name, _ in wanted})
                return
            except torch.OutOfMemoryError:
                pass  # refused below, once the exception (and the frames holding its tensors) is gone
            _free_device_memory(self.device)
            names = ", ".join(name for name, _ in wanted)
            raise AdapterMemory(f"lora: the weights merged with adapters {names} (a saved copy of each targeted "
                                f"weight) do not fit in the memory of {self.device}")
        self.fused.write((), {})  # W0 in every merged weight (nothing to do when none is)
        if self.slots is None:
            if wanted:
                self.pipe.set_adapters([self._resident[n].peft_name for n, _ in wanted], [s for _, s in wanted])
                self.transformer.enable_lora()
            elif self._resident:
                self.transformer.disable_lora()
            return
        self._switch_slots(wanted)

    def _switch_slots(self, wanted) -> None:
        slots = self.slots
        slots.activate_all()  # a load through diffusers leaves its own adapter the active one
        names = [n for n, _ in wanted]
        free = [i for i, held in enumerate(slots.holds) if held not in names]
        for name, scale in wanted:
            if name in slots.holds:
                index = slots.holds.index(name)
            else:
                index = free.pop(0)
                slots.put(index, name, self._resident[name].tensors)
            slots.set_scale(index, scale)
        for index in free:
            slots.set_scale(index, 0.0)
        slots.enable(bool(wanted))

    @contextlib.contextmanager
    def warming(self):
        """With hot-swap slots: the LoRA layers on at scale 0 for the block (the bytes of no LoRA, the graphs of a
        LoRA call), so a warm-up compiles both variants of its shape; the active set is back afterwards. A no-op
        where only one variant runs (`graph_variants`)."""
        if self.graph_variants == 1:
            yield
            return
        with self._lock:
            try:
                self.fused.write((), {})  # W0: the bytes of no LoRA
                for index in range(len(self.slots.names)):
                    self.slots.set_scale(index, 0.0)
                self.slots.enable(True)
                yield
            finally:
                self._switch(self._active, self._mode)

    # ----- undo -----
    def restore(self) -> None:
        """Every adapter and LoRA layer gone: the transformer's modules, weights and attributes as before."""
        with self._lock:
            self.fused.restore()  # W0 in every merged weight, the saved copies freed
            for name in list(self._resident):
                self._drop(name)
            self._active, self._mode = (), None
            if slot_ops.lora_layers(self.transformer):
                self.transformer.unload_lora()
            self.slots = None
            for name in set(vars(self.transformer)) - self._attrs_before:
                delattr(self.transformer, name)
            _free_device_memory(self.device)
