"""Ulysses attention with the post-attention All-to-All fused into the kernel's epilogue.

`op` holds the public op (`ulysses_attention`), its reference and the serial path; `kernel` the Triton kernel.
"""

from xstage_dit.ops.attention.op import (attention_reference, serial_attention, ulysses_attention,
                                         ulysses_attention_reference)

__all__ = ["attention_reference", "serial_attention", "ulysses_attention", "ulysses_attention_reference"]
