"""The base of every end-to-end benchmark contender (check, apply, call, timed_module, restore).

The contenders themselves are in `contenders` (diffusers, xstage, diffusers' context parallelism) and
`xfuser_stack` (xDiT/xfuser)."""

from __future__ import annotations

import torch

from xstage_dit.bench.session import Bench
from xstage_dit.features.compile import parse_extras


class Contender:
    family = ""
    irreversible = False  # no way to undo it: runs after every reversible contender, marks the pipeline dirty
    compile_vae = True  # compiled variant: also the image VAE's decoder (what `serve` / `generate` compile)
    ours = False  # an xstage contender: its compiled variant takes --compile-guards (baselines compile as users do)

    def __init__(self, compile: bool, compile_mode: str | None = None):
        self.compile = compile
        self.compile_mode = compile_mode  # None: --compile's mode; else one of --compile-also's (ours only)
        self.info: dict = {}

    def accepts(self, dirty: str | None) -> bool:
        """Whether this contender can run on a pipeline left modified by ``dirty`` (None: pristine)."""
        return dirty is None

    @property
    def name(self) -> str:
        if not self.compile:
            return self.family
        return self.family + "+compile" + (f":{self.compile_mode}" if self.compile_mode else "")

    def check(self, b: Bench) -> str | None:
        return None

    def apply(self, b: Bench) -> None:
        if self.compile:
            guards = getattr(b.args, "compile_guards", "full") if self.ours else "full"
            extras = parse_extras(getattr(b.args, "compile_extra", "")) if self.ours else ()
            self.info["compile_mode"] = b.compile_transformer(vae=self.compile_vae, guards=guards,
                                                              mode=self.compile_mode, extras=extras)

    def call(self, b: Bench, kwargs: dict):
        return b.pipe(**kwargs)

    def timed_module(self, b: Bench) -> torch.nn.Module:
        """The transformer whose every forward the benchmark times (after ``apply``): the pipeline's own, unless
        the contender runs another module in its place."""
        return b.pipe.transformer

    def restore(self, b: Bench) -> None:
        b.uncompile()
