"""Process groups, symmetric-memory buffers and pointer tables, launch helpers.

Everything that talks to `torch.distributed` or torch symmetric memory goes through this module, so
the ops stay free of process-group plumbing:

- ``init_distributed()`` joins the processes started by torchrun (NCCL on GPUs, gloo on CPUs).
- ``SymmetricBuffer`` is one tensor per rank plus a device table ``ptr_table: int64[world]`` whose
  entry ``r`` is the address of rank ``r``'s tensor, for remote stores from Triton kernels
  (``tl.load(ptr_table + r).to(tl.pointer_type(elem))``).
- ``allocate_symmetric_buffer(...)`` allocates such a buffer (a rendezvous at world > 1); the owner that keeps
  and frees them is `xstage_dit.comm.buffers.CommBuffers` (nothing allocates or rendezvouses on the hot path).
- ``local_buffer_table(tensors)`` builds the same kind of table over plain tensors of one process:
  world size 1 (``rendezvous`` refuses a world of 1) and the "virtual ranks" of the CPU tests.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import MutableMapping, Sequence

import torch
import torch.distributed as dist

from xstage_dit._torch_private import symmetric_memory
from xstage_dit.comm import agreement

log = logging.getLogger(__name__)

# NVLink multicast can take a shared host's GPUs out of service: keep it off everywhere we start.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_safe_env(env: MutableMapping[str, str] | None = None, *, force: bool = False) -> MutableMapping[str, str]:
    """Put the NVLink-multicast-off settings (`SAFE_ENV`) into `env` (default: this process's os.environ)
    and return it. Without `force` a value the user set stays; the launcher forces them on its ranks.

    Called explicitly (by `init_distributed` before a group exists, and by `xstage_dit.comm.launcher`
    for its children), never at import: importing the package leaves the environment alone.
    """
    env = os.environ if env is None else env
    for key, value in SAFE_ENV.items():
        if force:
            env[key] = value
        else:
            env.setdefault(key, value)
    return env


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits: global rank, world size, local rank and its torch device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device_for_local_rank(local_rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Several ranks may share one GPU (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 on a 1-GPU machine).
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> RankInfo:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    Without that environment this is a single process: returns rank 0 of 1 and creates no group.
    Applies `SAFE_ENV` to os.environ first (user-set values stay), before NCCL or symmetric memory read it.
    backend: None picks NCCL when every rank has its own GPU, gloo otherwise (CPU, or ranks sharing
    a GPU, which NCCL refuses).
    """
    apply_safe_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device_for_local_rank(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        if backend is None:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
            own_gpu = device.type == "cuda" and torch.cuda.device_count() >= local_world
            backend = "nccl" if own_gpu else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
        log.info("rank %d/%d joined with %s on %s", rank, world_size, backend, device)
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def close_distributed(timeout_s: float = 30.0) -> None:
    """Leave the process group `init_distributed` joined (no-op without one): the last call of every rank,
    after its work succeeded or failed alike.

    A rank that exits with its gloo group still alive leaves gloo's worker threads holding works whose tensors
    are freed during interpreter finalization; that sometimes aborts the process with "terminate called
    without an active exception" (exit 134 in CI, on ranks that had succeeded and on ranks that had recorded
    an expected failure; pytorch/pytorch#190489). The ranks first meet on the store
    (`agreement.leave_together`, which works when the group itself is broken), so rank 0, which hosts the
    store under our launcher, does not take it down under a peer still reading; a peer that never comes (it
    died) costs `timeout_s`, then this rank closes anyway. Not an atexit hook: a rank whose exception escapes
    must exit at once with its own code, before its peers notice.
    """
    if not dist.is_initialized():
        return
    if not agreement.leave_together(timeout_s):
        log.warning("closing the process group: not every rank arrived within %.0f s (a peer has left)", timeout_s)
    dist.destroy_process_group()


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world_size) in `group`; (0, 1) when no process group exists."""
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def local_buffer_table(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """int64 table of the data pointers of `tensors`, on `device` (default: the tensors' device).

    Used for world size 1 and for virtual ranks in one process (tests, benchmarks): the kernel
    stores through the table exactly as it would through a symmetric-memory peer table.
    """
    if not tensors:
        raise ValueError("expected at least one tensor, got none")
    device = device or tensors[0].device
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


@dataclass
class SymmetricBuffer:
    """One tensor per rank of a group and the device table of everyone's copy of it.

    tensor: this rank's buffer (shape and dtype as allocated).
    ptr_table: int64[world_size] on the buffer's device; entry r = address of rank r's buffer.
    signal_table: int64[world_size] of the ranks' signal pads (flags), or None for a local table.
    """

    tensor: torch.Tensor
    ptr_table: torch.Tensor
    rank: int
    world_size: int
    handle: object | None = None
    signal_table: torch.Tensor | None = None
    group_barrier: object | None = None
    zeroed: bool = False  # a user that zeroes the buffer once after allocation records it here

    def barrier(self) -> None:
        """Every rank's earlier work on this stream is visible before anyone's later work (device-side).

        The group's abortable barrier (`xstage_dit.comm.barrier`): it raises the published `RankFailed`
        once the watchdog has seen a failure, and a pending one completes when a peer fails. torch's
        barrier where that one cannot run; nothing for a local (world 1) buffer.
        """
        if self.group_barrier is not None:
            self.group_barrier()
        elif self.handle is not None:
            self.handle.barrier()


def allocate_symmetric_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                              group: dist.ProcessGroup | None = None, barrier=None) -> SymmetricBuffer:
    """A new symmetric buffer of `shape`/`dtype` over `group`; `barrier(group, device)` gives its group barrier.

    Collective at world > 1 (every rank of `group` calls it: one rendezvous). World size 1 allocates a plain
    tensor and a local table. Callers keep buffers in an owner (`comm.buffers.CommBuffers`), which allocates
    each once and frees them together; nothing allocates on the hot path.
    """
    _, world_size = world_of(group)
    if world_size == 1:
        tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        return SymmetricBuffer(tensor, local_buffer_table([tensor]), 0, 1)
    if device.type != "cuda":
        raise RuntimeError(f"symmetric memory needs a CUDA device, got {device}")
    symm_mem = symmetric_memory()
    tensor = symm_mem.empty(tuple(shape), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(tensor, group if group is not None else dist.group.WORLD)
    ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    sigs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
    return SymmetricBuffer(tensor, ptrs, handle.rank, handle.world_size, handle, sigs,
                           barrier(group, device) if barrier is not None else None)
