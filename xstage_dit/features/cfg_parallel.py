"""CFG parallelism (degree 2): the conditional and unconditional branches on two rank groups.

Two pipeline styles exist in diffusers 0.42 and both are handled at the transformer's entry/exit,
by a hook registered outermost (outside the sequence-parallel hooks):

- **batched** (HiDream): one transformer call on a ``(uncond, cond)`` batch. The hook gives the first
  half of the batch to cfg group 0 and the second half to group 1 and gathers the outputs back.
- **paired** (FLUX with ``true_cfg_scale``, Wan, NucleusMoE): two calls per step, cond then uncond,
  with the same latents. The first call of a pair only records its inputs and returns a placeholder
  tensor; the second call runs cond on group 0 and uncond on group 1 at the same time, exchanges the
  two outputs and writes the cond result into the placeholder in place (the pipeline holds that very
  tensor and reads it only after the second call). The first pair of each input shape runs cond on
  both groups at the first call, to learn the output shape: later pairs are fully parallel.

Calls that do not come in pairs (guidance off, or a different pipeline loop) raise RuntimeError at
the next transformer call or before the VAE decodes, never silently: CFG parallel needs guidance on.

Each forward runs under diffusers' cache context of the branch it computes ("cond" on group 0 even though
the pipeline makes that call inside its "uncond" context; "uncond" on group 1, also where the pipeline names
no context), so a cache hook's per-branch state (`features.step_cache`) holds one branch's values, as in one
process (the names: `features.context`; ``PAIR_CONTEXT``, a forward on a batch of both, is `cfg_batch`'s).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from xstage_dit import _diffusers_private as private
from xstage_dit.families.sharding import all_gather_dim0
from xstage_dit.features.context import COND_CONTEXT, UNCOND_CONTEXT, chained
from xstage_dit.features.instance_attr import remove_hook, set_on_instance

log = logging.getLogger(__name__)

_HOOK = "xstage-cfg"


def _sample(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    return output.sample


def _wrap_like(output: Any, sample: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return sample
    if isinstance(output, (tuple, list)):
        return type(output)([sample, *output[1:]])
    return Transformer2DModelOutput(sample=sample)


def _exchange(mine: torch.Tensor, group, cfg_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(branch 0 output, branch 1 output) on both cfg ranks."""
    out = all_gather_dim0(mine.contiguous().unsqueeze(0), group)
    return out[0], out[1]


class BatchedCFGHook(ModelHook):
    """Splits the (uncond, cond) batch across the two cfg groups and gathers the outputs."""

    def __init__(self, group, cfg_rank: int, batch_dims: dict[str, int], model_cls: type) -> None:
        super().__init__()
        self.stats = {"split_calls": 0}
        self.group = group
        self.cfg_rank = cfg_rank
        self.batch_dims = batch_dims
        import inspect

        self.names = list(inspect.signature(model_cls.forward).parameters)[1:]

    def _half(self, name: str, value: Any) -> Any:
        dim = self.batch_dims[name]
        size = value.shape[dim] if isinstance(value, torch.Tensor) else len(value)
        if size % 2 != 0:
            raise RuntimeError(
                f"CFG parallel (batched) expects an even (uncond, cond) batch in {name!r}, got {size} along dim {dim}"
            )
        half = size // 2
        if isinstance(value, torch.Tensor):
            return value.narrow(dim, self.cfg_rank * half, half)
        return value[self.cfg_rank * half : (self.cfg_rank + 1) * half]

    def pre_forward(self, module, *args, **kwargs):
        args = list(args)
        for i, value in enumerate(args):
            name = self.names[i] if i < len(self.names) else None
            if name in self.batch_dims and value is not None:
                args[i] = self._half(name, value)
        for name, value in kwargs.items():
            if name in self.batch_dims and value is not None:
                kwargs[name] = self._half(name, value)
        return tuple(args), kwargs

    def post_forward(self, module, output):
        self.stats["split_calls"] += 1
        first, second = _exchange(_sample(output), self.group, self.cfg_rank)
        return _wrap_like(output, torch.cat([first, second], dim=0))


class PairedCFGHook(ModelHook):
    """Runs the cond and uncond calls of a step concurrently on the two cfg groups (see module doc)."""

    outside_compile = True  # its pairing state is Python's: apply_compile compiles what it calls, not it

    _is_stateful = True  # so diffusers' cache_context() tells us "cond" / "uncond"

    def __init__(self, group, cfg_rank: int) -> None:
        super().__init__()
        self.group = group
        self.cfg_rank = cfg_rank
        self.tracker = private.context_tracker()
        self.pending: dict | None = None
        self.shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        # pairs run concurrently on the two groups / pairs whose cond ran at the first call (new shape)
        self.stats = {"parallel_pairs": 0, "first_pairs": 0}

    def reset_state(self, module):
        self.pending = None
        return module

    @staticmethod
    def _key(args, kwargs) -> tuple:
        items = list(enumerate(args)) + sorted(kwargs.items(), key=lambda kv: str(kv[0]))
        return tuple((k, tuple(v.shape), v.dtype) for k, v in items if isinstance(v, torch.Tensor))

    @staticmethod
    def _hidden(args, kwargs):
        return kwargs.get("hidden_states", args[0] if args else None)

    def check_no_pending(self, where: str) -> None:
        if self.pending is not None:
            self.pending = None
            raise RuntimeError(
                f"CFG parallel: a conditional transformer call had no unconditional partner before {where}; "
                "cfg=2 needs classifier-free guidance on (e.g. guidance_scale > 1, or true_cfg_scale > 1 with a "
                "negative prompt for FLUX)"
            )

    def new_forward(self, module, *args, **kwargs):
        forward = self.fn_ref.original_forward
        context = private.context_name(self.tracker)
        if self.pending is None:
            if context not in (None, "cond"):
                raise RuntimeError(f"CFG parallel: expected the conditional call first, got context {context!r}")
            key = self._key(args, kwargs)
            known = self.shapes.get(key)
            if known is None:
                # First pair of this shape: run cond now (both groups) to learn the output shape.
                with private.branch_context(module, COND_CONTEXT, self.tracker):
                    output = forward(*args, **kwargs)
                sample = _sample(output)
                self.shapes[key] = (sample.shape, sample.dtype)
                self.pending = {"args": args, "kwargs": kwargs, "placeholder": None, "done": sample}
                return output
            shape, dtype = known
            hidden = self._hidden(args, kwargs)
            placeholder = torch.full(shape, float("nan"), dtype=dtype, device=hidden.device)
            self.pending = {"args": args, "kwargs": kwargs, "placeholder": placeholder, "done": None,
                            "context": private.current_context(self.tracker)}
            if kwargs.get("return_dict", True) is False:
                return (placeholder,)
            return Transformer2DModelOutput(sample=placeholder)

        pending = self.pending
        partner = self._hidden(pending["args"], pending["kwargs"]) is self._hidden(args, kwargs)
        if context == "cond" or not partner:
            self.check_no_pending("the next conditional call")
        self.pending = None
        if pending["done"] is not None:
            self.stats["first_pairs"] += 1
            with private.branch_context(module, UNCOND_CONTEXT, self.tracker):
                return forward(*args, **kwargs)  # cond already computed at the first call
        self.stats["parallel_pairs"] += 1
        if self.cfg_rank == 0:  # the cond call's inputs, under the cond call's context
            with private.branch_context(module, COND_CONTEXT, self.tracker, like=pending["context"]):
                output = forward(*pending["args"], **pending["kwargs"])
        else:
            with private.branch_context(module, UNCOND_CONTEXT, self.tracker):
                output = forward(*args, **kwargs)
        cond, uncond = _exchange(_sample(output), self.group, self.cfg_rank)
        pending["placeholder"].copy_(cond)
        return _wrap_like(output, uncond)


def apply(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's CFG parallelism at cfg=2: the plan's hook (batched or paired) on each transformer, registered
    after the sequence hooks and collective safety (outermost: it splits before them); the hooks go to
    ``ctx.cfg_hooks``."""
    if config.cfg <= 1:
        return None
    groups, undos = ctx.groups, []
    for transformer, plan in zip(ctx.transformers, ctx.plans):
        if plan.cfg == "batched":
            hook = BatchedCFGHook(groups.cfg_group, groups.cfg_rank, plan.cfg_batch_dims, type(transformer))
        else:
            hook = PairedCFGHook(groups.cfg_group, groups.cfg_rank)
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(hook, _HOOK)
        ctx.cfg_hooks.append(hook)
        undos.append(functools.partial(remove_hook, transformer, _HOOK))
    return chained(undos)


def apply_pair_check(pipe, config, ctx) -> Callable[[], None] | None:
    """The stack's CFG pair check: where a hook of ``ctx.cfg_hooks`` pairs a step's two calls (paired CFG
    parallel, CFG batch: each has ``check_no_pending``), a conditional call left without its partner fails
    before the VAE decodes it."""
    paired = [h for h in ctx.cfg_hooks if hasattr(h, "check_no_pending")]
    vae = getattr(pipe, "vae", None)
    if not paired or vae is None or not hasattr(vae, "decode"):
        return None
    decode = vae.decode

    def checked_decode(*args, **kwargs):
        for hook in paired:
            hook.check_no_pending("the VAE decode")
        return decode(*args, **kwargs)

    return set_on_instance(vae, "decode", checked_decode)
