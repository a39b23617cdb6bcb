"""Process groups by name, for torch custom ops.

A ``ProcessGroup`` cannot cross the op boundary, so a caller passes ``group_name(group)`` (a string) and the
op's implementation calls ``resolve_group(name)``.

    name = group_name(group)          # "" for None (the default group)
    assert resolve_group(name) is group
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["group_name", "resolve_group"]

# Every group that has been named, so the op can get it back (groups live as long as the process).
_GROUPS: dict[str, dist.ProcessGroup] = {}


def group_name(group: dist.ProcessGroup | None) -> str:
    """A string naming `group` inside a custom op ("" = no group / the default world group)."""
    if group is None:
        return ""
    name = group.group_name
    _GROUPS[name] = group
    return name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """Inverse of ``group_name``; ValueError for a name never registered through it."""
    if not name:
        return None
    try:
        return _GROUPS[name]
    except KeyError:
        raise ValueError(f"expected a process group registered through group_name(), got unknown name {name!r}") from None
