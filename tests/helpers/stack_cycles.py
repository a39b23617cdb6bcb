"""What the stack-cycle tests (tests/features/test_stack_cycles*.py) measure after each restore: the process's
resident memory and a tiny pipeline's images."""

from __future__ import annotations

import gc
import os

import torch

from xstage_dit.runtime.generation import call_kwargs

RSS_TOLERANCE = 0.05  # resident memory after a cycle, against where it started


def rss_bytes() -> int:
    """This process's resident set after a full garbage collection (Linux: /proc/self/statm)."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def images(pipe, spec) -> torch.Tensor:
    kwargs = call_kwargs(pipe, spec, prompt="a fox", seed=1, steps=2, height=32, width=32)
    with torch.inference_mode():
        return pipe(**{**kwargs, "output_type": "pt"}).images
