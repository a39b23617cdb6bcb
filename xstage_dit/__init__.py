"""xstage_dit: fast multi-GPU serving of diffusers Diffusion Transformers.

Public API (imported lazily so that `import xstage_dit` stays cheap):

- ``parallelize(pipe, ParallelConfig(...))``: sequence / expert / CFG parallelism for a diffusers pipeline.
- ``Engine(EngineConfig(...))``: a pipeline and every feature (parallelism, compile, batch invariance, ...) in
  one declared order, one ``restore()`` (``xstage-dit generate / serve / bench`` use it).
- ``calibrate(...)``: measure remote-store issue, drain and capacity on this machine (X-Stage model).
- ``XStageParams``: the three calibrated numbers of the X-Stage model.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; resolved on first attribute access.
_LAZY = {
    "XStageParams": "xstage_dit.xstage",
    "calibrate": "xstage_dit.calibration.runner",
    "CalibrationConfig": "xstage_dit.calibration.runner",
    "parallelize": "xstage_dit.features",
    "ParallelConfig": "xstage_dit.features",
    "Engine": "xstage_dit.engine",
    "EngineConfig": "xstage_dit.engine",
    "CompileConfig": "xstage_dit.features.compile",
    "load_pipeline": "xstage_dit.families",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xstage_dit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
