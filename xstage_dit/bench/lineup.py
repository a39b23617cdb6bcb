"""The run order of the end-to-end benchmark's contenders (`make_contenders`): every contender module's
classes by name."""

from __future__ import annotations

from xstage_dit.bench.contender import Contender
from xstage_dit.bench.contenders import (DiffusersCP, PlainDiffusers, PlainDiffusersRepeat, XStage, XStageCFGBatch,
                                         XStageServed)
from xstage_dit.bench.fp8_contenders import (PlainDiffusersFp8, XStageFp8, XStageFp8Attention,
                                             XStageFp8AttentionServed, XStageFp8Served)
from xstage_dit.bench.options import OUR_FAMILIES
from xstage_dit.bench.xfuser_stack import XFuserRunner, XFuserUSP


def make_contenders(names: list[str], with_compile: bool, world_size: int = 1, rounds: int = 1,
                    serve=None, compile_also: tuple[str, ...] = (), expand: dict | None = None,
                    with_eager: bool = True) -> list[Contender]:
    """Run order: diffusers and xstage eager (the baseline leading), then their compiled variants, then the
    xstage contenders compiled in each `compile_also` mode (``<name>+compile:<mode>``), then the other
    reversible stacks, then each irreversible contender with its compiled variant (they leave the pipeline
    modified). With ``rounds`` >= 2 the eager group is interleaved instead, so no diffusers-repeat.
    expand: a name standing for several contenders -> their (name, factory(compile)) pairs (the step caches'
    variants, `cache_contenders.cache_entries`), which run with the other reversible stacks. with_eager False
    (--compiled-only): the eager variants are listed as skipped (no diffusers-repeat)."""
    factories = {
        "diffusers": lambda c: PlainDiffusers(c),
        "xstage-serial": lambda c: XStage(c, "serial"),
        "xstage-calibrated": lambda c: XStage(c, "auto"),
        "xstage-cfgbatch": lambda c: XStageCFGBatch(c),
        "xstage-served": lambda c: XStageServed(c, serve),
        "diffusers-fp8": lambda c: PlainDiffusersFp8(c),
        "xstage-fp8": lambda c: XStageFp8(c),
        "xstage-fp8-served": lambda c: XStageFp8Served(c, serve),
        "xstage-fp8-attn": lambda c: XStageFp8Attention(c),
        "xstage-fp8-attn-served": lambda c: XStageFp8AttentionServed(c, serve),
        "xfuser-usp": lambda c: XFuserUSP(c, world_size),
        "xfuser-runner": lambda c: XFuserRunner(c, world_size),
        "diffusers-cp": lambda c: DiffusersCP(c),
    }
    expand = expand or {}
    for name, entries in expand.items():
        factories.update(entries)
    names = [entry for n in names for entry in ([e for e, _ in expand[n]] if n in expand else [n])]
    eager = [factories[n](False) for n in names]
    compiled = [factories[n](True) for n in names]
    # Other stacks after ours: importing xfuser patches modules and global state, so it must not run
    # before a diffusers/xstage measurement.
    ours = [c for c in eager + compiled if c.family in OUR_FAMILIES]
    if with_eager and rounds == 1 and "diffusers" in names and any(n.startswith("xstage") and n in OUR_FAMILIES
                                                                   for n in names):
        # The baseline once more right after the eager xstage contenders (A/B/A): its drift bounds the noise.
        last_eager = max(i for i, c in enumerate(ours) if not c.compile)
        ours.insert(last_eager + 1, PlainDiffusersRepeat(False))
    for mode in compile_also if with_compile else ():
        # the baselines compile the way their users do: --compile's mode alone
        for name in [n for n, e in zip(names, eager) if e.ours]:
            variant = factories[name](True)
            variant.compile_mode = mode
            ours.append(variant)
    ordered = ours + [c for c in eager + compiled if c not in ours and not c.irreversible]
    for e, c in zip(eager, compiled):
        if e.irreversible and e not in ordered:
            ordered += [e, c]
    if not with_compile:
        for c in compiled:
            c.info["skip_reason"] = "torch.compile variants not requested (--compile)"
    if not with_eager:
        for c in eager:
            c.info["skip_reason"] = "eager variants not requested (--compiled-only)"
    return ordered
