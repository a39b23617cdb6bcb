"""A request's LoRA adapters are part of what it is: checked on construction, kept by `per_image`, and part of the
batch key (one pipeline call has one adapter set)."""

from __future__ import annotations

import pytest

from xstage_dit.runtime.generation import GenerationRequest
from xstage_dit.runtime.memory import GenerationOutOfMemory, describe_items, is_out_of_memory


def _request(**fields) -> GenerationRequest:
    return GenerationRequest(kind="image", prompt="a fox", width=64, height=64, steps=2, guidance=3.5, **fields)


def test_adapters_split_batches_and_travel_with_each_image():
    plain, a, a_half, ab = (_request(), _request(lora=(("a", 1.0),)), _request(lora=(("a", 0.5),)),
                            _request(lora=(("a", 1.0), ("b", 1.0))))
    assert len({r.batch_key for r in (plain, a, a_half, ab)}) == 4
    assert a.batch_key == _request(lora=(("a", 1.0),), seed=9).batch_key
    assert all(one.lora == ab.lora for one in _request(lora=ab.lora, n=3).per_image())


@pytest.mark.parametrize("lora", [["a"], (("a", 1),), (("a",),), ((1, 1.0),)])
def test_malformed_adapter_lists_are_refused(lora):
    with pytest.raises(ValueError, match="expected lora as"):
        _request(lora=lora)


def test_out_of_memory_names_the_request_not_the_allocator():
    import torch

    items = [_request(lora=(("style", 0.8),), n=2)]
    assert describe_items(items) == "64x64, 2 images, LoRA style:0.8"
    video = GenerationRequest(kind="video", prompt="x", width=832, height=480, steps=2, guidance=5.0, num_frames=81)
    assert describe_items([video]) == "832x480, 81 frames, 1 video"
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) and not is_out_of_memory(RuntimeError("x"))
    assert GenerationOutOfMemory.status == 507
