"""`patches.host_syncs`: the NucleusMoE forward without its per-forward host-to-device copies, the same bits."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from xstage_dit.families import load_pipeline
from xstage_dit import _diffusers_private as private
from xstage_dit.features.host_syncs import RopeCacheHook, remove_host_copies


@pytest.fixture(scope="module")
def transformer():
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    return pipe.transformer


def inputs(device="cpu", seed=0, text_len=12, masked=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, text_len, dtype=torch.bool)
    mask[:, text_len - 3:] = False  # padding at the end, as a tokenizer leaves it
    return dict(hidden_states=torch.randn(1, 64, 16, generator=g).to(device),
                encoder_hidden_states=torch.randn(1, text_len, 32, generator=g).to(device),
                encoder_hidden_states_mask=mask.to(device) if masked else None,
                timestep=torch.tensor([0.5]).to(device), img_shapes=[(1, 8, 8)], return_dict=False)


class HostCopies(TorchDispatchMode):
    """Counts copies from a CPU tensor into a tensor on another device (``.to(device)`` of a host tensor)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(i.device.type == "cpu" for i in ins) and any(o.device.type != "cpu" for o in outs):
            self.count += 1
        return out


def count_host_copies(monkeypatch, fn) -> int:
    """Host-to-device copies `fn` makes: ``.to`` of host tensors, plus ``torch.tensor`` / ``torch.as_tensor`` of
    host values onto a device (those copy below the dispatcher's Python key, so they are counted at the call)."""
    made = [0]
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def counting(*args, real=real, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                made[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    with HostCopies() as mode:
        fn()
    monkeypatch.undo()
    return made[0] + mode.count


def test_same_bits_and_the_rope_cache_hits(transformer):
    with torch.no_grad():
        before = [transformer(**inputs(seed=s))[0] for s in (0, 1)]
        undo, changed = remove_host_copies(transformer)
        try:
            assert changed == 1
            hook = transformer.pos_embed._diffusers_hook.get_hook("xstage-rope-cache")
            assert isinstance(hook, RopeCacheHook)
            after = [transformer(**inputs(seed=s))[0] for s in (0, 1)]
            other_text = transformer(**inputs(seed=0, text_len=9, masked=False))[0]
            assert (hook.misses, hook.hits) == (2, 1)  # one entry per text length, reused by the second call
        finally:
            undo()
        for b, a in zip(before, after):
            assert torch.equal(a, b)
        with torch.no_grad():
            assert torch.equal(other_text, transformer(**inputs(seed=0, text_len=9, masked=False))[0])


def test_undo_restores_the_tables_the_hook_and_the_helper(transformer):
    from diffusers.models.transformers import transformer_nucleusmoe_image as mod

    tables = (transformer.pos_embed.pos_freqs, transformer.pos_embed.neg_freqs)
    original = mod._compute_text_seq_len_from_mask
    undo_a, _ = remove_host_copies(transformer)
    undo_b, _ = remove_host_copies(torch.nn.Sequential(transformer.pos_embed.__class__(10000, [8, 12, 12], True)))
    assert mod._compute_text_seq_len_from_mask is not original
    undo_a()
    assert mod._compute_text_seq_len_from_mask is not original  # the other patched model still relies on it
    undo_b()
    assert mod._compute_text_seq_len_from_mask is original
    assert (transformer.pos_embed.pos_freqs, transformer.pos_embed.neg_freqs) == tables
    registry = getattr(transformer.pos_embed, "_diffusers_hook", None)
    assert registry is None or registry.get_hook("xstage-rope-cache") is None
    assert remove_host_copies(torch.nn.Linear(2, 2))[1] == 0  # nothing to change: left alone


def test_no_host_copies_per_forward_on_another_device(monkeypatch):
    """On the meta device (a stand-in for the GPU: every host tensor reaching it is a copy): diffusers' forward
    copies four host values a call (the rope table, two scalars, the text length); patched, none after the
    first call of a shape."""
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device=torch.device("cpu"), seed=0)
    # parameters to meta (grouped_mm's meta kernel takes bf16 only); the rope tables, plain attributes, stay put
    model = pipe.transformer.to("meta")

    args = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs("meta").items()}

    def run():
        model(**args)

    with torch.no_grad():
        run()  # diffusers' own per-module caches (its lru_cache of the image frequencies) fill here
        assert count_host_copies(monkeypatch, run) == 4
        undo, _ = remove_host_copies(model)
        try:
            run()
            assert count_host_copies(monkeypatch, run) == 0
        finally:
            undo()
        assert count_host_copies(monkeypatch, run) == 4


@pytest.fixture
def deterministic():
    """diffusers' NucleusMoE combines the experts' rows with a CUDA ``scatter_add`` whose atomics add in no fixed
    order: two plain bf16 forwards differ by an ulp here and there (seen on the H100 at 14951cd). torch's
    deterministic mode runs it as a sorted ``index_put_`` (warn_only: cuBLAS would otherwise ask for a workspace
    setting that must precede its first call), so "the same bits" compares the patch and not the atomics."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)


@pytest.mark.gpu
def test_on_the_gpu_the_tables_move_and_the_copies_are_gone(monkeypatch, deterministic):
    """The real case: tiny NucleusMoE on the GPU (bf16). diffusers' forward copies four host values to the GPU a
    call; patched, the rope tables sit on the GPU and a forward of a shape seen before copies none; the rope
    outputs and the forward are the same bits."""
    pipe = load_pipeline("tiny-nucleusmoe", dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    model = pipe.transformer
    # The rope tables (plain attributes) on the CPU, as a pipeline loaded from a folder and moved by .to("cuda")
    # has them (build_module puts them there; at e7d4ea3 it built them on the GPU and diffusers copied three).
    assert model.pos_embed.pos_freqs.device.type == "cpu"
    args = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in inputs("cuda").items()}
    cuda = torch.device("cuda")
    with torch.no_grad():
        rope_want = model.pos_embed([(1, 8, 8)], device=cuda, max_txt_seq_len=12)
        want = model(**args)[0]
        assert torch.equal(model(**args)[0], want), "the plain forward is not deterministic on this GPU"
        assert count_host_copies(monkeypatch, lambda: model(**args)) == 4
        undo, _ = remove_host_copies(model)
        try:
            assert model.pos_embed.pos_freqs.device.type == "cuda" and model.pos_embed.neg_freqs.is_cuda
            rope = model.pos_embed([(1, 8, 8)], device=cuda, max_txt_seq_len=12)
            first = model(**args)[0]
            assert count_host_copies(monkeypatch, lambda: model(**args)) == 0
            again = model(**args)[0]
        finally:
            undo()
        assert model.pos_embed.pos_freqs.device.type == "cpu"  # diffusers' own placement, back
    assert all(torch.equal(a, b) for a, b in zip(rope, rope_want, strict=True))
    assert torch.equal(first, want) and torch.equal(again, want)


@pytest.mark.parametrize("rows", [[9, 12], [0, 12], [12, 12], [0, 0]])
def test_the_text_length_helper_equals_diffusers(rows):
    from diffusers.models.transformers import transformer_nucleusmoe_image as mod

    original = mod._compute_text_seq_len_from_mask
    assert original is not private._text_seq_len_on_device  # no restored stack left the swap behind
    states = torch.randn(len(rows), 12, 4)
    mask = torch.arange(12)[None, :] < torch.tensor(rows)[:, None]
    for m in (mask, mask.to(torch.int64), None):
        want, got = original(states, m), private._text_seq_len_on_device(states, m)
        assert want[0] == got[0]
        for w, g in zip(want[1:], got[1:]):
            assert (w is None and g is None) or (torch.equal(w, g) and w.dtype == g.dtype)
    with pytest.raises(ValueError, match="must match"):
        private._text_seq_len_on_device(states, mask[:, :5])
