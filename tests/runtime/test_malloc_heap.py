"""`models.malloc_heap.keep_freed_memory`: an image's buffers stop page-faulting once it is applied.

Each case runs in a child process: the setting is process-wide and must not change the rest of the suite."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from xstage_dit.server.config import ServerConfig

_CHILD = r"""
import json, resource, sys, time
import numpy as np
from xstage_dit.runtime.png import encode_png
from xstage_dit.runtime.malloc_heap import keep_freed_memory
report = keep_freed_memory() if sys.argv[1] == "kept" else None
again = keep_freed_memory() if sys.argv[1] == "kept" else None
pixels = np.random.default_rng(0).integers(0, 256, size=(1024, 1024, 3), dtype=np.uint8)
faults = []
for i in range(12):  # on the main thread, one call now and then, as `xstage-dit serve`'s event loop works
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    encode_png(pixels)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    time.sleep(0.01)
print(json.dumps({"report": report, "again": again, "faults": sorted(faults[3:])[len(faults[3:]) // 2]}))
"""


def _child(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_kept_heap_removes_the_page_faults_of_each_png():
    kept = _child("kept")
    assert kept["report"]["applied"] and kept["report"]["mmap_threshold"] == 32 << 20, kept["report"]
    assert kept["again"] == kept["report"]  # once per process
    image_pages = 1024 * 1024 * 3 // 4096  # 768: one fault per 4 KiB of one image-sized buffer
    assert kept["faults"] < image_pages // 8, kept
    # The default heap on this machine, for scale: the same loop faults on fresh mappings (or, depending on the
    # C library's history, does not; only the kept heap's bound is asserted).
    print("default heap, median minor faults a call:", _child("default")["faults"], "kept:", kept["faults"])


def test_keep_freed_memory_must_be_a_bool():
    with pytest.raises(ValueError, match="keep_freed_memory"):
        ServerConfig(keep_freed_memory="yes")
