"""Count host reads of device data on the CPU, where ``torch.cuda.set_sync_debug_mode`` cannot look.

``count_host_syncs()`` records, while active, every call that would make the host wait for the GPU if the
tensors lived there: the scalar reads (``Tensor.item``, ``bool``/``int``/``float`` of a tensor, all of which
reach ``aten._local_scalar_dense``), ``Tensor.tolist`` / ``.cpu`` / ``.numpy``, the data-dependent-size
ops that read a count on the host on CUDA (``nonzero``, boolean indexing, ``masked_select``, ``unique``,
``bincount``, ``repeat_interleave`` without ``output_size``) and ``torch.cuda.synchronize``. Calls made
inside Triton (its CPU interpreter reads the tensors it runs on; on a GPU a launch reads nothing back)
are not counted.

    with count_host_syncs() as syncs:
        layer(x)
    assert syncs == [], syncs      # each entry: (what, "file:line" of the first caller outside torch)
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_host_syncs"]

_SIZE_FROM_DATA = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.bincount.default,
    torch.ops.aten._local_scalar_dense.default,
}


def _caller() -> str | None:
    """"file:line" of the innermost frame outside torch and this module; None inside a Triton call."""
    frames = traceback.extract_stack()[:-2]
    if any("/triton/" in f.filename for f in frames):
        return None
    for f in reversed(frames):
        if "/torch/" not in f.filename and f.filename != __file__ and "contextlib" not in f.filename:
            return f"{f.filename}:{f.lineno}"
    return "?"


class _Mode(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func in _SIZE_FROM_DATA
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            hit = True
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if hit:
            where = _caller()
            if where is not None:
                self.seen.append((str(func), where))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """Yields the list the recorded host syncs are appended to (see the module docstring)."""
    seen: list[tuple[str, str]] = []
    patched = []

    def wrap(owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            where = _caller()
            if where is not None:
                seen.append((f"{getattr(owner, '__name__', owner)}.{name}", where))
            return real(*args, **kwargs)

        setattr(owner, name, counted)
        patched.append((owner, name, real))

    for name in ("tolist", "cpu", "numpy"):
        wrap(torch.Tensor, name)
    wrap(torch.cuda, "synchronize")
    try:
        with _Mode(seen):
            yield seen
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)
