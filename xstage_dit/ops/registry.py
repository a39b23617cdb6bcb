"""The namespace every torch custom op of the project is registered under (``torch.ops.xstage_dit``).

Each op package registers its own ops (``torch.library.custom_op`` + ``register_fake``) next to its public
function: ``xstage_dit::ulysses_attention`` in `ops.attention`, the MoE ops in `ops.moe.custom_ops`. Process
groups cannot cross the op boundary: callers pass ``comm.group_names.group_name(group)`` and the op resolves
it with ``resolve_group``.
"""

NAMESPACE = "xstage_dit"
