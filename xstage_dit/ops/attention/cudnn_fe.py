"""cuDNN SDPA through ``nvidia-cudnn-frontend``'s graph API, writing the peer window as O.

The graph takes explicit strides for every tensor, O included, so O can be the owner-as-batch window view
(B*P, Hr, L, D) with strides (slot_elems, D, H*D, 1) in cuDNN's BHSD order. K/V are shared by the P owner
blocks of one batch element as a stride-0 batch (one execution per batch element when B > 1).

Where S is not divisible by P it refuses: with the padding mask and per-block ``seq_len_q`` the result is
right, but cuDNN writes zeros into the padding rows (measured on the H200, cuDNN 9.19), i.e. into a peer's
buffer past the shard, which the window path never does. The padded graph is kept for that measurement.

One graph per (shape, strides, dtype, scale), built on first use and cached; the cuDNN version the
frontend runs on is ``backend_version()``. Every execution plan the heuristics offer (modes A and B) is built,
and the first real call times each on its own tensors and keeps the fastest (`_autotune`): heuristic mode A's
first plan alone was slower than torch's cuDNN SDPA at FLUX's 4608 tokens / 3 heads, under one wave of the GPU
where the tile shape decides (benchmarks/results/figures-from-code.md). No timing inside a CUDA graph
capture: the first built plan runs there.
"""

from __future__ import annotations

import functools
from importlib import metadata

import torch

from xstage_dit.ops.attention.window import WindowGeometry

DISTRIBUTION = "nvidia-cudnn-frontend"
PINNED = "1.32.0"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128)


class CudnnFrontendUnavailable(RuntimeError):
    """nvidia-cudnn-frontend is missing or not the pinned version."""


@functools.cache
def _cudnn():
    try:
        ver = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise CudnnFrontendUnavailable(f"expected {DISTRIBUTION}=={PINNED} (pip install 'xstage-dit[gpu]'), "
                                       f"got none") from exc
    if ver != PINNED:
        raise CudnnFrontendUnavailable(f"expected {DISTRIBUTION}=={PINNED}, got {ver}")
    import cudnn

    return cudnn


def available() -> str | None:
    try:
        _cudnn()
    except (CudnnFrontendUnavailable, ImportError, OSError) as exc:
        return str(exc)
    return None


def backend_version() -> int | None:
    """The cuDNN library version the frontend runs on (e.g. 91900), or None where it is missing."""
    if available() is not None:
        return None
    return int(_cudnn().backend_version())


def bshd_layout(shape) -> tuple[list[int], list[int]]:
    """(dim, stride) of a contiguous torch (B, S, H, D) tensor in cuDNN's logical (B, H, S, D) order."""
    b, s, h, d = shape
    return [b, h, s, d], [s * h * d, d, h * d, 1]


def padding_lengths(graph, batch: int) -> dict:
    """A graph's per-sample query and key lengths, the keywords of its padding mask: {"seq_len_q", "seq_len_kv"}, each
    int32 (batch, 1, 1, 1) as cuDNN's samples declare them."""
    int32 = _cudnn().data_type.INT32
    return {name: graph.tensor(name=name, dim=[batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=int32)
            for name in ("seq_len_q", "seq_len_kv")}


def tensor_uid(tensor) -> int:
    """A graph tensor's uid (0 until the frontend lowers the graph)."""
    # cudnn-frontend 1.32's Python graph tensors carry ``uid``; the pybind tensors of earlier frontends get_uid()
    uid = getattr(tensor, "uid", None)
    return uid if isinstance(uid, int) else tensor.get_uid()


@functools.cache
def full_lengths(batch: int, seq: int, device: str) -> torch.Tensor:
    """int32 (batch, 1, 1, 1) of ``seq`` on ``device``: a padded graph's query lengths where every query row is real,
    one tensor per (batch, seq, device), so its address stays fixed for the graphs bound to it."""
    return torch.full((batch, 1, 1, 1), seq, dtype=torch.int32, device=device)


class DeviceHandles:
    """``handles(device)``: this owner's cuDNN handle on ``device``, created on first use on that device."""

    def __init__(self):
        self._handles: dict[int, object] = {}

    def __call__(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._handles:
            with torch.cuda.device(idx):
                self._handles[idx] = _cudnn().create_handle()
        return self._handles[idx]


class CudnnWindowKernel:
    """``run(q, k, v, out, geom, scale)``: one cached graph per problem, executed per batch element."""

    name = "cudnn"

    def __init__(self):
        self._graphs: dict[tuple, tuple] = {}
        self._handle = DeviceHandles()

    def supports(self, geom: WindowGeometry, dtype: torch.dtype, device: torch.device, has_window: bool
                 ) -> str | None:
        if not has_window:
            return "cuDNN writes a strided O: it needs the peer window (not a pointer table)"
        if device.type != "cuda":
            return f"cuDNN needs a CUDA device, got {device}"
        if dtype not in DTYPES:
            return f"cuDNN SDPA takes float16/bfloat16, got {dtype}"
        if geom.head_dim not in HEAD_DIMS:
            return f"cuDNN through the window is checked at head_dim {HEAD_DIMS}, got {geom.head_dim}"
        if geom.seq_len % geom.world_size:
            # Measured on the H200 (cuDNN 9.19, frontend 1.32): with the padding mask and per-block seq_len_q
            # cuDNN writes zeros into the padding rows, i.e. into a peer's buffer past its shard.
            return (f"cuDNN writes the padding rows (S={geom.seq_len} not divisible by P={geom.world_size}) into "
                    f"the owner's buffer")
        return available()

    def _graph(self, q_shape, q_strides, k_shape, k_strides, o_strides, dtype, scale, padded, device):
        key = (q_shape, q_strides, k_shape, k_strides, o_strides, dtype, scale, padded, str(device))
        hit = self._graphs.get(key)
        if hit is not None:
            return hit
        cudnn = _cudnn()
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        handle = self._handle(device)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        tq = graph.tensor(name="q", dim=list(q_shape), stride=list(q_strides), data_type=io)
        tk = graph.tensor(name="k", dim=list(k_shape), stride=list(k_strides), data_type=io)
        tv = graph.tensor(name="v", dim=list(k_shape), stride=list(k_strides), data_type=io)
        extra, seq = {}, {}
        if padded:
            seq = padding_lengths(graph, q_shape[0])
            extra = {"use_padding_mask": True, **seq}
        try:
            to, _ = graph.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=False, attn_scale=scale, **extra)
        except TypeError:  # frontends before generate_stats
            to, _ = graph.sdpa(name="sdpa", q=tq, k=tk, v=tv, is_inference=True, attn_scale=scale, **extra)
        to.set_output(True).set_dim(list(q_shape)).set_stride(list(o_strides)).set_data_type(io)
        sizes, workspace = build_plans(graph, cudnn, device)
        hit = [graph, tq, tk, tv, to, seq, workspace, handle, sizes, None]  # [-1]: the tuned plan, once known
        self._graphs[key] = hit
        return hit

    @staticmethod
    def _autotune(graph, packs, workspace, handle, sizes, reps: int = 5) -> int:
        """Index of the fastest built plan on the call's own tensors (median of ``reps`` CUDA-event timings
        after one warm-up); selects it for ``graph.execute``."""
        best, best_ms = None, float("inf")
        for i, size in enumerate(sizes):
            if size is None:
                continue
            try:
                for pack in packs:  # warm-up (and a plan that fails at run time is skipped)
                    graph.execute_plan_at_index(pack, workspace, i, handle=handle)
                times = []
                for _ in range(reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for pack in packs:
                        graph.execute_plan_at_index(pack, workspace, i, handle=handle)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            except Exception:  # noqa: BLE001 - an engine that refuses these tensors is not a candidate
                continue
            ms = sorted(times)[len(times) // 2]
            if ms < best_ms:
                best, best_ms = i, ms
        if best is None:
            raise RuntimeError("expected at least one cuDNN execution plan to run the window problem, none did")
        graph.build_plan_at_index(best)
        return best

    def run(self, q, k, v, out: torch.Tensor, geom: WindowGeometry, scale: float) -> None:
        """q, k, v: (B, rows_in >= P*L, Hr, D); out: (B*P, L, Hr, D) window view (see the module docstring)."""
        cudnn = _cudnn()
        batch, rows_in, hr, d = q.shape
        p, length, s = geom.world_size, geom.rows_per_owner, geom.seq_len
        if out.shape != (batch * p, length, hr, d):
            raise ValueError(f"expected out of shape {(batch * p, length, hr, d)}, got {tuple(out.shape)}")
        if k.stride() != v.stride():
            raise ValueError(f"expected k and v with one layout, got strides {k.stride()} and {v.stride()}")
        padded = s % p != 0
        # cuDNN's logical order is (batch, heads, seq, dim); the strides say where things are.
        q_shape, q_strides = (p, hr, length, d), (length * q.stride(1), q.stride(2), q.stride(1), 1)
        k_shape, k_strides = (p, hr, s, d), (0, k.stride(2), k.stride(1), 1)
        o_strides = (out.stride(0), out.stride(2), out.stride(1), 1)
        entry = self._graph(q_shape, q_strides, k_shape, k_strides, o_strides, q.dtype, scale, padded, q.device)
        graph, tq, tk, tv, to, seq, workspace, handle, sizes, tuned = entry
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        pack_seq = {}
        if padded:
            pack_seq = {seq["seq_len_q"]: self._seq_tensor(geom, q.device, "q"),
                        seq["seq_len_kv"]: self._seq_tensor(geom, q.device, "kv")}
        packs = []
        for b in range(batch):
            qb = q.as_strided(q_shape, q_strides, q.storage_offset() + b * q.stride(0))
            kb = k.as_strided(k_shape, k_strides, k.storage_offset() + b * k.stride(0))
            vb = v.as_strided(k_shape, (0, v.stride(2), v.stride(1), 1), v.storage_offset() + b * v.stride(0))
            packs.append({tq: qb, tk: kb, tv: vb, to: out[b * p:(b + 1) * p], **pack_seq})
        if tuned is None and not torch.cuda.is_current_stream_capturing():
            # Timing writes this call's output several times over (the same values): harmless, it is
            # written once more below.
            entry[-1] = self._autotune(graph, packs, workspace, handle, sizes)
        try:
            for pack in packs:
                graph.execute(pack, workspace, handle=handle)
        except Exception as exc:
            if not torch.cuda.is_current_stream_capturing():
                raise
            # Seen once on the H200 (4608 x 40, P = 8, one rank's 5 heads): "operation not permitted when stream
            # is capturing". Name the plan, so the engine that does not capture can be told apart.
            raise RuntimeError(f"cuDNN plan {_plan_label(graph, entry[-1])} failed inside a CUDA-graph capture: "
                               f"{exc}") from exc

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a handful of shapes per kernel object
    def _seq_tensor(self, geom: WindowGeometry, device: torch.device, which: str) -> torch.Tensor:
        rows = geom.owner_rows() if which == "q" else [geom.seq_len] * geom.world_size
        return torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 1, 1, 1)


def build_plans(graph, cudnn, device: torch.device) -> tuple[list[int | None], torch.Tensor]:
    """Validate `graph`, build every execution plan the heuristics offer (A, B, fallback), and return each plan's
    workspace size (None: a plan that did not build, never timed) and one workspace as large as the largest."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    sizes = []
    for i in range(graph.get_execution_plan_count()):
        try:
            sizes.append(graph.get_workspace_size_plan_at_index(i))
        except Exception:  # noqa: BLE001 - a plan that did not build has no workspace: never timed
            sizes.append(None)
    workspace = torch.empty(max([z for z in sizes if z is not None] + [1]), dtype=torch.uint8, device=device)
    return sizes, workspace


def _plan_label(graph, index: int | None) -> str:
    """'#index name (behavior notes)' of a built plan, for error messages; what the frontend cannot tell is left
    out rather than raising over the error being reported."""
    if index is None:
        return "(the first built plan: not tuned before the capture)"
    parts = [f"#{index}"]
    for query in (lambda: graph.get_plan_name_at_index(index), lambda: graph.get_behavior_notes()):
        try:
            parts.append(str(query()))
        except Exception:  # noqa: BLE001 - best effort inside an error path
            pass
    return " ".join(parts)
