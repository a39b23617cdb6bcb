"""Build CUDA sources of this folder into a shared library with nvcc, once, cached on disk.

The sources expose a plain C ABI (no torch headers), so one nvcc call takes about a second. The
library is cached under ``<cache>/build/<key>/`` where the key hashes the source bytes, the target
arch, the nvcc version and the flags; a file lock makes concurrent first uses (several ranks of one
node) build it once. ``XSTAGE_DIT_NO_BUILD=1`` refuses to compile (a server that must start fast
fails with a clear message instead of building).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent
NVCC_FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class BuildError(RuntimeError):
    """nvcc is missing, building is refused, or the compile failed (message holds nvcc's output)."""


def cache_root() -> Path:
    """``$XSTAGE_DIT_CACHE`` or ``~/.cache/xstage_dit``."""
    env = os.environ.get("XSTAGE_DIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "xstage_dit"


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin/nvcc``, then PATH, then /usr/local/cuda."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


@functools.cache
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def arch_flag(compute_capability: tuple[int, int]) -> str:
    """``-arch=sm_XY`` for a device's compute capability ``(X, Y)``."""
    major, minor = compute_capability
    if major < 7:
        raise BuildError(f"expected a GPU of compute capability >= 7.0, got {major}.{minor}")
    return f"-arch=sm_{major}{minor}"


def source_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def build_library(name: str, sources: list[str], compute_capability: tuple[int, int]) -> Path:
    """Path of ``lib<name>.so`` built from ``sources`` (file names in this folder) for the device's arch,
    compiling only when no cached build with the same key exists."""
    paths = [CSRC_DIR / s for s in sources]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise BuildError(f"expected CUDA sources {missing} to exist, got none")
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("expected nvcc on PATH or under $CUDA_HOME/bin to build the CUDA sources, got none")
    arch = arch_flag(compute_capability)
    key_src = "|".join([source_hash(paths), arch, nvcc_version(nvcc), " ".join(NVCC_FLAGS)])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    out_dir = cache_root() / "build" / f"{name}-{key}"
    lib = out_dir / f"lib{name}.so"
    if lib.exists():
        return lib
    if os.environ.get("XSTAGE_DIT_NO_BUILD") == "1":
        raise BuildError(f"{lib} is not built and XSTAGE_DIT_NO_BUILD=1 refuses to compile it")
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another process built it while we waited
            return lib
        with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
            tmp_path = Path(tmp.name)
        cmd = [nvcc, arch, *NVCC_FLAGS, "-o", str(tmp_path), *map(str, paths)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp_path.unlink(missing_ok=True)
            raise BuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        os.replace(tmp_path, lib)  # atomic: readers never see a half-written library
    return lib
