"""The diffusers MoE layers made expert-parallel: ``NucleusMoEEPLayer`` (expert-choice routing kept global
over the sharded sequence) and ``HiDreamMoEEPLayer`` (top-k + shared experts).

Input on each rank: the rank's contiguous sequence shard ``(batch, seq_local, hidden)``, shards in rank
order; each layer holds only this rank's experts. Inference only (no autograd through the expert path).
The routed experts run through ``xstage_dit.ops.moe.ep_moe_forward`` on the path and lead chosen once per
layer shape by the layer's ``MoEScheduler`` (``xstage_dit.schedule.moe``); the last decision is
``layer.schedule_choice``. ``patches.expert_parallel`` swaps them in and hands every layer of a model one
scheduler fed the params ``parallelize`` was given.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from xstage_dit.comm.distributed import world_of
from xstage_dit.comm.staged import all_gather_list
from xstage_dit.ops.moe import MoEKernelConfig, ep_moe_forward, expert_choice_moe
from xstage_dit.ops.moe.config import default_config
from xstage_dit.features.nucleus_routing import nucleus_routing
from xstage_dit.schedule.facts import DeviceFacts
from xstage_dit.schedule.moe import MoESchedule, MoEScheduler, check_moe_path

__all__ = ["NucleusMoEEPLayer", "HiDreamMoEEPLayer", "is_expert_parallel_layer"]


def _check_sharding(num_experts: int, group) -> tuple[int, int, int]:
    rank, world = world_of(group)
    if num_experts % world:
        raise ValueError(f"expected num_experts divisible by the group size, got num_experts={num_experts}, world_size={world}")
    return rank, world, num_experts // world


def _check_shard(shard, num_experts: int) -> tuple[int, int, int]:
    """(rank, world, experts per rank) of an explicit ``shard=(rank, world)`` (a layer loaded sharded)."""
    if (not isinstance(shard, tuple) or len(shard) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)):
        raise ValueError(f"expected shard=(rank, world) as two ints, got {shard!r}")
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"expected shard=(rank, world) with world >= 1 and 0 <= rank < world, got {shard}")
    if num_experts % world:
        raise ValueError(f"expected num_experts divisible by the shard world, got num_experts={num_experts}, world={world}")
    return rank, world, num_experts // world


def _check_local_experts(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"expected {name} of shape {shape} (this rank's experts), got {got}")
    return t


def is_expert_parallel_layer(module: nn.Module) -> bool:
    """Whether `module` is one of the expert-parallel MoE layers (holding one rank's shard of the experts)."""
    return isinstance(module, _ShardBinding)


class _ShardBinding:
    """Which experts an EP layer holds (``shard = (rank, world)``), whether it may run, and its schedule.

    A layer made by ``from_layer(layer, group)`` is bound to ``group`` at once. A layer made by
    ``from_shard`` (a pipeline loaded with ``expert_shard``) holds experts for a group that does not exist
    yet: ``parallelize`` binds it (``bind(group)``, which checks the group's rank and size) and ``restore``
    unbinds it. An unbound layer of a world > 1 refuses to run, since the other experts live on other ranks.
    """

    shard: tuple[int, int]
    bound: bool
    scheduler: MoEScheduler
    schedule_choice: MoESchedule | None

    def _init_schedule(self, path: str, config: MoEKernelConfig | None, scheduler: MoEScheduler | None) -> None:
        self.path = check_moe_path(path)
        self.config = config
        self.scheduler = scheduler if scheduler is not None else MoEScheduler()
        self._loaded_scheduler = self.scheduler  # what unbind() goes back to
        self.schedule_choice = None  # the decision of the last forward (path, lead, reason)

        # Closures (a bound method cannot carry Dynamo's mark): under torch.compile Dynamo runs the decision at
        # trace time with plain values and bakes the path and lead into the graph, so the scheduler's dicts,
        # DeviceFacts and the log line cause no graph break; eager calls run the same function.
        def path_of(device, dtype_bytes, hidden, intermediate, rows_per_expert):
            return self._decide(device, dtype_bytes, hidden, intermediate, rows_per_expert).path

        def lead_of(device, dtype_bytes, hidden, intermediate, rows_per_expert):
            return self._decide(device, dtype_bytes, hidden, intermediate, rows_per_expert).lead

        self._path_of = torch.compiler.assume_constant_result(path_of)
        self._lead_of = torch.compiler.assume_constant_result(lead_of)

    def _decide(self, device: torch.device, dtype_bytes: int, hidden: int, intermediate: int,
                rows_per_expert: int) -> MoESchedule:
        cfg = self.config or default_config()
        choice = self.scheduler.choose(
            DeviceFacts.from_device(device), requested=self.path, lead=cfg.lead, hidden=hidden,
            intermediate=intermediate, rows_per_expert=max(1, rows_per_expert),
            num_experts_per_rank=self.num_experts_per_rank, dtype_bytes=dtype_bytes, block_m=cfg.block_m,
            block_n1=cfg.block_n1, block_n2=cfg.block_n2, num_producers=cfg.num_programs,
        )  # fmt: skip
        self.schedule_choice = choice
        return choice

    def _schedule(self, x: torch.Tensor, *, hidden: int, intermediate: int, rows_per_expert: int) -> tuple[str, int]:
        """(path, lead) for this call's shape, from the scheduler (decided and logged once per shape; the
        decision is ``schedule_choice``)."""
        shape = (x.device, x.element_size(), int(hidden), int(intermediate), int(rows_per_expert))
        return self._path_of(*shape), self._lead_of(*shape)

    def bind(self, group, scheduler: MoEScheduler | None = None) -> None:
        """Run over ``group`` from now on (with ``scheduler``, if given, until ``unbind``); ValueError unless
        the group's (rank, size) is this layer's shard."""
        got = world_of(group)
        if tuple(got) != tuple(self.shard):
            raise ValueError(
                f"expected a group where this rank is rank {self.shard[0]} of {self.shard[1]} (the expert shard it was "
                f"loaded with), got rank {got[0]} of {got[1]}"
            )
        self.group = group
        self.bound = True
        if scheduler is not None:
            self.scheduler = scheduler

    def unbind(self) -> None:
        """Back to the loaded state: the shard stays, the group and the bound scheduler go (running it then
        raises)."""
        self.group = None
        self.bound = False
        self.scheduler = self._loaded_scheduler

    def _check_gatherable(self) -> None:
        if not self.bound and self.shard[1] > 1:
            raise RuntimeError(
                f"expected a bound {type(self).__name__} (bind(group)) to gather the other ranks' experts, got an "
                f"unbound layer holding expert shard {self.shard[0]} of {self.shard[1]}"
            )

    def _check_bound(self) -> None:
        if not self.bound and self.shard[1] > 1:
            raise RuntimeError(
                f"expected {type(self).__name__} to run under parallelize(pipe, ParallelConfig(sp={self.shard[1]}, "
                f"ep={self.shard[1]})), got an unbound layer holding expert shard {self.shard[0]} of {self.shard[1]} "
                "(the pipeline was loaded with expert_shard; the other experts are on other ranks)"
            )


def _all_gather_expert_shards(t: torch.Tensor, group) -> torch.Tensor:
    return torch.cat(all_gather_list(t, group), 0)


# --------------------------------------------------------------------------------------------------
# NucleusMoE
# --------------------------------------------------------------------------------------------------


class NucleusMoEEPLayer(_ShardBinding, nn.Module):
    """Expert-parallel replacement of diffusers' ``NucleusMoELayer`` (same forward signature).

    Input on each rank: its contiguous sequence shard ``hidden_states: (batch, seq_local, hidden)``
    (shards in rank order, any lengths), ``hidden_states_unmodulated`` likewise, ``timestep: (batch, hidden)``.
    Routing stays global: top-C per expert is taken over the whole sequence with C from the full length;
    the shared expert runs on local tokens. Holds ``num_experts / P`` experts.

    router: "exact" (default) all-gathers ``hidden_states_unmodulated`` and runs the router GEMM over the
    whole sequence, exactly as the unsharded layer does, so routing is bit-identical on any device;
    "scores" runs the router on the local shard and all-gathers the scores ``(batch, E, seq_local)``
    (E/hidden of the traffic). With "scores" the router GEMM runs on fewer rows than the unsharded
    layer's; cuBLAS may then pick another kernel and round a score differently, which can flip a
    near-tie top-C choice (seen on the H200: 1.8% output difference, two ranks vs one; CPU tests match
    bit-exactly). Example::

        ep = NucleusMoEEPLayer.from_layer(block.img_mlp, group)
        block.img_mlp = ep            # ... and back: block.img_mlp = ep.to_layer()

    A rank that loads only its experts builds the layer with `from_shard` instead (see
    `xstage_dit.families.experts`); the forward is the same.

    World 1 (shard ``(0, 1)``): the expert-choice path (``ops.moe.expert_choice_moe``): every expert takes
    ``batch * capacity`` rows, so the expert offsets are shapes and nothing is planned on the host (no sync,
    no graph break under torch.compile); the scheduler's path picks the MLP (fused kernel, grouped matmul or
    the fp32 reference). Built from the full layer it runs on that layer's expert tensors (no copy).
    """

    routing = "expert_choice"  # read by patches.expert_parallel (the world-1 choice turns on it)

    def __init__(self, layer: nn.Module, group=None, *, path: str = "auto", config: MoEKernelConfig | None = None,
                 router: str = "exact", shard: tuple[int, int] | None = None,
                 local_experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scheduler: MoEScheduler | None = None):
        super().__init__()
        if shard is None:
            rank, world, El = _check_sharding(layer.num_experts, group)
        else:
            rank, world, El = _check_shard(shard, layer.num_experts)
        self.shard, self.bound = (rank, world), shard is None
        if router not in ("exact", "scores"):
            raise ValueError(f"expected router 'exact' or 'scores', got {router!r}")
        self.router = router
        self.group = group
        self._init_schedule(path, config, scheduler)
        self.num_experts = layer.num_experts
        self.num_experts_per_rank = El
        self.hidden_size = layer.hidden_size
        self.moe_intermediate_dim = layer.moe_intermediate_dim
        self.capacity_factor = layer.capacity_factor
        self.use_sigmoid = layer.use_sigmoid
        self.route_scale = layer.route_scale
        self.use_grouped_mm = layer.experts.use_grouped_mm
        self.gate = layer.gate
        self.shared_expert = layer.shared_expert
        # World 1, built from the full layer: the EP layer runs on diffusers' own expert tensors (shared, not
        # copied: a copy doubled the experts' GPU memory while patched, ~30 GB for the full NucleusMoE, and
        # moving the original's to the host and back cost seconds per parallelize/restore).
        if local_experts is None and world == 1:
            gate_up = layer.experts.gate_up_proj.detach()
            down = layer.experts.down_proj.detach()
        elif local_experts is None:
            sl = slice(rank * El, (rank + 1) * El)
            # clone: the slice must not keep the full expert tensors alive.
            gate_up = layer.experts.gate_up_proj.detach()[sl].clone()
            down = layer.experts.down_proj.detach()[sl].clone()
        else:
            H, I = layer.hidden_size, layer.moe_intermediate_dim
            gate_up = _check_local_experts("gate_up_local", local_experts[0], (El, H, 2 * I))
            down = _check_local_experts("down_local", local_experts[1], (El, I, H))
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, **kwargs) -> "NucleusMoEEPLayer":
        """Build from a diffusers ``NucleusMoELayer`` (every rank passes its full copy); keeps this rank's experts."""
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_expert", "capacity_factor")):
            raise TypeError(f"expected a diffusers NucleusMoELayer, got {type(layer).__name__}")
        return cls(layer, group, **kwargs)

    @classmethod
    def from_shard(cls, layer: nn.Module, gate_up_local: torch.Tensor, down_local: torch.Tensor,
                   shard: tuple[int, int], **kwargs) -> "NucleusMoEEPLayer":
        """Build from a ``NucleusMoELayer`` whose experts were never materialised (e.g. on the meta device)
        and this rank's experts only.

        gate_up_local: (E/world, hidden, 2*inter) = experts ``[rank*E/world, (rank+1)*E/world)`` of
        ``experts.gate_up_proj``; down_local: (E/world, inter, hidden) likewise; shard: (rank, world).
        The layer is unbound until ``bind(group)`` (done by `parallelize`). Only the router and the shared
        expert of ``layer`` are used; its ``experts`` tensors are never read.
        """
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_expert", "capacity_factor")):
            raise TypeError(f"expected a diffusers NucleusMoELayer, got {type(layer).__name__}")
        return cls(layer, None, shard=shard, local_experts=(gate_up_local, down_local), **kwargs)

    def to_layer(self) -> nn.Module:
        """A full diffusers ``NucleusMoELayer`` again (collective: all-gathers the expert shards)."""
        self._check_gatherable()
        from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

        layer = NucleusMoELayer(
            self.hidden_size, self.moe_intermediate_dim, self.num_experts, self.capacity_factor,
            self.use_sigmoid, self.route_scale, self.use_grouped_mm,
        )  # fmt: skip
        layer.to(device=self.gate_up_proj.device, dtype=self.gate_up_proj.dtype)
        layer.gate = self.gate
        layer.shared_expert = self.shared_expert
        with torch.no_grad():
            layer.experts.gate_up_proj.copy_(_all_gather_expert_shards(self.gate_up_proj.data, self.group))
            layer.experts.down_proj.copy_(_all_gather_expert_shards(self.down_proj.data, self.group))
        return layer

    def _gather_seq(self, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
        """All-gather sequence shards along ``dim`` (shards of any lengths, rank order); returns (full, lengths)."""
        rank, world = world_of(self.group)
        s_loc = t.shape[dim]
        if world == 1:
            return t, [s_loc]
        lens = [int(v.item()) for v in all_gather_list(torch.tensor([s_loc], dtype=torch.int64, device=t.device), self.group)]
        pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, max(lens) - s_loc]
        parts = all_gather_list(F.pad(t, pad), self.group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lens)], dim=dim), lens

    def _scores(self, unmodulated: torch.Tensor, timestep: torch.Tensor | None) -> torch.Tensor:
        """diffusers' router on ``unmodulated: (B, S, H)``: scores (B, S, E) in the gate's dtype."""
        if timestep is not None:
            router_input = torch.cat([timestep.unsqueeze(1).expand(-1, unmodulated.shape[1], -1), unmodulated], dim=-1)
        else:
            router_input = unmodulated
        logits = self.gate(router_input)
        if self.use_sigmoid:
            return torch.sigmoid(logits.float()).to(logits.dtype)
        return F.softmax(logits.float(), dim=-1).to(logits.dtype)

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor, timestep: torch.Tensor | None = None):
        """hidden_states, hidden_states_unmodulated: (batch, seq_local, hidden); returns (batch, seq_local, hidden)."""
        self._check_bound()
        bs, s_loc, dim = hidden_states.shape
        if dim != self.hidden_size:
            raise ValueError(f"expected hidden size {self.hidden_size}, got {dim}")
        if tuple(hidden_states_unmodulated.shape) != (bs, s_loc, dim):
            raise ValueError(
                f"expected hidden_states_unmodulated of shape {(bs, s_loc, dim)}, got {tuple(hidden_states_unmodulated.shape)}"
            )
        if self.shard[1] == 1:
            return self._forward_world1(hidden_states, hidden_states_unmodulated, timestep)
        if self.router == "exact":
            # The router GEMM over the whole sequence, as the unsharded layer runs it: bit-identical scores.
            full, lens = self._gather_seq(hidden_states_unmodulated.contiguous(), 1)
            affinity = self._scores(full, timestep).transpose(1, 2)
        else:
            affinity, lens = self._gather_seq(self._scores(hidden_states_unmodulated, timestep).transpose(1, 2).contiguous(), 2)
        rank, _ = world_of(self.group)
        slen = affinity.shape[-1]
        global_idx, gating_flat, capacity = nucleus_routing(affinity, self.capacity_factor, self.route_scale)
        # This rank's pairs: chosen tokens whose position lies in this rank's shard.
        start = sum(lens[:rank])
        b = global_idx // slen
        pos = global_idx % slen
        own = (pos >= start) & (pos < start + s_loc)
        expert_of_pair = torch.arange(self.num_experts, device=global_idx.device).repeat_interleave(bs * capacity)
        token_idx = (b * s_loc + pos - start)[own]
        out = self.shared_expert(hidden_states).reshape(bs * s_loc, dim)
        # Expert choice: every expert takes `capacity` tokens of each batch row, wherever they live.
        path, lead = self._schedule(hidden_states, hidden=dim, intermediate=self.moe_intermediate_dim,
                                    rows_per_expert=bs * capacity)
        routed = ep_moe_forward(
            hidden_states.reshape(bs * s_loc, dim), token_idx, expert_of_pair[own], gating_flat[own].float(),
            self.gate_up_proj, self.down_proj, out, num_experts=self.num_experts, group=self.group,
            path=path, lead=lead, config=self.config,
        )  # fmt: skip
        return routed.reshape(bs, s_loc, dim)

    def _forward_world1(self, hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor,
                        timestep: torch.Tensor | None) -> torch.Tensor:
        """World 1: diffusers' routing, then ``expert_choice_moe`` on the static expert-major layout (pairs in
        the routing's order: expert-major, then batch, then choice)."""
        bs, slen, dim = hidden_states.shape
        affinity = self._scores(hidden_states_unmodulated, timestep).transpose(1, 2)
        token_idx, gating_flat, capacity = nucleus_routing(affinity, self.capacity_factor, self.route_scale)
        shared = self.shared_expert(hidden_states).reshape(bs * slen, dim)
        path, lead = self._schedule(hidden_states, hidden=dim, intermediate=self.moe_intermediate_dim,
                                    rows_per_expert=bs * capacity)
        out = expert_choice_moe(
            hidden_states.reshape(bs * slen, dim), token_idx, gating_flat, self.gate_up_proj, self.down_proj, shared,
            rows_per_expert=bs * capacity, path=path, lead=lead, config=self.config,
        )  # fmt: skip
        return out.reshape(bs, slen, dim)


# --------------------------------------------------------------------------------------------------
# HiDream
# --------------------------------------------------------------------------------------------------


class HiDreamMoEEPLayer(_ShardBinding, nn.Module):
    """Expert-parallel replacement of diffusers' HiDream ``MOEFeedForwardSwiGLU`` (same forward signature).

    x: (batch, seq_local, hidden) this rank's tokens; top-k token-choice routing is local per token, the
    shared experts run on local tokens, the routed experts are sharded (``num_experts / P`` per rank),
    their w1/w3 packed as ``gate_up: (El, hidden, 2*inter)`` and w2 as ``down: (El, inter, hidden)``.
    `from_shard` builds it from this rank's experts only (a pipeline loaded with ``expert_shard``).
    """

    routing = "top_k"  # data-dependent counts: the general EP plan at any world (patches.expert_parallel)

    def __init__(self, layer: nn.Module, group=None, *, path: str = "auto", config: MoEKernelConfig | None = None,
                 shard: tuple[int, int] | None = None,
                 local_experts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scheduler: MoEScheduler | None = None):
        super().__init__()
        E = len(layer.experts)
        if shard is None:
            rank, world, El = _check_sharding(E, group)
        else:
            rank, world, El = _check_shard(shard, E)
        self.shard, self.bound = (rank, world), shard is None
        self.group = group
        self._init_schedule(path, config, scheduler)
        self.num_experts = E
        self.num_experts_per_rank = El
        self.num_activated_experts = layer.num_activated_experts
        self.gate = layer.gate
        self.shared_experts = layer.shared_experts
        self._dims = (layer.experts[0].w1.in_features, layer.experts[0].w1.out_features)
        self._force_inference_output = layer._force_inference_output
        if local_experts is None:
            mine = [layer.experts[e] for e in range(rank * El, (rank + 1) * El)]
            gate_up = torch.stack([torch.cat([m.w1.weight.detach().t(), m.w3.weight.detach().t()], dim=1) for m in mine])
            down = torch.stack([m.w2.weight.detach().t() for m in mine])
        else:
            dim, inter = self._dims
            gate_up = _check_local_experts("gate_up_local", local_experts[0], (El, dim, 2 * inter))
            down = _check_local_experts("down_local", local_experts[1], (El, inter, dim))
        self.gate_up = nn.Parameter(gate_up.contiguous(), requires_grad=False)
        self.down = nn.Parameter(down.contiguous(), requires_grad=False)

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, **kwargs) -> "HiDreamMoEEPLayer":
        """Build from a diffusers HiDream ``MOEFeedForwardSwiGLU``; keeps this rank's experts."""
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_experts", "num_activated_experts")):
            raise TypeError(f"expected a diffusers MOEFeedForwardSwiGLU, got {type(layer).__name__}")
        return cls(layer, group, **kwargs)

    @classmethod
    def from_shard(cls, layer: nn.Module, gate_up_local: torch.Tensor, down_local: torch.Tensor,
                   shard: tuple[int, int], **kwargs) -> "HiDreamMoEEPLayer":
        """Build from a ``MOEFeedForwardSwiGLU`` whose routed experts were never materialised (meta) and this
        rank's experts only: gate_up_local (E/world, hidden, 2*inter) = ``[w1.T | w3.T]`` of experts
        ``[rank*E/world, (rank+1)*E/world)``, down_local (E/world, inter, hidden) = their ``w2.T``.
        Unbound until ``bind(group)`` (done by `parallelize`).
        """
        if not all(hasattr(layer, a) for a in ("gate", "experts", "shared_experts", "num_activated_experts")):
            raise TypeError(f"expected a diffusers MOEFeedForwardSwiGLU, got {type(layer).__name__}")
        return cls(layer, None, shard=shard, local_experts=(gate_up_local, down_local), **kwargs)

    def to_layer(self) -> nn.Module:
        """A full diffusers ``MOEFeedForwardSwiGLU`` again (collective: all-gathers the expert shards)."""
        self._check_gatherable()
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        dim, inter = self._dims
        layer = MOEFeedForwardSwiGLU.__new__(MOEFeedForwardSwiGLU)
        nn.Module.__init__(layer)
        from diffusers.models.transformers.transformer_hidream_image import HiDreamImageFeedForwardSwiGLU

        gate_up = _all_gather_expert_shards(self.gate_up.data, self.group)
        down = _all_gather_expert_shards(self.down.data, self.group)
        experts = []
        for e in range(self.num_experts):
            m = HiDreamImageFeedForwardSwiGLU.__new__(HiDreamImageFeedForwardSwiGLU)
            nn.Module.__init__(m)
            m.w1 = nn.Linear(dim, inter, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            m.w3 = nn.Linear(dim, inter, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            m.w2 = nn.Linear(inter, dim, bias=False, device=gate_up.device, dtype=gate_up.dtype)
            with torch.no_grad():
                m.w1.weight.copy_(gate_up[e, :, :inter].t())
                m.w3.weight.copy_(gate_up[e, :, inter:].t())
                m.w2.weight.copy_(down[e].t())
            experts.append(m)
        layer.shared_experts = self.shared_experts
        layer.experts = nn.ModuleList(experts)
        layer._force_inference_output = self._force_inference_output
        layer.gate = self.gate
        layer.num_activated_experts = self.num_activated_experts
        return layer

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq_local, hidden); returns (batch, seq_local, hidden)."""
        self._check_bound()
        bs, s_loc, dim = x.shape
        topk_idx, topk_weight, _ = self.gate(x)  # (tokens, k)
        k = topk_idx.shape[1]
        tokens = bs * s_loc
        token_idx = torch.arange(tokens, device=x.device).repeat_interleave(k)
        shared = self.shared_experts(x).reshape(tokens, dim)
        # Token choice: an expert's rows depend on the routing; plan for the even share of the group's pairs
        # (a shape, not a routing outcome, so the decision is made once per token count).
        _, world = world_of(self.group)
        path, lead = self._schedule(x, hidden=dim, intermediate=self._dims[1],
                                    rows_per_expert=-(-tokens * world * k // self.num_experts))
        out = ep_moe_forward(
            x.reshape(tokens, dim), token_idx, topk_idx.reshape(-1).long(), topk_weight.reshape(-1).float(),
            self.gate_up, self.down, shared, num_experts=self.num_experts, group=self.group,
            path=path, lead=lead, config=self.config,
        )  # fmt: skip
        return out.reshape(bs, s_loc, dim)
