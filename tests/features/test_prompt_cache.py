"""`patches.prompt_cache`: CFG's empty negative prompt encoded once, the same images, weights changes seen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.generation import call_kwargs, run_pipeline
from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.prompt_cache import PromptCache, _fingerprint, cache_empty_prompts

MODEL = "tiny-nucleusmoe"


def fresh_pipe():
    pipe = load_pipeline(MODEL, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return fresh_pipe()


def pixels(out) -> np.ndarray:
    return np.stack([np.asarray(image) for image in out.images])


def kwargs_for(pipe, prompt="a red fox", seed=1, **extra):
    kw = call_kwargs(pipe, model_spec(MODEL), prompt=prompt, seed=seed, steps=2)
    kw.update(extra)
    return kw


class EncoderCalls:
    """Counts the text encoder's forward passes (one per prompt list the pipeline encodes)."""

    def __init__(self, pipe, monkeypatch):
        self.count = 0
        forward = pipe.text_encoder.forward

        def counting(*args, **kwargs):
            self.count += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(pipe.text_encoder, "forward", counting)


def test_the_empty_negative_prompt_is_encoded_once_with_the_same_images(pipe, monkeypatch):
    kw = kwargs_for(pipe)
    assert kw.get("guidance_scale", 0) > 1  # CFG on: the pipeline encodes "" as the negative prompt
    reference = [pixels(run_pipeline(pipe, **kwargs_for(pipe, seed=s))) for s in (1, 2, 3)]
    calls = EncoderCalls(pipe, monkeypatch)
    cache = cache_empty_prompts(pipe)
    try:
        assert isinstance(cache, PromptCache)
        cached = [pixels(run_pipeline(pipe, **kwargs_for(pipe, seed=s))) for s in (1, 2, 3)]
        assert calls.count == 3 + 1  # each call's own prompt, and "" once
        assert (cache.hits, cache.misses) == (2, 1)
    finally:
        cache.restore()
    for before, after in zip(reference, cached):
        np.testing.assert_array_equal(before, after)


def test_a_user_prompt_and_a_user_negative_prompt_are_always_encoded(pipe, monkeypatch):
    calls = EncoderCalls(pipe, monkeypatch)
    cache = cache_empty_prompts(pipe)
    try:
        for _ in range(2):
            run_pipeline(pipe, **kwargs_for(pipe, negative_prompt="blurry"))
        assert calls.count == 4  # nothing cached: neither prompt is ""
        assert (cache.hits, cache.misses) == (0, 0)
        embeds, mask = pipe.encode_prompt(prompt="a fox", device=torch.device("cpu"))
        # the caller's own embeddings (tensors) are passed through, never keyed
        pipe.encode_prompt(prompt_embeds=embeds, prompt_embeds_mask=mask, device=torch.device("cpu"))
        assert (cache.hits, cache.misses) == (0, 0)
    finally:
        cache.restore()


def test_a_changed_weight_is_seen_and_encoded_again():
    pipe = fresh_pipe()
    cache = cache_empty_prompts(pipe)
    device = torch.device("cpu")
    with torch.no_grad():
        first, _ = pipe.encode_prompt(prompt=[""], device=device)
        again, _ = pipe.encode_prompt(prompt=[""], device=device)
        assert (cache.hits, cache.misses) == (1, 1)
        torch.testing.assert_close(first, again, rtol=0, atol=0)
        weight = next(p for name, p in pipe.text_encoder.named_parameters() if "language_model.layers.0." in name)
        weight.add_(0.5)  # in place (load_state_dict copies in place too): the version counter moves
        changed, _ = pipe.encode_prompt(prompt=[""], device=device)
        assert cache.misses == 2
        cache.restore()
        uncached, _ = pipe.encode_prompt(prompt=[""], device=device)
    assert not torch.equal(changed, first)
    torch.testing.assert_close(changed, uncached, rtol=0, atol=0)


def test_what_it_hands_back_is_a_copy_and_the_key_holds_every_argument(pipe):
    cache = cache_empty_prompts(pipe, entries=1)
    device = torch.device("cpu")
    try:
        with torch.no_grad():
            one, _ = pipe.encode_prompt(prompt=[""], device=device)
            kept = one.clone()
            one.zero_()  # a caller modifying its result leaves the kept one alone
            again, _ = pipe.encode_prompt(prompt=[""], device=device)
            torch.testing.assert_close(again, kept, rtol=0, atol=0)
            two, _ = pipe.encode_prompt(prompt=["", ""], device=device)  # another batch: another key
            assert two.shape[0] == 2 and (cache.hits, cache.misses) == (1, 2)
            pipe.encode_prompt(prompt=[""], device=device, max_sequence_length=64)  # another argument
            pipe.encode_prompt(prompt=[""], device=device)  # evicted by entries=1: encoded again
            assert (cache.hits, cache.misses) == (1, 4)
        pipe.encode_prompt(prompt=[""], device=device)  # autograd on: not cached, not counted
        assert (cache.hits, cache.misses) == (1, 4)
    finally:
        cache.restore()


def test_restore_gives_back_the_pipelines_own_method(pipe):
    cache = cache_empty_prompts(pipe)
    assert pipe.encode_prompt is cache and cache_empty_prompts(pipe) is None  # never wrapped twice
    cache.restore()
    cache.restore()
    assert "encode_prompt" not in vars(pipe)
    assert pipe.encode_prompt.__func__ is type(pipe).encode_prompt


def test_parallelize_keeps_it_for_pipelines_that_encode_one_prompt_list(pipe):
    handle = parallelize(pipe, ParallelConfig())
    try:
        assert isinstance(handle.prompt_cache, PromptCache) and pipe.encode_prompt is handle.prompt_cache
    finally:
        handle.restore()
    assert "encode_prompt" not in vars(pipe)
    wan = load_pipeline("tiny-wan", dtype=torch.float32, device=torch.device("cpu"), seed=0)
    assert cache_empty_prompts(wan) is None  # encodes its negative prompt inside the same call
    assert cache_empty_prompts(pipe.transformer) is None


class FakeLoraLayer(torch.nn.Module):
    """The attributes a PEFT tuner layer has (peft is not a dependency here)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scaling = {"default": 1.0}
        self.active_adapters = ["default"]
        self.merged_adapters = []
        self.disable_adapters = False


class FakePipe:
    def __init__(self):
        self.text_encoder = torch.nn.Sequential(FakeLoraLayer())
        self.tokenizer = object()

    @property
    def components(self):
        return {"text_encoder": self.text_encoder, "tokenizer": self.tokenizer, "transformer": None}


def test_the_fingerprint_moves_with_weights_adapters_tokenizer_and_casts():
    pipe = FakePipe()
    base = _fingerprint(pipe)
    assert _fingerprint(pipe) == base
    layer = pipe.text_encoder[0]
    layer.scaling["default"] = 0.5
    assert _fingerprint(pipe) != base
    layer.scaling["default"] = 1.0
    layer.disable_adapters = True
    assert _fingerprint(pipe) != base
    layer.disable_adapters = False
    assert _fingerprint(pipe) == base
    pipe.tokenizer = object()
    swapped = _fingerprint(pipe)
    assert swapped != base
    pipe.text_encoder.to(torch.float64)
    assert _fingerprint(pipe) != swapped
