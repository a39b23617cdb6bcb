"""Process groups for a `ParallelConfig`: one sp group per cfg branch, one cfg group per shard index.

Layout (world = sp * cfg): rank r sits in cfg branch ``r // sp`` at sequence shard ``r % sp``.
``sp_group`` holds the ranks of one branch (contiguous, so they share a node first); ``cfg_group``
holds the ranks with the same shard index in both branches (they exchange the branch outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from xstage_dit.features.config import ParallelConfig


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout and its groups.

    sp_group is a real group whenever the world has more than one rank, even for sp=1 (a group of
    one): ``None`` means the WORLD to torch.distributed and to the ops, which would be wrong there.
    cfg_group is None when cfg=1.
    """

    rank: int
    world_size: int
    sp_rank: int
    cfg_rank: int
    sp_group: dist.ProcessGroup | None
    cfg_group: dist.ProcessGroup | None
    device: torch.device


def _current_device() -> torch.device:
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_groups(config: ParallelConfig) -> ParallelGroups:
    """Create the sp / cfg groups for `config` (collective: every rank calls it in the same order).

    Raises ValueError before any GPU work if the degrees do not multiply to the world size.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config.check_world(world_size)
    sp_group = cfg_group = None
    if world_size > 1:
        # new_group is collective over the WORLD: every rank creates every group, keeps its own.
        for branch in range(config.cfg):
            ranks = list(range(branch * config.sp, (branch + 1) * config.sp))
            group = dist.new_group(ranks)
            if rank in ranks:
                sp_group = group
        for shard in range(config.sp):
            ranks = [branch * config.sp + shard for branch in range(config.cfg)]
            group = dist.new_group(ranks) if config.cfg > 1 else None
            if rank in ranks:
                cfg_group = group
    return ParallelGroups(
        rank=rank,
        world_size=world_size,
        sp_rank=rank % config.sp,
        cfg_rank=rank // config.sp,
        sp_group=sp_group,
        cfg_group=cfg_group,
        device=_current_device(),
    )
