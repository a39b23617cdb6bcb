"""`patches.text_depth`: the text encoder's layers past the deepest hidden state read are not run; the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xstage_dit.families import load_pipeline, model_spec
from xstage_dit.runtime.generation import call_kwargs, run_pipeline
from xstage_dit.features import ParallelConfig, parallelize
from xstage_dit.features.text_depth import layers_needed, skip_unread_layers

CPU = torch.device("cpu")


def pipe_of(name):
    pipe = load_pipeline(name, dtype=torch.float32, device=CPU, seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class LayerCalls:
    """Counts the decoder layers' forward calls of a text encoder."""

    def __init__(self, pipe):
        self.count = 0
        self.hooks = [layer.register_forward_pre_hook(self._seen) for layer in pipe.text_encoder.get_decoder().layers]

    def _seen(self, *_):
        self.count += 1

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def test_layers_needed_counts_from_either_end():
    assert layers_needed([-8], 36) == 29  # NucleusMoE: hidden_states[-8] of 37 entries = layer 28's output
    assert layers_needed([10, 20, 30], 40) == 30  # FLUX.2
    assert layers_needed([-1], 36) == 36 and layers_needed([36], 36) == 36  # the last entry: every layer
    assert layers_needed([0], 4) == 0  # the embeddings alone
    assert layers_needed([-40], 36) == 36 and layers_needed([50], 36) == 36  # out of range: the pipeline's error


@pytest.mark.parametrize("name,kwargs,read", [
    ("tiny-nucleusmoe", {}, 1),                               # default return_index -8 of 8 layers: layer 0
    ("tiny-nucleusmoe", {"return_index": -3}, 6),
    ("tiny-nucleusmoe", {"return_index": -1}, 8),              # the last (normed) entry: every layer
    ("tiny-flux2", {"text_encoder_out_layers": (1,)}, 1),
    ("tiny-flux2", {"text_encoder_out_layers": (1, 2)}, 2),
])
def test_the_embedding_is_the_same_bits_with_fewer_layers(name, kwargs, read):
    pipe = pipe_of(name)
    with torch.no_grad():
        expected = pipe.encode_prompt(prompt=["a red fox", "snow"], device=CPU, **kwargs)[0]
        undo = skip_unread_layers(pipe)
        calls = LayerCalls(pipe)
        try:
            got = pipe.encode_prompt(prompt=["a red fox", "snow"], device=CPU, **kwargs)[0]
        finally:
            calls.remove()
            undo()
    assert torch.equal(got, expected)
    num_layers = len(pipe.text_encoder.get_decoder().layers)
    assert calls.count == num_layers  # the hooks still fire (the hidden-state tuple keeps its length) ...
    assert not any("forward" in vars(layer) for layer in pipe.text_encoder.get_decoder().layers)
    assert "encode_prompt" not in vars(pipe)
    assert read <= num_layers


def test_skipped_layers_do_no_work(monkeypatch):
    pipe = pipe_of("tiny-nucleusmoe")
    layer_class = type(pipe.text_encoder.get_decoder().layers[0])
    real, ran = layer_class.forward, []

    def counting(self, *args, **kwargs):
        ran.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", counting)
    undo = skip_unread_layers(pipe)
    with torch.no_grad():
        pipe.encode_prompt(prompt=["a fox"], device=CPU)  # return_index -8 of 8 layers: layer 0 alone
    assert len(ran) == 1
    undo()
    ran.clear()
    with torch.no_grad():
        pipe.encode_prompt(prompt=["a fox"], device=CPU)
    assert len(ran) == 8


def test_through_parallelize_the_images_are_the_same_and_other_pipelines_are_left_alone():
    pipe = pipe_of("tiny-nucleusmoe")
    spec = model_spec("tiny-nucleusmoe")
    images = lambda: np.asarray(run_pipeline(pipe, **call_kwargs(pipe, spec, prompt="a fox", seed=1, steps=2)).images[0])  # noqa: E731
    expected = images()
    handle = parallelize(pipe, ParallelConfig())
    try:
        assert handle.text_layers_skipped and handle.describe_pipeline()["text_layers_unread_skipped"]
        got = images()
    finally:
        handle.restore()
    # the VAE's 2-D convolutions (parallelize's one_frame_vae) round differently in float32: compare as images
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert "encode_prompt" not in vars(pipe)
    assert skip_unread_layers(pipe_of("tiny-qwenimage")) is None  # reads the last layer: nothing to skip
