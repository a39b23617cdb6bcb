"""The ONLY module that touches private diffusers API (behind a version check).

What we use and why:

- ``diffusers.models._modeling_parallel.ContextParallelInput / ContextParallelOutput``: the entries of
  the ``_cp_plan`` class attributes that diffusers ships (FLUX.1, FLUX.2, QwenImage, Wan, LTX, ...).
  We read those plans (and write ours in the same vocabulary) instead of re-describing each model.
- ``AttentionBackendName`` / ``_AttentionBackendRegistry`` in ``diffusers.models.attention_dispatch``:
  registering the ``xstage_ulysses`` attention backend, so every processor that calls
  ``dispatch_attention_fn`` reaches our Ulysses op with its ``_parallel_config``; the member and its
  registration are removed again when the last sequence-parallel user restores (`ProcessWide`).
- ``diffusers.hooks.hooks.StateManager``: the only way a hook learns the ``cache_context`` name
  ("cond" / "uncond") that pipelines set around their guidance branches (CFG parallel); ``CacheContext`` and
  ``_set_cache_context``: the CFG hooks run each forward under the name of the branch it computes (`branch_context`).
- The step caches' hook names (``_FBC_LEADER_BLOCK_HOOK`` ...), their decision methods (First Block Cache's
  ``_should_compute_remaining_blocks``, TaylorSeer's ``_measure_should_compute``), the hooks' function
  references and ``_cache_config``: `features.step_cache` wraps diffusers' own caches (`cache_hook_points`).
- ``transformer_nucleusmoe_image._compute_text_seq_len_from_mask``: swapped for the same computation without
  its host-to-device copy (`text_seq_len_without_host_copy`, for `features.host_syncs`); the original is back
  when the last user restores.
- The pipelines' latent-layout methods (``_unpack_latents``, ``_unpack_latents_with_ids``, ``_prepare_latent_ids``,
  ``_unpatchify_latents``; `latent_layout`): the streamed previews decode a step's latents as the pipeline's own
  tail does (`families.latent_decode`), and these methods are that tail's first lines.

Tested with diffusers 0.42.x. Any other version fails with a clear message at `parallelize` time,
before any collective or GPU work.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import threading
from typing import Any, Callable, Iterator

import torch

SUPPORTED_DIFFUSERS = ("0.42.",)
XSTAGE_BACKEND = "xstage_ulysses"


def check_diffusers_version() -> str:
    """Return the diffusers version, or raise RuntimeError naming it if untested."""
    import diffusers

    version = diffusers.__version__
    if not version.startswith(SUPPORTED_DIFFUSERS):
        raise RuntimeError(
            f"expected diffusers {' or '.join(v + 'x' for v in SUPPORTED_DIFFUSERS)} (xstage_dit.features uses its "
            f"private context-parallel and attention-dispatch API), got diffusers {version}"
        )
    return version


LATENT_LAYOUT_METHODS = ("_unpack_latents", "_unpack_latents_with_ids", "_prepare_latent_ids", "_unpatchify_latents")


def latent_layout(pipe: Any, name: str) -> Callable[..., torch.Tensor]:
    """The pipeline's private latent-layout method `name` (one of `LATENT_LAYOUT_METHODS`), after the version check;
    AttributeError naming the pipeline class where it lacks it."""
    if name not in LATENT_LAYOUT_METHODS:
        raise ValueError(f"expected a latent-layout method in {', '.join(LATENT_LAYOUT_METHODS)}, got {name!r}")
    check_diffusers_version()
    method = getattr(pipe, name, None)
    if method is None:
        raise AttributeError(f"expected {type(pipe).__name__} to have diffusers' {name}, it has not")
    return method


def cp_types() -> tuple[type, type]:
    """(ContextParallelInput, ContextParallelOutput) of this diffusers."""
    check_diffusers_version()
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return ContextParallelInput, ContextParallelOutput


def shipped_cp_plan(model_cls: type) -> dict | None:
    """The ``_cp_plan`` diffusers ships on `model_cls`, or None."""
    return getattr(model_cls, "_cp_plan", None)


class ProcessWide:
    """A process-wide change held while any user holds it: the first `acquire` makes it (``make()`` returns its
    undo), the last release undoes it, so a restored pipeline leaves the process as it found it."""

    def __init__(self, make: Callable[[], Callable[[], None]]) -> None:
        self._make = make
        self._undo: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self.users = 0

    def acquire(self) -> Callable[[], None]:
        """Hold the change; returns the release (idempotent)."""
        with self._lock:
            if self.users == 0:
                self._undo = self._make()
            self.users += 1
        done = [False]

        def release() -> None:
            with self._lock:
                if done[0]:
                    return
                done[0] = True
                self.users -= 1
                if self.users == 0 and self._undo is not None:
                    undo, self._undo = self._undo, None
                    undo()

        return release


def _add_backend(fn: Callable[..., Any]) -> Callable[[], None]:
    """Add the ``xstage_ulysses`` member to ``AttentionBackendName`` (a closed ``str`` Enum: the member is built
    the way ``Enum`` builds its own, the registry being keyed by members) and register `fn` under it. Returns
    the undo: the registration and, where this added it, the member gone from every Enum table."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as registry

    member = AttentionBackendName._value2member_map_.get(XSTAGE_BACKEND)
    added = member is None
    if added:
        member = str.__new__(AttentionBackendName, XSTAGE_BACKEND)
        member._name_ = XSTAGE_BACKEND.upper()
        member._value_ = XSTAGE_BACKEND
        # Keep every Enum lookup table consistent: by value, by name, and iteration order.
        AttentionBackendName._value2member_map_[XSTAGE_BACKEND] = member
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._member_names_.append(member._name_)
    registry.register(member, constraints=[], supports_context_parallel=True)(fn)

    def undo() -> None:
        for table in (registry._backends, registry._constraints, registry._supported_arg_names):
            table.pop(member, None)
        registry._supports_context_parallel.discard(XSTAGE_BACKEND)
        if added:
            AttentionBackendName._value2member_map_.pop(XSTAGE_BACKEND, None)
            AttentionBackendName._member_map_.pop(member._name_, None)
            if member._name_ in AttentionBackendName._member_names_:
                AttentionBackendName._member_names_.remove(member._name_)

    return undo


_BACKEND: list[ProcessWide] = []  # the one holder of the backend registration (made with the first fn)


def register_attention_backend(fn: Callable[..., Any]) -> tuple[Any, Callable[[], None]]:
    """Register `fn` as diffusers attention backend ``xstage_ulysses`` while the returned release has not run;
    returns (its enum member, release). The member and the registration go when the last user releases."""
    check_diffusers_version()
    from diffusers.models.attention_dispatch import AttentionBackendName

    if not _BACKEND:
        _BACKEND.append(ProcessWide(lambda: _add_backend(fn)))
    release = _BACKEND[0].acquire()
    return AttentionBackendName._value2member_map_[XSTAGE_BACKEND], release


def is_backend_member(value: Any) -> bool:
    return isinstance(value, enum.Enum) and getattr(value, "value", None) == XSTAGE_BACKEND


class _NoState:
    def reset(self, *args, **kwargs) -> None:
        pass


def context_tracker() -> Any:
    """An object on which diffusers' ``cache_context(name)`` records the current context.

    Put it as an attribute of a hook whose ``_is_stateful`` is True; read it with `context_name`.
    """
    check_diffusers_version()
    from diffusers.hooks.hooks import StateManager

    return StateManager(_NoState)


def context_name(tracker: Any) -> str | None:
    """The ``cache_context`` name active now ("cond", "uncond", ...) or None outside any context."""
    ctx = getattr(tracker, "_context", None)
    return None if ctx is None else ctx.name


@contextlib.contextmanager
def branch_context(module: torch.nn.Module, name: str, tracker: Any, like: Any = None) -> Iterator[None]:
    """Run under diffusers' cache context `name` on `module`'s hooks (the step fields of `like`, a context from
    `current_context`, or of the current one kept), then put the current one back. Nothing to do where the
    current context has that name already. `tracker`: a `context_tracker` on one of `module`'s stateful hooks."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    current = getattr(tracker, "_context", None)
    base = like if like is not None else current
    if current is not None and current.name == name and (like is None or like is current):
        yield
        return
    _set_cache_context(module, CacheContext(name) if base is None else dataclasses.replace(base, name=name))
    try:
        yield
    finally:
        _set_cache_context(module, current)


def current_context(tracker: Any) -> Any:
    """The cache context active now (diffusers' ``CacheContext``: name and step fields), or None."""
    return getattr(tracker, "_context", None)


# ------------------------------------------------------------- step caches (features/step_cache)
# diffusers' cache hooks (``transformer.enable_cache``) register under module-level private names and decide in
# private methods. The step cache finds the hooks by those names, wraps each one's forward through its
# HookFunctionReference (counted, outside torch.compile), replaces First Block Cache's decision with the ranks'
# group decision (and TaylorSeer's with a forced schedule), and hands MagCache each request's config.

def _cache_hook_names() -> dict[str, str]:
    """{hook name: method} of every cache hook `enable_cache` registers for the methods the step cache offers."""
    from diffusers.hooks.faster_cache import _FASTER_CACHE_BLOCK_HOOK, _FASTER_CACHE_DENOISER_HOOK
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK
    from diffusers.hooks.pyramid_attention_broadcast import _PYRAMID_ATTENTION_BROADCAST_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    return {_FBC_LEADER_BLOCK_HOOK: "fbcache", _FBC_BLOCK_HOOK: "fbcache", _TAYLORSEER_CACHE_HOOK: "taylorseer",
            _MAG_CACHE_LEADER_BLOCK_HOOK: "magcache", _MAG_CACHE_BLOCK_HOOK: "magcache",
            _PYRAMID_ATTENTION_BROADCAST_HOOK: "pab", _FASTER_CACHE_DENOISER_HOOK: "fastercache",
            _FASTER_CACHE_BLOCK_HOOK: "fastercache"}


def cache_hook_points(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, Any, Any]]:
    """(module path, module, hook name, hook, its HookFunctionReference) of every cache hook under `transformer`,
    in module order (a module with two, MagCache's one-block stack, inner first)."""
    check_diffusers_version()
    names = _cache_hook_names()
    found = []
    for path, module in transformer.named_modules():
        registry = vars(module).get("_diffusers_hook")
        if registry is None:
            continue
        for name, reference in zip(registry._hook_order, registry._fn_refs):
            if name in names:
                found.append((path, module, name, registry.hooks[name], reference))
    return found


def cache_blocks(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The repeated blocks diffusers' block caches hook, as they find them (its ``_ALL_TRANSFORMER_BLOCK_IDENTIFIERS``:
    the transformer's ModuleLists of those names, in order)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [(f"{name}.{i}", block) for name, child in transformer.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
            for i, block in enumerate(child)]


def is_fbc_head(name: str) -> bool:
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    return name == _FBC_LEADER_BLOCK_HOOK


def is_mag_head(name: str) -> bool:
    from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK

    return name == _MAG_CACHE_LEADER_BLOCK_HOOK


def is_taylorseer(name: str) -> bool:
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    return name == _TAYLORSEER_CACHE_HOOK


def replace_fbc_decision(hook: Any, decide: Callable[[str, torch.Tensor, torch.Tensor | None], bool]) -> Callable[[], None]:
    """First Block Cache's head `hook` decides through ``decide(context name, residual, previous residual)``
    instead of its private ``_should_compute_remaining_blocks`` (an instance attribute over the class's method:
    the residual of the call's context state's last computed step, None at its first); returns the undo."""
    if type(hook).__name__ != "FBCHeadBlockHook":
        raise ValueError(f"expected First Block Cache's FBCHeadBlockHook, got {type(hook).__name__}")
    manager = hook.state_manager

    @torch.compiler.disable
    def decision(residual: torch.Tensor) -> bool:
        return decide(manager.context.name, residual, manager.get_state().head_block_residual)

    hook._should_compute_remaining_blocks = decision
    return lambda: vars(hook).pop("_should_compute_remaining_blocks", None)


def force_taylorseer_schedule(hook: Any, every: int) -> Callable[[], None]:
    """TaylorSeer's `hook` computes at its steps 0, every, 2 * every, ... and predicts the others, instead of its
    warm-up and interval rule (its private ``_measure_should_compute``, which also advances the hook's step, wrapped);
    returns the undo."""
    if type(hook).__name__ != "TaylorSeerCacheHook":
        raise ValueError(f"expected TaylorSeer's TaylorSeerCacheHook, got {type(hook).__name__}")
    measure = hook._measure_should_compute

    @torch.compiler.disable
    def scheduled():
        _, state = measure()
        return state.current_step % every == 0, state

    hook._measure_should_compute = scheduled
    return lambda: vars(hook).pop("_measure_should_compute", None)


def set_mag_cache_config(hooks: list, config: Any) -> None:
    """Hand every MagCache hook among `hooks` the `MagCacheConfig` of the next call (its steps, its ratios)."""
    for hook in hooks:
        if type(hook).__name__ in ("MagCacheHeadHook", "MagCacheBlockHook"):
            hook.config = config


def check_no_cache(transformer: torch.nn.Module) -> None:
    """ValueError where a diffusers cache is enabled on `transformer` already (``enable_cache`` refuses a second)."""
    enabled = getattr(transformer, "_cache_config", None)
    if enabled is not None:
        raise ValueError(f"expected {type(transformer).__name__} without a diffusers cache, got "
                         f"{type(enabled).__name__} enabled: disable_cache() it first")


def modules_with_hooks(transformer: torch.nn.Module) -> set[int]:
    """The ids of the modules under `transformer` that hold a diffusers hook registry."""
    return {id(m) for m in transformer.modules() if "_diffusers_hook" in vars(m)}


def drop_empty_registries(transformer: torch.nn.Module, keep: set[int]) -> None:
    """Remove the empty hook registries under `transformer` except those of modules in `keep` (ids): what a
    diffusers ``apply_*`` that failed half-way left behind."""
    for module in transformer.modules():
        registry = vars(module).get("_diffusers_hook")
        if registry is not None and not registry.hooks and id(module) not in keep:
            del vars(module)["_diffusers_hook"]


def forget_cache_config(transformer: torch.nn.Module) -> None:
    """What ``disable_cache`` does besides removing the hooks (the step cache removes those itself, cleanly):
    the model's cache config cleared and its registries' cached child lists dropped."""
    transformer._cache_config = None
    for module in transformer.modules():
        registry = vars(module).get("_diffusers_hook")
        if registry is not None:
            registry._child_registries_cache = None


# ------------------------------------------------------------- meta-device construction of routed experts
# Used by xstage_dit/families/experts.py to build MoE transformers whose routed experts are never
# materialised (each rank then reads or creates only its own): it wraps the __init__ of diffusers' MoE
# expert classes for the duration of one construction.


@contextlib.contextmanager
def _patched_init(cls, wrap):
    original = cls.__dict__["__init__"]
    cls.__init__ = wrap(original)
    try:
        yield
    finally:
        cls.__init__ = original


@contextlib.contextmanager
def nucleus_meta_experts() -> Iterator[None]:
    """Build NucleusMoE's ``SwiGLUExperts`` on the meta device (its tensors are plain ``torch.empty``)."""
    from diffusers.models.transformers import transformer_nucleusmoe_image as mod

    def wrap(original):
        def __init__(self, *args, **kwargs):
            with torch.device("meta"):
                original(self, *args, **kwargs)

        return __init__

    with _patched_init(mod.SwiGLUExperts, wrap):
        yield


_HIDREAM_EXPERT_WIDTH: contextvars.ContextVar[int | None] = contextvars.ContextVar("hidream_expert_width", default=None)


@contextlib.contextmanager
def hidream_meta_experts() -> Iterator[None]:
    """Build the routed experts of HiDream's ``MOEFeedForwardSwiGLU`` on the meta device.

    Its shared expert and its routed experts are the same class; the routed ones are built with the
    layer's ``hidden_dim``, the shared one with ``hidden_dim // 2``, which is how they are told apart here.
    Meta construction draws no random numbers, so the other modules' weights do not depend on the sharding.
    """
    from diffusers.models.transformers import transformer_hidream_image as mod

    def wrap_moe(original):
        def __init__(self, dim, hidden_dim, *args, **kwargs):
            token = _HIDREAM_EXPERT_WIDTH.set(hidden_dim)
            try:
                original(self, dim, hidden_dim, *args, **kwargs)
            finally:
                _HIDREAM_EXPERT_WIDTH.reset(token)

        return __init__

    def wrap_ff(original):
        def __init__(self, dim, hidden_dim, *args, **kwargs):
            if _HIDREAM_EXPERT_WIDTH.get() == hidden_dim:
                token = _HIDREAM_EXPERT_WIDTH.set(None)  # nothing below a routed expert is one
                try:
                    with torch.device("meta"):
                        original(self, dim, hidden_dim, *args, **kwargs)
                finally:
                    _HIDREAM_EXPERT_WIDTH.reset(token)
            else:
                original(self, dim, hidden_dim, *args, **kwargs)

        return __init__

    with _patched_init(mod.MOEFeedForwardSwiGLU, wrap_moe), _patched_init(mod.HiDreamImageFeedForwardSwiGLU, wrap_ff):
        yield



# ------------------------------------------------------------- NucleusMoE's text length without a host copy
def _swap_text_len() -> Callable[[], None]:
    from diffusers.models.transformers import transformer_nucleusmoe_image as mod

    original = mod._compute_text_seq_len_from_mask
    mod._compute_text_seq_len_from_mask = _text_seq_len_on_device

    def undo() -> None:
        mod._compute_text_seq_len_from_mask = original

    return undo


_TEXT_LEN = ProcessWide(_swap_text_len)  # patched NucleusMoE transformers that rely on the swap


def _text_seq_len_on_device(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None):
    """diffusers 0.42's ``_compute_text_seq_len_from_mask`` with the fallback length made by a fill on the
    device instead of ``torch.as_tensor(text_seq_len, device=...)`` (a host copy that waits for the stream).
    Returns (text_seq_len, per-sample lengths (B,) int64 or None, the mask as bool or None)."""
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                         f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len}).")
    mask = encoder_hidden_states_mask.to(torch.bool)
    position_ids = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
    active_positions = torch.where(mask, position_ids, position_ids.new_zeros(()))
    whole = torch.full((), text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
    per_sample_len = torch.where(mask.any(dim=1), active_positions.max(dim=1).values + 1, whole)
    return text_seq_len, per_sample_len, mask


def text_seq_len_without_host_copy() -> Callable[[], None]:
    """Swap NucleusMoE's module-level text-length helper for `_text_seq_len_on_device` (same values; every
    NucleusMoE transformer of the process sees it while any patched one holds it). Returns the release; the
    original is back once the last holder released."""
    return _TEXT_LEN.acquire()
