"""The per-machine calibration cache: what a result is valid for (``machine_key``) and the file it lives in.

``<cache_dir>/calibration-<hash of the machine key>.json``; ``cache_dir`` defaults to ``$XSTAGE_DIT_CACHE``
or ``~/.cache/xstage_dit``. A result of another machine key or sweep version is never returned.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from xstage_dit.calibration.result import CalibrationResult
from xstage_dit.calibration.sweep import SWEEP_VERSION
from xstage_dit.calibration.targets import CalibrationUnavailable, resolve_device
from xstage_dit.xstage import XStageParams

__all__ = ["code_version", "machine_key", "default_cache_dir", "cache_path", "save_cache", "load_cache"]


def _driver_strings() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:  # kernel module version, e.g. "580.159.03" (a cheap file read)
        text = Path("/proc/driver/nvidia/version").read_text()
        for tok in text.split():
            if tok.count(".") >= 1 and tok.replace(".", "").isdigit():
                out["driver"] = tok
                break
    except OSError:
        pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["cuda_driver_api"] = v.value
    except OSError:
        pass
    return out


def code_version() -> str:
    """Hash of what a calibration result depends on: the kernel source, the model and SWEEP_VERSION."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(str(SWEEP_VERSION).encode())
    model = here.parent / "xstage"
    for p in (here / "csrc" / "burst.cu", model / "laws.py", model / "fits.py"):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def machine_key(device: Any = None) -> dict[str, Any]:
    """What a calibration is valid for: GPU name, SM count, memory, compute capability, driver, the
    peer topology of the visible GPUs, and the code version. Raises CalibrationUnavailable without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise CalibrationUnavailable("calibration needs a CUDA GPU, found none (torch.cuda.is_available() is False); "
                                     "schedules fall back to XStageParams.reference() or the serial path")
    dev = resolve_device(device)
    props = torch.cuda.get_device_properties(dev)
    n = torch.cuda.device_count()
    peers = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    return {
        "gpu_name": props.name,
        "sm_count": props.multi_processor_count,
        "total_memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        **_driver_strings(),
        "torch_cuda": torch.version.cuda,
        "device_count": n,
        "peer_access": peers,
        "code_version": code_version(),
    }


def _key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("XSTAGE_DIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "xstage_dit"


def cache_path(key: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache file of a machine key: ``<cache_dir>/calibration-<hash of the key>.json``."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"calibration-{_key_hash(key)}.json"


def save_cache(result: CalibrationResult, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write ``result`` to its machine key's cache file (atomically)."""
    path = cache_path(result.machine_key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result.to_json(), indent=1, default=float))
    os.replace(tmp, path)
    result.path = str(path)
    return path


def load_cache(key: dict, cache_dir: str | os.PathLike | None = None,
               targets: Sequence[str] = ()) -> CalibrationResult | None:
    """The cached result for ``key`` holding every target in ``targets``, or None (missing file, other
    machine key, older sweep version, missing target, unreadable file)."""
    path = cache_path(key, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("sweep_version") != SWEEP_VERSION or data.get("machine_key") != key:
        return None
    params = {t: XStageParams.from_dict(p) for t, p in data.get("params", {}).items()}
    if any(t not in params for t in targets):
        return None
    return CalibrationResult(params, key, "cache", data.get("targets", {}), quick=data.get("quick", True),
                             path=str(path))

