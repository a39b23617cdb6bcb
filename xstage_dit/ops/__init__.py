"""Public ops, one module each, with a pure-torch reference next to every fast path:

- ``xstage_dit.ops.attention.op``: ``ulysses_attention`` (fused Ulysses attention) and
  ``ulysses_attention_reference``.

Fast ops are registered as torch custom ops in ``xstage_dit.ops.registry``.
"""
