"""What `parallelize` does so that ranks never hang on each other (issue 18).

Built on `xstage_dit.comm.agreement`:

- `setup_facts(config, transformers)`: the configuration, model classes and weight shapes every rank
  must agree on; `parallelize` compares them with one all-gather before any other collective.
- `CollectiveSafetyHook`: outermost sequence-parallel hook on each transformer. Before each forward
  it compares a fingerprint of the inputs (latents, timestep, prompt embeddings...) over the sp
  group, so ranks whose generators were seeded differently fail on every rank with `RanksDisagree`
  instead of silently returning an image that matches no single-process one (eager only: a
  ``torch.compile``'d forward skips it); the LoRA adapters and scales each rank runs with are compared with
  them (`features.lora`). An exception inside the forward is published to the peers
  (`agreement.publish_failure`), which stop waiting in their collectives and raise the same error. The
  peers' GPUs, which may sit in a device barrier of a fused op, are released by the barrier watchdog
  (`xstage_dit.comm.watchdog`); the hook raises the failure that watchdog has seen (a peer's, or a barrier
  timeout) before the input check and at the forward's end: a flag read, no CUDA sync, no store round trip.
- `check_dispatching(processor, where)`: refuses a processor whose ``__call__`` was written outside
  diffusers and xstage (a subclass of ``FluxAttnProcessor`` calling SDPA itself would attend only its
  own shard): it names the class. A processor that does route through ``dispatch_attention_fn``
  declares it with the documented class attribute ``_xstage_dispatches = True``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Callable

import torch
from diffusers.hooks import HookRegistry, ModelHook

from xstage_dit.comm import agreement, watchdog
from xstage_dit.features.context import chained
from xstage_dit.features.instance_attr import remove_hook

DISPATCHES_ATTR = "_xstage_dispatches"
_HOOK = "xstage-safety"
_TRUSTED_MODULES = ("diffusers.", "xstage_dit.")


def setup_facts(config, transformers: list[torch.nn.Module]) -> dict[str, Any]:
    """What every rank must pass alike: the config, each transformer's class and a digest of its
    parameter names, shapes and dtypes (the values are not compared: loading is the user's)."""
    shapes = []
    for t in transformers:
        rows = [(n, tuple(p.shape), str(p.dtype)) for n, p in t.named_parameters()]
        shapes.append(hashlib.sha1(repr(rows).encode()).hexdigest()[:16])
    return {
        "config": config,
        "model": tuple(f"{type(t).__module__}.{type(t).__qualname__}" for t in transformers),
        "weights shape": tuple(shapes),
    }


def check_dispatching(processor: Any, where: str) -> None:
    """ValueError naming the class when `processor`'s ``__call__`` is user code not declared to dispatch."""
    cls = type(processor)
    if getattr(cls, DISPATCHES_ATTR, False):
        return
    owner = next((c for c in cls.__mro__ if "__call__" in c.__dict__), cls)
    if owner.__module__.startswith(_TRUSTED_MODULES):
        return
    bases = ", ".join(b.__name__ for b in cls.__mro__[1:] if b is not object)
    raise ValueError(
        f"expected attention processors whose attention goes through diffusers' dispatch_attention_fn, got "
        f"{cls.__qualname__} (from {owner.__module__}, based on {bases or 'object'}) in {where}: its own __call__ may "
        f"call SDPA directly, which under sequence parallelism attends only this rank's shard. Use a diffusers "
        f"processor, or set {cls.__qualname__}.{DISPATCHES_ATTR} = True if it calls dispatch_attention_fn"
    )


class CollectiveSafetyHook(ModelHook):
    """Input agreement before each forward, and a failure inside it made every rank's failure."""

    def __init__(self, group, model_cls: type, check_inputs: bool = True,
                 state: Callable[[], dict] | None = None) -> None:
        super().__init__()
        self.group = group
        self.check_inputs = check_inputs
        self.state = state  # more facts the ranks compare with the inputs (the LoRA adapters and scales)
        self.names = list(inspect.signature(model_cls.forward).parameters)[1:]
        self.what = model_cls.__name__

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        if torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        if self.check_inputs:
            named = dict(zip(self.names, args))
            named.update({k: v for k, v in kwargs.items() if k != "return_dict"})
            facts = {f"inputs ({name})": fp for name, fp in agreement.fingerprint(named).items()}
            facts.update(self.state() if self.state is not None else {})
            # The fingerprint's host sync waited for this rank's GPU, which a peer's failure released: raise it
            # here, before a blocking all-gather the failed peer never joins. A peer that failed after the last
            # collective of the previous forward (nothing of ours waited on it) is seen in the store: one round trip,
            # beside the all-gather it saves from hanging.
            watchdog.raise_if_failed()
            failure = agreement.published_failure()
            if failure is not None:
                raise failure
            agreement.check_agreement(facts, self.group, what=f"{self.what} forward")
        else:
            watchdog.raise_if_failed()
        try:
            out = forward(*args, **kwargs)
            # A peer failed while this rank's fused ops ran (their barriers were released: the output is garbage).
            watchdog.raise_if_failed()
            return out
        except (agreement.RankFailed, agreement.RanksDisagree):
            raise
        except Exception as exc:
            raise agreement.publish_failure(exc, self.group, what=f"{self.what} forward") from exc


def _lora_state(ctx) -> dict:
    """The adapters and scales this rank runs with (`features.lora`, which applies after this feature: read from
    the context at each forward), so ranks holding other adapters fail together instead of mixing them."""
    return {} if ctx.lora is None else {"lora adapters": ctx.lora.fingerprint()}


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's collective safety at sp > 1: a `CollectiveSafetyHook` on each transformer, outside the
    sequence hooks (it sees the whole inputs) and inside the CFG hook (one branch's inputs)."""
    group = ctx.groups.sp_group
    if group is None or config.sp <= 1:
        return None
    undos = []
    for transformer in ctx.transformers:
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(CollectiveSafetyHook(group, type(transformer), config.check_inputs,
                                                    functools.partial(_lora_state, ctx)), _HOOK)
        undos.append(functools.partial(remove_hook, transformer, _HOOK))
    return chained(undos)
