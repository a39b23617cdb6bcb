"""The ONLY module of the package that touches private torch API (behind a version check).

What we use and why (each accessor checks the torch version first, then that the name exists, and fails with a
`TorchPrivateAPIError` naming both where it does not):

- ``torch._dynamo.utils.counters["frames"]``: how many frames Dynamo was asked to convert (a cache miss each):
  `compile`'s warm guards mark a call key warm once a call of it converted nothing; tests count recompiles.
- ``torch._dynamo.config.recompile_limit`` / ``accumulated_recompile_limit``: raised while a compiled stack is
  applied (layers x shapes graphs per code object), back to the user's values when the last one restores
  (`raise_recompile_limits`).
- ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` / ``torch._C._dynamo.eval_frame.reset_code`` and
  ``torch._dynamo.convert_frame.input_codes``: what one `OwnedCompiler` compiled is dropped on its own code
  objects, without ``torch._dynamo.reset()`` (which drops every compiled graph of the process).
- ``torch._C._cuda_getCurrentRawStream``: the current stream as an int without a Python object (the
  abortable barrier's launch, `comm.barrier`).
- ``torch._C._construct_storage_from_data_pointer``: a non-owning storage over a peer window's slot
  (`comm.peer_window`); the public route asks the driver which device owns the first byte, which for a slot
  mapping a peer GPU's memory is the peer.
- ``torch.distributed._symmetric_memory``: symmetric allocations and their rendezvous (`comm.distributed`,
  `comm.barrier`, `comm.peer_window`).
- ``torch._inductor.config.save_config`` / ``load_config``: the peers' FP8 recipe (torchao's default config) turns
  on Inductor's coordinate-descent tuning process-wide and never back (`inductor_config_restorer`); its undo in the
  bench puts the config back, so rows measured after it compile as they would alone.
- ``torch._scaled_grouped_mm``: the grouped FP8 GEMM with row-wise scales (Hopper and newer) under the FP8 expert
  MLPs (`ops.moe.fp8_experts`); torchao's MoE path calls the same op.

Tested with torch 2.11 (GPU machine) and 2.13 (CPU CI); `SUPPORTED_TORCH` is pyproject's range.
(`bench/xfuser_stack.py` keeps two uses of its own: ``torch._dynamo.reset()`` after an xfuser contender's
compile and Inductor's overlap settings an xfuser runner sets process-wide; both are about xfuser's stack.)
"""

from __future__ import annotations

import functools
import itertools
import logging
import types
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

SUPPORTED_TORCH = ((2, 11), (2, 14))  # lowest and highest (major, minor) tested: pyproject's ">=2.11,<2.15"


class TorchPrivateAPIError(RuntimeError):
    """This torch lacks (or is outside the tested range for) a private API the package relies on."""


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise TorchPrivateAPIError(f"expected a torch version MAJOR.MINOR..., got {version!r}") from None


def check_torch_version(version: str | None = None) -> str:
    """The torch version, or TorchPrivateAPIError naming it when outside `SUPPORTED_TORCH`."""
    version = torch.__version__ if version is None else version
    low, high = SUPPORTED_TORCH
    if not low <= _version_tuple(version) <= high:
        raise TorchPrivateAPIError(
            f"expected torch {low[0]}.{low[1]} to {high[0]}.{high[1]} (xstage_dit uses private torch API: "
            f"xstage_dit/_torch_private.py), got torch {version}")
    return version


def _private(owner: Any, name: str, where: str) -> Any:
    """``owner.name`` after the version check; TorchPrivateAPIError naming `where` when it is missing."""
    check_torch_version()
    value = getattr(owner, name, None)
    if value is None:
        raise TorchPrivateAPIError(f"expected {where} in torch {torch.__version__}, got a torch without it")
    return value


# ------------------------------------------------------------------------------------------- Dynamo counters


def dynamo_counters() -> Any:
    """Dynamo's counters (``counters["frames"]["total"]``, ``counters["stats"]["unique_graphs"]``, ...)."""
    import torch._dynamo.utils as utils

    return _private(utils, "counters", "torch._dynamo.utils.counters")


def frames_converted() -> int:
    """How many frames Dynamo has been asked to convert in this process (each one a cache miss)."""
    return dynamo_counters()["frames"]["total"]


# Phases of torch.compile's own timers (torch._dynamo.utils.compilation_time_metrics: name -> durations), as the
# bench reports them: the whole conversion, Dynamo's bytecode tracing, AOTAutograd, Inductor, and the wait on the
# Triton compile workers.
COMPILE_PHASES = {"total": "_compile.compile_inner", "dynamo_tracing": "bytecode_tracing",
                  "aot_autograd": "create_aot_dispatcher_function", "inductor": "compile_fx_inner",
                  "triton_compile_wait": "async_compile.wait"}


def compile_seconds() -> dict[str, float]:
    """Seconds this process has spent so far in each of `COMPILE_PHASES` (0 for a phase not reached)."""
    import torch._dynamo.utils as utils

    metrics = _private(utils, "compilation_time_metrics", "torch._dynamo.utils.compilation_time_metrics")
    return {phase: float(sum(metrics.get(name, ()))) for phase, name in COMPILE_PHASES.items()}


def compile_seconds_since(before: dict[str, float]) -> dict[str, float]:
    """Seconds spent in each of `COMPILE_PHASES` since `before` (an earlier `compile_seconds()`), to the ms."""
    return {phase: round(now - before[phase], 3) for phase, now in compile_seconds().items()}


# ------------------------------------------------------------------------------------------- recompile limits

_LIMIT_NAMES = ("recompile_limit", "accumulated_recompile_limit")
_LIMIT_USERS: dict[int, tuple[int, int]] = {}  # one entry per applied owner: the limits it needs
_LIMIT_SAVED: list[tuple[int, int]] = []  # the user's values while any owner is applied
_LIMIT_IDS = itertools.count()


def raise_recompile_limits(per_code_object: int, accumulated: int) -> Callable[[], None]:
    """Dynamo's ``recompile_limit`` / ``accumulated_recompile_limit`` at least these values while the returned
    undo has not run; with several owners the largest request holds, and the user's values come back when the
    last one undoes (idempotent)."""
    import torch._dynamo as dynamo

    config = _private(dynamo, "config", "torch._dynamo.config")
    for name in _LIMIT_NAMES:
        _private(config, name, f"torch._dynamo.config.{name}")
    if not _LIMIT_USERS:
        _LIMIT_SAVED[:] = [(config.recompile_limit, config.accumulated_recompile_limit)]
    key = next(_LIMIT_IDS)
    _LIMIT_USERS[key] = (per_code_object, accumulated)
    _set_limits(config)

    def undo() -> None:
        if _LIMIT_USERS.pop(key, None) is None:
            return
        _set_limits(config)

    return undo


def _set_limits(config: Any) -> None:
    saved = _LIMIT_SAVED[0]
    wanted = [saved] + list(_LIMIT_USERS.values())
    config.recompile_limit = max(w[0] for w in wanted)
    config.accumulated_recompile_limit = max(w[1] for w in wanted)


# ------------------------------------------------------------------------------------------- owned compiles


def _forward_to(target):  # the template of every entry point: its code object is copied per owner
    def entry(*args, **kwargs):
        return target(*args, **kwargs)

    return entry


def _module_entry(module, *args, **kwargs):  # the template for a compiled module region (nn.Module.compile's job)
    return module._call_impl(*args, **kwargs)


def _class_forward_entry(module, *args, **kwargs):  # the template for a module's own forward, below its hooks
    return type(module).forward(module, *args, **kwargs)


class OwnedCompiler:
    """``torch.compile`` for one owner (a compile feature's handle), whose graphs `drop()` removes again without
    touching any other compiled graph of the process.

    Why: Dynamo keeps compiled graphs per code object, so two pipelines of one class compiled in one process
    share the cache of their ``forward``; ``torch._dynamo.reset()`` drops everyone's. Here every compiled
    callable enters through a code object of this owner's own (a copy of a one-line trampoline), so Dynamo files
    the graphs it traces from there under that code object: `drop()` resets exactly those. Frames Dynamo
    converts below a graph break run on shared code objects (a block's ``forward``); where only this owner's
    graphs are on one it is reset too, and where another owner's are as well, this owner's entries are
    invalidated (Dynamo's own treatment of an entry whose guarded object died; `_drop_shared`).

        compiler = OwnedCompiler()
        fast = compiler.compile(model.forward, dynamic=False, backend="inductor")
        compiler.compile_region(block, dynamic=False)     # nn.Module.compile, on an owned entry
        compiler.drop()                                   # those graphs gone, nobody else's
    """

    def __init__(self) -> None:
        self._codes: list[types.CodeType] = []
        self._regions: list[torch.nn.Module] = []
        self._region_entries: dict[tuple, Callable] = {}
        self.shared_reset = 0  # shared code objects reset because only this owner's graphs were on them
        self.shared_dropped = 0  # this owner's entries invalidated where another owner's graphs stay

    def _own_code(self, template: Callable, name: str) -> types.CodeType:
        code = template.__code__.replace(co_name=name)
        if code is template.__code__:  # pragma: no cover - CPython always copies; a shared code would leak
            raise TorchPrivateAPIError("expected code.replace() to make a new code object, got the same one")
        self._codes.append(code)
        return code

    def compile(self, fn: Callable, **compile_kwargs: Any) -> Callable:
        """``torch.compile(fn, **compile_kwargs)`` entered through this owner's own code object."""
        check_torch_version()
        inner = _forward_to(fn)
        code = self._own_code(inner, f"xstage_compiled_{getattr(fn, '__name__', 'fn')}")
        entry = types.FunctionType(code, inner.__globals__, code.co_name, None, inner.__closure__)
        return torch.compile(entry, **compile_kwargs)

    def compile_region(self, module: torch.nn.Module, **compile_kwargs: Any) -> None:
        """What ``module.compile(**compile_kwargs)`` does (calls of `module` run compiled), on an entry this owner
        owns; modules of one class share one entry (and so their graphs), as regional compile wants."""
        check_torch_version()
        key = (type(module), tuple(sorted((k, repr(v)) for k, v in compile_kwargs.items())))
        compiled = self._region_entries.get(key)
        if compiled is None:
            code = self._own_code(_module_entry, f"xstage_compiled_{type(module).__name__}")
            entry = types.FunctionType(code, _module_entry.__globals__, code.co_name)
            compiled = self._region_entries[key] = torch.compile(entry, **compile_kwargs)
        # nn.Module.__call__ runs this instance attribute instead of _call_impl when set (nn.Module.compile's slot).
        module._compiled_call_impl = functools.partial(compiled, module)
        self._regions.append(module)

    def compile_class_forward(self, module: torch.nn.Module, **compile_kwargs: Any) -> Callable:
        """`module`'s class forward (not the hooks on its instance) compiled on an entry this owner owns, bound to
        `module`; modules of one class share the entry and its graphs. For a forward called from inside a hook that
        stays out of the graphs (a step cache's)."""
        check_torch_version()
        key = ("forward", type(module), tuple(sorted((k, repr(v)) for k, v in compile_kwargs.items())))
        compiled = self._region_entries.get(key)
        if compiled is None:
            code = self._own_code(_class_forward_entry, f"xstage_compiled_{type(module).__name__}_forward")
            entry = types.FunctionType(code, _class_forward_entry.__globals__, code.co_name)
            compiled = self._region_entries[key] = torch.compile(entry, **compile_kwargs)
        return functools.partial(compiled, module)

    def drop(self) -> None:
        """Uncompile the regions and drop every graph this owner compiled (idempotent)."""
        for module in self._regions:
            vars(module).pop("_compiled_call_impl", None)  # the class default (None): eager again
        self._regions.clear()
        self._region_entries.clear()
        if not self._codes:
            return
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

        reset_code = _private(torch._C._dynamo.eval_frame, "reset_code", "torch._C._dynamo.eval_frame.reset_code")
        own = {id(code): code for code in self._codes}
        mine = [e for code in self._codes for e in entries(code)]
        # The backends of this owner's compiles, held (not just their ids) while the entries are sorted.
        backends = {id(e.backend): e.backend for e in mine if hasattr(e, "backend")}
        shared = self._shared_entries(convert_frame, entries, backends, own) if backends else {}
        dropped = mine + [e for listed in shared.values() for e in listed[0]]
        out_codes = [e.code for e in dropped if getattr(e, "code", None) is not None]
        managers = {id(e.guard_manager) for e in dropped}
        for code, (entries_of_mine, others) in shared.items():
            if not others:
                reset_code(code)
                self.shared_reset += 1
            else:
                self.shared_dropped += _invalidate(entries_of_mine)
        for code in self._codes:
            reset_code(code)
        self._codes.clear()
        del mine, shared, dropped
        # What Dynamo keeps beside the cache entries; its layout is torch's own, so a torch that lays it out
        # otherwise keeps those bytes (logged once) and loses nothing else.
        _best_effort("its guard finalizers", _detach_guard_finalizers, managers)
        _best_effort("the globals it installed", _remove_installed_globals, out_codes)
        _best_effort("its backends", _forget_backends, backends)

    @staticmethod
    def _shared_entries(convert_frame: Any, entries: Callable, backends: dict, own: dict) -> dict:
        """{code: (this owner's entries, other live entries)} for the code objects this owner does not own that
        hold its graphs (frames Dynamo converted below a graph break). `drop` resets a code object holding no
        one else's live entry (``shared_reset``) and elsewhere invalidates this owner's (``shared_dropped``): they
        keep no graph and never match, but stay in the list, where Dynamo counts them against that code
        object's recompile limit."""
        from torch._dynamo.guards import DeletedGuardManagerWrapper

        found = {}
        for ref in list(convert_frame.input_codes.seen):
            code = ref()
            if code is None or id(code) in own:
                continue
            listed = entries(code)
            mine = [e for e in listed if id(getattr(e, "backend", None)) in backends]
            if mine:
                found[code] = (mine, [e for e in listed if e not in mine and not isinstance(
                    getattr(e, "guard_manager", None), DeletedGuardManagerWrapper)])
        return found


@functools.cache
def _warn_once(what: str, error: str) -> None:
    log.warning("dropping compiled graphs: torch %s keeps %s (%s); their memory stays until the process ends",
                torch.__version__, what, error)


def _best_effort(what: str, fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except (AttributeError, ImportError, KeyError, TypeError) as exc:
        _warn_once(what, f"{type(exc).__name__}: {exc}")


def _invalidate(entries: list) -> int:
    """Invalidate cache entries the way Dynamo does when a guarded object dies; returns how many."""
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    count = 0
    for entry in entries:
        state = getattr(getattr(entry, "guard_manager", None), "extra_state", None)
        if state is not None:
            state.invalidate(entry, DeletedGuardManagerWrapper("the xstage stack that compiled it restored"))
            count += 1
    return count


def _forget_backends(backends: dict) -> None:
    """Drop these backends from Dynamo's registry of the backends it has seen (``eval_frame.cached_backends``, by
    id, which only ``torch._dynamo.reset()`` clears): each compile's backend object stayed there."""
    from torch._dynamo import eval_frame

    registry = getattr(eval_frame, "cached_backends", None)
    if not isinstance(registry, dict):
        return
    for key in [k for k, v in registry.items() if id(v) in backends and backends[id(v)] is v]:
        del registry[key]


def _remove_installed_globals(out_codes: list) -> None:
    """Remove the globals Dynamo installed for these transformed code objects (``__compiled_fn_*`` holding the
    graphs, ``__resume_at_*``) from the module dicts of the frames they came from.

    Why: Dynamo removes them when a transformed code object dies (``CleanupManager``), but the transformed code
    stays referenced after its cache entry is reset, even by ``torch._dynamo.reset()``: each dropped compile
    left its graphs (and their fake tensors) in a module's globals, about 1.5 MiB a round on the tiny NucleusMoE."""
    from torch._dynamo.utils import CleanupManager, ExactWeakKeyDictionary

    manager = CleanupManager.instance
    for code in out_codes:
        hooks = manager.values.get(id(code))
        if hooks is None or manager.refs.get(id(code), lambda: None)() is not code:
            continue
        for hook in hooks:
            if hook.name in hook.scope:
                hook()
        ExactWeakKeyDictionary._remove_id(manager, id(code))


def _detach_guard_finalizers(managers: set[int]) -> None:
    """Detach the finalizers Dynamo registered for the entries whose guard managers are `managers` (ids).

    Why: compiling an entry registers ``weakref.finalize(obj, CheckFunctionManager.invalidate)`` on each object
    its guards match by identity (a module, a parameter); the finalizer lives until that object dies and holds the
    entry's guards and fake tensors. A pipeline that outlives its compiled graphs (restored, then compiled again)
    kept every round's: 4-8 MiB a round on the tiny NucleusMoE, with ``torch._dynamo.reset()`` as well."""
    import weakref

    from torch._dynamo.guards import CheckFunctionManager

    if not managers:
        return
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        owner = getattr(getattr(info.func, "func", None), "__self__", None)
        if isinstance(owner, CheckFunctionManager) and id(getattr(owner, "guard_manager", None)) in managers:
            finalizer.detach()


def cache_entries(fn_or_code: Any) -> list:
    """Dynamo's cache entries on a function's (or code object's) code: tests count what a compile left."""
    from torch._dynamo import eval_frame

    code = fn_or_code if isinstance(fn_or_code, types.CodeType) else fn_or_code.__code__
    return list(_private(eval_frame, "_debug_get_cache_entry_list",
                         "torch._dynamo.eval_frame._debug_get_cache_entry_list")(code))


# ------------------------------------------------------------------------------------------- CUDA and memory


def raw_stream_getter(device_index: int) -> Callable[[], int]:
    """A callable returning the device's current stream as an int (``torch._C._cuda_getCurrentRawStream``), or
    the public route (a stream object's handle) where this torch lacks it."""
    check_torch_version()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return lambda: torch.cuda.current_stream(device_index).cuda_stream
    return functools.partial(raw, device_index)


def storage_from_data_pointer(ptr: int, device: torch.device, nbytes: int) -> Any:
    """A non-owning storage of `nbytes` at device address `ptr` (``torch._C._construct_storage_from_data_pointer``,
    the storage Inductor's CUDA-graph trees build)."""
    make = _private(torch._C, "_construct_storage_from_data_pointer",
                    "torch._C._construct_storage_from_data_pointer")
    return make(ptr, device, nbytes)


def symmetric_memory() -> types.ModuleType:
    """``torch.distributed._symmetric_memory`` (``empty``, ``rendezvous``, ``get_backend``)."""
    check_torch_version()
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


# ------------------------------------------------------------------------------------------- FP8 GEMMs


def inductor_config_restorer() -> Callable[[], None]:
    """A snapshot of ``torch._inductor.config`` now -> a callable that puts it back (every setting)."""
    check_torch_version()
    import torch._inductor.config as inductor_config

    saved = _private(inductor_config, "save_config", "torch._inductor.config.save_config")()
    load = _private(inductor_config, "load_config", "torch._inductor.config.load_config")
    return lambda: load(saved)


def has_scaled_grouped_mm() -> bool:
    """Whether this torch (in the tested range) has ``torch._scaled_grouped_mm``."""
    try:
        check_torch_version()
    except TorchPrivateAPIError:
        return False
    return getattr(torch, "_scaled_grouped_mm", None) is not None


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, a_descale: torch.Tensor, b_descale: torch.Tensor, *,
                      offsets: torch.Tensor, out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_grouped_mm``: a (M, K) e4m3 row-major, b (G, K, N) e4m3 column-major, a_descale (M,) and
    b_descale (G, N) fp32, offsets (G,) int32 group ends -> (M, N) in out_dtype: row i of group g is
    ``(a[i] * a_descale[i]) @ (b[g] * b_descale[g])``."""
    op = _private(torch, "_scaled_grouped_mm", "torch._scaled_grouped_mm")
    return op(a, b, a_descale, b_descale, offs=offsets, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              bias: torch.Tensor | None, out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_mm``, the call torchao's row-wise float8 linear layer makes: a (M, K) e4m3 row-major, b (K, N)
    e4m3 column-major, scale_a (M, 1) and scale_b (1, N) fp32 -> (M, N) in out_dtype, ``(a * scale_a) @ (b *
    scale_b) + bias``."""
    op = _private(torch, "_scaled_mm", "torch._scaled_mm")
    return op(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
