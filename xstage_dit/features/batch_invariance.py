"""Make a batched pipeline call give each image the bytes it gets alone (the server batches only then).

    handle = batch_invariant(pipe)      # before the server's warm-up probe compares batched with single images
    ...
    handle.restore()

Where a batch of n images can differ from n single calls on a GPU, and what this does about each:

- **Linear layers whose input has a few rows** (AdaLN modulation, time/guidance embeddings, pooled text
  projections: M = batch). cuBLAS picks another kernel for M = 1 than for M = 4 (a GEMV-like kernel against a
  GEMM tile), which sums in another order. Here such a layer always runs at ``SMALL_ROWS`` rows (zero-padded,
  sliced back): one kernel for every batch up to ``SMALL_ROWS``, each row's sum independent of the others.
  The padded GEMM reads the same weights, which is what these memory-bound GEMMs cost.
- **Token GEMMs of short streams** (M = n * tokens with fewer than ``SPLIT_ROWS`` tokens a sample, e.g. FLUX's
  512 text tokens in its double-stream blocks): few output tiles, where cuBLAS may split K for one sample and
  not for n; run one sample at a time, each at its single-image shape.
- **Narrow token GEMMs** (fewer than ``NARROW_FEATURES`` outputs, e.g. FLUX's final ``proj_out``, 3072 -> 64):
  few output tiles at any batch, so cuBLAS may split K for one sample and not for n, as above; run one sample
  at a time. (FLUX at 512², 2026-12-04 H200: batched images still differed with only the two rules above.)
- **Token GEMMs of long streams** (M = n * tokens, ``SPLIT_ROWS`` or more a sample): measured row-for-row
  identical across batch sizes for FLUX's shapes (1024-4608 tokens a sample, K x N up to 15360 x 3072) on the
  H200, with every BLAS setting (``benchmarks/bench_serving.py batch-invariance``,
  ``benchmarks/results/serving/batch-invariance-h200-*.md``): left batched.
- **FP8 linear layers with one activation scale a tensor** (`features.fp8` tensor-wise: torchao scales each
  call's whole input by its amax): in a batch the amax is the batch's, so a sample's rounding would depend on its
  neighbours; such a layer runs one sample at a time, on the amax it has alone. Row-wise FP8 (the default: a
  scale per token) follows the rules above.
- **Convolutions inside the transformer** (patch embeddings: HunyuanImage's Conv2d): one sample at a time, as
  the VAE (the convolution library may pick another algorithm for another batch size; on the CPU a batch of 2
  of tiny HunyuanImage differed by one level in one channel without this, and not with it).
- **Text encoders**: run one prompt at a time (their GEMMs see M = 77 or 512 rows whatever the batch); a
  prompt costs milliseconds against seconds of denoising.
- **VAE decode**: one image at a time (``enable_slicing``): cuDNN may pick another convolution algorithm for
  another batch size.

- **Attention over padded text** (NucleusMoE: image queries attend to image + text keys, the text padded to the
  longest prompt of the call and masked): the keys a sample's softmax sums over grow with its neighbours' prompts,
  and a kernel that blocks its reduction by the key length sums the real keys in another order (the CPU's, on an
  AMD EPYC in float32: one pixel of a 128² tiny NucleusMoE image one level apart, alone against batched with a
  longer prompt under CFG batching). Each sample's attention runs alone with its text cut after its last real token
  (`_TrimmedTextAttention`), the length it has alone whatever it is batched with. On the CPU only: a GPU's flash
  kernels (cuDNN, FlashAttention, torch's memory-efficient SDPA) block the keys in fixed tiles, where masked
  padding adds exact zeros after the real keys' sums, so the padding changes nothing there; and a per-sample,
  data-dependent cut would cost the GPU a host read a forward and recompile a compiled block per text length.

Norms and elementwise ops are per sample already. The server still checks the result at warm-up
(`server.batcher`): a size whose batched images differ from its single ones runs first come, first served.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from xstage_dit.families.registry import record_for_transformer
from xstage_dit.families.spec import TEXT_ENCODER_COMPONENTS
from xstage_dit.features import fp8_few_rows
from xstage_dit.features.instance_attr import set_on_instance

__all__ = ["SMALL_ROWS", "SPLIT_ROWS", "NARROW_FEATURES", "BatchInvarianceHandle", "InvariantLinear",
           "batch_invariant", "batch_invariant_for", "is_linear", "make_invariant", "apply"]

SMALL_ROWS = 16  # batches up to this many images share one kernel for their few-row linear layers
SPLIT_ROWS = 1024  # a (batch, tokens, features) input with fewer tokens a sample runs one sample at a time
NARROW_FEATURES = 256  # a linear layer with fewer outputs runs one sample at a time (few output tiles)


class BatchInvarianceHandle:
    """What `batch_invariant` changed; ``restore()`` puts every module back (idempotent)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.linears = 0
        self.convs = 0
        self.trimmed_attentions = 0
        self.encoders: list[str] = []
        self.vae_sliced = False

    def describe(self) -> dict:
        return {"small_row_linears": self.linears, "per_sample_convs": self.convs,
                "per_sample_trimmed_attentions": self.trimmed_attentions,
                "per_prompt_encoders": list(self.encoders),
                "vae_one_image_at_a_time": self.vae_sliced}

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _one_sample_at_a_time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn on each sample of x (dim 0) alone, at the shape its single-image call has; the results concatenated."""
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def _scales_its_input_as_a_whole(module: torch.nn.Linear) -> bool:
    """Whether `module`'s weight is a torchao FP8 tensor that quantizes its input with one scale for the whole
    tensor (PerTensor activations): the scale of a batch is then its neighbours' too."""
    kwargs = getattr(module.weight, "act_quant_kwargs", None)
    return kwargs is not None and type(getattr(kwargs, "granularity", None)).__name__ == "PerTensor"


def _padded_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // module.in_features if module.in_features else 0
    whole = _scales_its_input_as_a_whole(module)
    per_sample = rows // max(x.shape[0], 1) < SPLIT_ROWS or module.out_features < NARROW_FEATURES or whole
    # a few-row 2-D input is one row a sample (AdaLN / time embeddings): a whole-tensor scale must not span them
    few_rows = x.dim() == 2 and 1 < rows < SMALL_ROWS and whole
    if (x.dim() >= 3 and x.shape[0] > 1 and per_sample) or few_rows:
        # each sample through the few-row rule below too, as its single-image call goes
        return _one_sample_at_a_time(functools.partial(_padded_linear, module), x)
    if not 0 < rows < SMALL_ROWS:
        return fp8_few_rows.linear(module, x)  # F.linear, but a marked FP8 layer's bias apart on few rows
    flat = x.reshape(rows, module.in_features)
    padded = F.pad(flat, (0, 0, 0, SMALL_ROWS - rows))
    return fp8_few_rows.linear(module, padded)[:rows].reshape(*x.shape[:-1], module.out_features)


class InvariantLinear(torch.nn.Linear):
    """A Linear layer run by `_padded_linear`. The feature swaps a plain Linear's class to this one (and back on
    restore) rather than giving each layer its own ``forward``: Dynamo guards an instance ``forward`` by its object
    id, so per-layer forwards compiled one graph per block instance (57 for FLUX.1-dev instead of 2; with FP8
    weights the bench's compiled FP8 rows never finished, H100 2026-12-06), while a class is one guard for all.
    A LoRA adapter's A and B layers take it too (`make_invariant`): nothing refers back to the module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _padded_linear(self, x)


def make_invariant(module: torch.nn.Module) -> None:
    """Give a plain Linear `module` this feature's rule (`InvariantLinear`); other modules are left as they are."""
    # FP8's few-rows class (`fp8_few_rows`) too: `_padded_linear` keeps its rule; restore puts that class back
    if type(module) in (torch.nn.Linear, fp8_few_rows.Fp8FewRowsLinear) and "forward" not in vars(module):
        module.__class__ = InvariantLinear


def is_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is a plain Linear layer, with this feature's rule (`InvariantLinear`) or without it; not a
    subclass of another kind (quantized, LoRA)."""
    return type(module) in (torch.nn.Linear, InvariantLinear)


_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _invariant_conv(base: type) -> type:
    """`base` (a Conv class) run one sample at a time: the class the feature swaps a plain convolution's to (a
    class, not an instance forward, for the reason `InvariantLinear` gives)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or x.shape[0] <= 1:
            return base.forward(self, x)
        return _one_sample_at_a_time(functools.partial(base.forward, self), x)

    name = f"Invariant{base.__name__}"
    return type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                "__doc__": f"A {base.__name__} run one sample at a time (batch invariance)."})


InvariantConv1d, InvariantConv2d, InvariantConv3d = (_invariant_conv(c) for c in _CONVS)
# FP8's few-rows class (`fp8_few_rows`) takes the linear rule too: `_padded_linear` keeps its bias apart on few rows
_INVARIANT = {torch.nn.Linear: InvariantLinear, fp8_few_rows.Fp8FewRowsLinear: InvariantLinear,
              torch.nn.Conv1d: InvariantConv1d, torch.nn.Conv2d: InvariantConv2d, torch.nn.Conv3d: InvariantConv3d}


class _TrimmedTextAttention:
    """An attention processor's call made per sample, each with its text cut after its last real token.

    Takes the processor's (attn, hidden_states (B, N_img, C), encoder_hidden_states (B, N_txt, C_txt),
    attention_mask (B, N_img + N_txt) bool, image_rotary_emb (img_freqs, txt_freqs with N_txt rows)); anything else
    (no mask, other shapes, extra arguments) goes to the processor as it is. The text lengths are read once per
    mask (every block of a forward gets the same mask tensor): one host read a forward, not one a block."""

    def __init__(self, inner: Any, lengths: dict) -> None:
        self.inner, self._lengths = inner, lengths

    def __getattr__(self, name: str) -> Any:  # the processor's own attributes (backend, parallel config)
        if name in ("inner", "_lengths"):  # not set yet (a copy being built): no recursion through here
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        plain = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if kwargs or not self._trimmable(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
            return self.inner(*plain, **kwargs)
        image = hidden_states.shape[1]
        img_freqs, txt_freqs = image_rotary_emb
        outs = []
        for i, length in enumerate(self._text_lengths(attention_mask, image)):
            outs.append(self.inner(attn, hidden_states[i:i + 1], encoder_hidden_states[i:i + 1, :length],
                                   attention_mask[i:i + 1, :image + length], (img_freqs, txt_freqs[:length])))
        return torch.cat(outs)

    @staticmethod
    def _trimmable(hidden_states, text, mask, rotary) -> bool:
        return (hidden_states.device.type == "cpu" and isinstance(text, torch.Tensor) and text.dim() == 3
                and text.shape[1] > 0 and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                and mask.shape == (hidden_states.shape[0], hidden_states.shape[1] + text.shape[1])
                and isinstance(rotary, (tuple, list)) and len(rotary) == 2 and isinstance(rotary[1], torch.Tensor)
                and rotary[1].shape[0] == text.shape[1])

    def _text_lengths(self, mask: torch.Tensor, image: int) -> list[int]:
        """Each sample's text through its last real token; cached on the mask tensor itself (a slice of it would be
        a new tensor every call)."""
        if self._lengths.get("mask") is not mask:
            text_mask = mask[:, image:]
            positions = torch.arange(1, text_mask.shape[1] + 1, device=mask.device)
            self._lengths.update(mask=mask, lengths=(text_mask * positions).amax(dim=1).tolist())
        return self._lengths["lengths"]


def _patch_forward(module: torch.nn.Module, forward: Callable, handle: BatchInvarianceHandle) -> None:
    handle._undo.append(set_on_instance(module, "forward", forward))


def _swap_class(module: torch.nn.Module, cls: type, handle: BatchInvarianceHandle) -> None:
    original = module.__class__
    module.__class__ = cls
    handle._undo.append(functools.partial(setattr, module, "__class__", original))


def _split(value: Any, batch: int, i: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value[i:i + 1]
    return value


def _merge(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0) if first.dim() > 0 else first
    if isinstance(first, (tuple, list)) and not hasattr(first, "keys"):
        merged = [_merge([p[j] for p in parts]) for j in range(len(first))]
        return type(first)(merged) if isinstance(first, list) else tuple(merged)
    if hasattr(first, "keys"):  # transformers' ModelOutput (an ordered dict): rebuilt field by field
        return type(first)(**{k: _merge([p[k] for p in parts]) for k in first.keys()})
    return first


def _per_prompt(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() == 0 or ids.shape[0] <= 1:
            return forward(*args, **kwargs)
        batch = ids.shape[0]
        parts = [forward(*(_split(a, batch, i) for a in args), **{k: _split(v, batch, i) for k, v in kwargs.items()})
                 for i in range(batch)]
        return _merge(parts)

    return run


def _trim_text_attention(model: torch.nn.Module, handle: BatchInvarianceHandle) -> None:
    lengths: dict = {}  # shared by the blocks: one read of the text lengths a forward
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is None or isinstance(processor, _TrimmedTextAttention) or not hasattr(module, "set_processor"):
            continue
        module.processor = _TrimmedTextAttention(processor, lengths)
        handle._undo.append(functools.partial(setattr, module, "processor", processor))
        handle.trimmed_attentions += 1


def batch_invariant_for(pipe: Any, kind: str) -> BatchInvarianceHandle | None:
    """`batch_invariant(pipe)` for an image pipeline (kind "image"), as `serve`, `generate` and the bench's xstage
    contenders run it; None for a video pipeline (videos run one per call: nothing to keep apart)."""
    if kind not in ("image", "video"):
        raise ValueError(f"expected kind 'image' or 'video', got {kind!r}")
    return batch_invariant(pipe) if kind == "image" else None


def batch_invariant(pipe: Any) -> BatchInvarianceHandle:
    """Patch `pipe` (a diffusers pipeline) so a batch of images is computed as each image alone is (see the
    module docstring): few-row linear layers of the transformer(s) at ``SMALL_ROWS`` rows, short token streams,
    narrow linear layers and convolutions one sample at a time, text encoders one prompt at a time, the VAE
    decoding one image at a time. Returns the handle that undoes it."""
    active = getattr(pipe, "_xstage_batch_invariance", None)
    if active is not None and active._undo:
        # Already patched (the bench's contender, then the server it starts over the same pipeline): the first
        # handle owns the patches; this one reports them and restores nothing.
        shared = BatchInvarianceHandle()
        shared.linears, shared.convs, shared.encoders = active.linears, active.convs, list(active.encoders)
        shared.vae_sliced = active.vae_sliced
        return shared
    handle = BatchInvarianceHandle()
    try:
        for name in ("transformer", "transformer_2"):
            model = getattr(pipe, name, None)
            if not isinstance(model, torch.nn.Module):
                continue
            for module in model.modules():
                # Subclasses (quantized, LoRA) and layers whose forward another patch replaced (sequence-parallel
                # gathers) keep theirs.
                if "forward" in vars(module):
                    continue
                invariant = _INVARIANT.get(type(module))
                if invariant is not None:
                    _swap_class(module, invariant, handle)
                    if invariant is InvariantLinear:
                        handle.linears += 1
                    else:
                        handle.convs += 1
            # its family record: attention over padded text keys and a (batch, image + text) mask
            record = record_for_transformer(model)
            if record is not None and record.facts.padded_text_attention:
                _trim_text_attention(model, handle)
        for name in TEXT_ENCODER_COMPONENTS:
            encoder = getattr(pipe, name, None)
            if isinstance(encoder, torch.nn.Module):
                _patch_forward(encoder, _per_prompt(encoder.forward), handle)
                handle.encoders.append(name)
        vae = getattr(pipe, "vae", None)
        if vae is not None and hasattr(vae, "enable_slicing") and not getattr(vae, "use_slicing", False):
            vae.enable_slicing()
            handle._undo.append(vae.disable_slicing)
            handle.vae_sliced = True
    except Exception:
        handle.restore()
        raise
    setattr(pipe, "_xstage_batch_invariance", handle)
    handle._undo.insert(0, lambda: vars(pipe).pop("_xstage_batch_invariance", None))
    return handle


def apply(pipe: Any, enabled: bool, ctx) -> Callable[[], None] | None:
    """The stack's batch invariance: `batch_invariant` on a pipeline (not a bare transformer), after the parallel
    patches (layers whose forward another patch replaced keep theirs); its handle in ``ctx.batch_invariance``."""
    if not ctx.is_pipeline:
        return None
    ctx.batch_invariance = batch_invariant(pipe)
    return ctx.batch_invariance.restore
