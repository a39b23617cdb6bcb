"""Expert-parallel MoE ops, one module per concern.


- ``config``: ``MoEKernelConfig`` (tile and launch shape of the persistent kernel);
- ``plan``: ``EPPlan`` / ``build_ep_plan`` (every offset from the all-gathered count matrix);
- ``reference``: the pure-torch references (``expert_mlp_reference``, ``expert_mlp_combine_reference``,
  ``combine_reduce_reference``, ``dispatch_reference``);
- ``dispatch``: the count exchange and the library All-to-All of rows (serial / reference paths);
- ``fused``: the Triton launchers (``expert_mlp_combine``, ``push_rows``, ``combine_reduce``) and the
  grouped-matmul baseline (``expert_mlp_combine_grouped``); ``kernel``: the device code;
- ``forward``: ``ep_moe_forward`` (one rank's EP MoE on the path and lead it is handed);
- ``expert_choice``: ``expert_choice_moe`` (an expert-choice layer at world 1: static offsets, no host sync);
- ``custom_ops``: the torch custom ops, registered on import of this package.

The diffusers layers that use them live in ``xstage_dit.features.ep_layers``; the path and lead are
chosen by ``xstage_dit.schedule.moe``.
"""

from xstage_dit.ops.moe import custom_ops  # noqa: F401  (registers torch.ops.xstage_dit.moe_*)
from xstage_dit.ops.moe.config import MoEKernelConfig
from xstage_dit.ops.moe.custom_ops import moe_combine_reduce_op, moe_expert_mlp_combine_op, moe_expert_mlp_rows_op
from xstage_dit.ops.moe.expert_choice import EXPERT_CHOICE_PATHS, expert_choice_moe
from xstage_dit.ops.moe.forward import EP_RUN_PATHS, ep_moe_forward
from xstage_dit.ops.moe.fused import (
    combine_reduce,
    expert_mlp_combine,
    expert_mlp_combine_grouped,
    expert_mlp_rows,
    expert_mlp_rows_grouped,
    push_rows,
)
from xstage_dit.ops.moe.plan import EPPlan, build_ep_plan
from xstage_dit.ops.moe.reference import (
    combine_reduce_reference,
    dispatch_reference,
    expert_mlp_combine_reference,
    expert_mlp_reference,
)

__all__ = [
    "MoEKernelConfig",
    "EPPlan",
    "build_ep_plan",
    "expert_mlp_reference",
    "expert_mlp_combine_reference",
    "combine_reduce_reference",
    "dispatch_reference",
    "expert_mlp_combine",
    "expert_mlp_combine_grouped",
    "combine_reduce",
    "push_rows",
    "ep_moe_forward",
    "EP_RUN_PATHS",
    "moe_combine_reduce_op",
    "moe_expert_mlp_combine_op",
    "moe_expert_mlp_rows_op",
    "expert_mlp_rows",
    "expert_mlp_rows_grouped",
    "expert_choice_moe",
    "EXPERT_CHOICE_PATHS",
]
