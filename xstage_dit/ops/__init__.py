"""Public ops, one module each, with a pure-torch reference next to every fast path:

- ``xstage_dit.ops.attention``: ``ulysses_attention`` (fused Ulysses attention) and
  ``ulysses_attention_reference``;
- ``xstage_dit.ops.moe``: the expert-parallel MoE dispatch / expert MLP / combine;
- ``xstage_dit.ops.fp8_rows``: ``quantize_rows``, a linear layer's input quantized row-wise to e4m3 in one pass
  (torchao's PerRow activation quantization, with FLUX's concatenation and GELU fused), and its reference.

Each package registers its torch custom ops next to its public function (`registry` holds what they share).
"""
