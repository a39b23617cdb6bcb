"""Input images of a request (`xstage_dit.runtime.conditioning`, `generation.request_for` / `pipeline_kwargs`): checked
against the pipeline's family record with errors naming the field, passed under each pipeline's own argument, and
part of the batch key so only requests with the same images (and only where the pipeline can) share a call."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from PIL import Image

from xstage_dit.families import model_spec
from xstage_dit.families.record import ImageInputFacts
from xstage_dit.families.registry import image_inputs_for, records
from xstage_dit.runtime.conditioning import (ImageInputError, InputImages, default_size, image_kwargs, mask_from_image,
                                             synthetic_image, warmup_inputs)
from xstage_dit.runtime.generation import fixed_kwargs, pipeline_kwargs, request_for


def _image(seed: int, width: int = 96, height: int = 64, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (height, width) if channels is None else (height, width, channels)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def test_every_record_names_real_arguments_of_its_pipelines():
    """The facts are read from each pipeline's __call__ in diffusers 0.42.1: the names must be its arguments."""
    import diffusers

    checked = 0
    for record in records().values():
        for pipeline, facts in record.image_inputs.items():
            params = inspect.signature(getattr(diffusers, pipeline).__call__).parameters
            for name in (facts.argument, facts.mask_argument, facts.area_argument, *facts.extra_arguments):
                assert name is None or name in params, (pipeline, name)
            checked += 1
    assert checked >= 9  # Kontext, img2img, Fill, FLUX.2, Qwen edit (2), Wan I2V, LTX I2V, CogVideoX I2V (+ChronoEdit)


@pytest.mark.parametrize("model, images, mask, param, needle", [
    ("tiny-flux", 1, False, "image", "expected no input image for tiny-flux (its pipeline takes none), got 1"),
    ("tiny-flux-kontext", 2, False, "image", "expected 0 to 1 input image(s) for tiny-flux-kontext, got 2"),
    ("tiny-flux-img2img", 0, False, "image", "expected 1 input image(s) for tiny-flux-img2img, got 0"),
    ("tiny-flux-kontext", 1, True, "mask", "expected no mask for tiny-flux-kontext (its pipeline takes none)"),
    ("tiny-wan", 1, False, "image", "expected no input image for tiny-wan (its pipeline takes none), got 1"),
    ("tiny-wan-i2v", 2, False, "image", "expected 1 input image(s) for tiny-wan-i2v, got 2"),
    ("tiny-wan22-i2v", 2, False, "image", "expected 1 input image(s) for tiny-wan22-i2v, got 2"),
    ("tiny-wan-flf2v", 1, False, "image", "expected 2 input image(s) for tiny-wan-flf2v, got 1"),
    ("tiny-wan-flf2v", 3, False, "image", "expected 2 input image(s) for tiny-wan-flf2v, got 3"),
    ("tiny-flux2", 11, False, "image", "expected 0 to 10 input image(s) for tiny-flux2, got 11"),
    ("tiny-qwenimage-edit-plus", 4, False, "image", "expected 1 to 3 input image(s)"),
])
def test_bad_image_counts_are_named(model, images, mask, param, needle):
    spec = model_spec(model)
    with pytest.raises(ImageInputError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        request_for(spec, prompt="a cat", images=[_image(i) for i in range(images)],
                    mask=_image(9, mode="L") if mask else None)
    assert err.value.param == param


def test_flux2_references_follow_its_image_check():
    spec = model_spec("tiny-flux2")
    with pytest.raises(ImageInputError, match=r"expected images of at least 64x64 pixels for tiny-flux2, got 48x64 "
                                              r"\(image 2\)"):
        request_for(spec, prompt="a cat", images=[_image(1, 64, 64), _image(2, 48, 64)])
    with pytest.raises(ImageInputError, match="expected an aspect ratio of at most 8:1 for tiny-flux2, got 576x64"):
        request_for(spec, prompt="a cat", images=[_image(1, 576, 64)])


def test_a_mask_must_have_the_image_size_and_an_image():
    spec = model_spec("tiny-flux-fill")
    with pytest.raises(ImageInputError, match="mask: expected the image's size 96x64, got 64x64") as err:
        request_for(spec, prompt="a cat", images=[_image(0)], mask=_image(1, 64, 64, "L"))
    assert err.value.param == "mask"
    with pytest.raises(ImageInputError, match="expected 1 input image"):
        request_for(spec, prompt="a cat", mask=_image(1, mode="L"))
    facts = ImageInputFacts(min_images=0, mask_argument="mask_image")
    with pytest.raises(ImageInputError, match="mask: expected an image with the mask, got a mask alone"):
        InputImages.of(facts, [], _image(1, mode="L"))
    with pytest.raises(ImageInputError, match="image: expected PIL images, got str at position 0"):
        InputImages.of(facts, ["cat.png"])


def test_the_mask_rule_follows_openai_with_alpha_and_diffusers_without():
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[:, :2, 3] = 255  # left half opaque (keep), right half transparent (edit)
    mask = mask_from_image(Image.fromarray(rgba, "RGBA"))
    assert mask.mode == "L" and (np.asarray(mask)[:, :2] == 0).all() and (np.asarray(mask)[:, 2:] == 255).all()
    gray = Image.fromarray(np.full((4, 4), 200, np.uint8), "L")
    assert np.asarray(mask_from_image(gray)).tolist() == np.asarray(gray).tolist()  # white = repaint, as it is


def test_images_are_rgb_and_the_digest_follows_the_pixels():
    a = InputImages.of(ImageInputFacts(), [_image(1, mode="RGBA")])
    assert a.images[0].mode == "RGB"
    assert InputImages.of(ImageInputFacts(), [_image(1, mode="RGBA")]).digest == a.digest
    assert InputImages.of(ImageInputFacts(), [_image(2)]).digest != a.digest


def test_only_requests_with_the_same_images_batch_and_alone_pipelines_never():
    kontext = model_spec("tiny-flux-kontext")
    one = request_for(kontext, prompt="a cat", images=[_image(1)], seed=1)
    same = request_for(kontext, prompt="a dog", images=[_image(1)], seed=2)
    other = request_for(kontext, prompt="a cat", images=[_image(2)], seed=1)
    text = request_for(kontext, prompt="a cat", seed=1, width=96, height=64)
    assert one.batch_key == same.batch_key and one.batch_key != other.batch_key and text.batch_key != one.batch_key
    assert text.batch_key[:8] == one.batch_key[:8]  # the image is the only difference
    edit = model_spec("tiny-qwenimage-edit")
    a, b = (request_for(edit, prompt="a cat", images=[_image(1)], seed=s) for s in (1, 2))
    assert a.batch_key != b.batch_key  # one prompt a call: the seed keeps them apart
    # the n images of one request share the key (and with any request of the same images and settings)
    assert {r.batch_key for r in request_for(kontext, prompt="a", images=[_image(1)], n=3).per_image()} == {one.batch_key}


def test_an_edit_takes_its_image_size_and_a_video_the_model_size():
    kontext = request_for(model_spec("tiny-flux-kontext"), prompt="a cat", images=[_image(1, 100, 70)])
    assert (kontext.width, kontext.height) == (96, 64)  # rounded down to the 16-pixel multiple
    assert (request_for(model_spec("tiny-flux-img2img"), prompt="a", images=[_image(1, 8, 8)]).width) == 16
    with pytest.raises(ImageInputError, match="at least 16x16 pixels for tiny-flux-kontext, got 8x8"):
        request_for(model_spec("tiny-flux-kontext"), prompt="a", images=[_image(1, 8, 8)])  # 0 wide once rounded
    video = request_for(model_spec("tiny-wan-i2v"), prompt="a cat", images=[_image(1, 100, 70)])
    assert (video.width, video.height) == (128, 128)  # the model's: the image is resized to it
    asked = request_for(model_spec("tiny-flux-kontext"), prompt="a cat", images=[_image(1)], width=32, height=48)
    assert (asked.width, asked.height) == (32, 48)
    assert default_size(None, None, 16) is None


@pytest.mark.parametrize("facts, prompts, expected", [
    (ImageInputFacts(min_images=0, area_argument="max_area"), 2, {"image": "one", "max_area": 96 * 64}),
    (ImageInputFacts(batch="per_prompt"), 3, {"image": ["one"] * 3}),
    (ImageInputFacts(max_images=3, as_list=True), 2, {"image": ["one"]}),
    (ImageInputFacts(mask_argument="mask_image"), 2, {"image": "one", "mask_image": "mask"}),
])
def test_each_pipeline_gets_its_own_arguments(facts, prompts, expected):
    image, mask = _image(1), _image(2, mode="L")
    inputs = InputImages.of(facts, [image], mask if facts.mask_argument else None)
    got = image_kwargs(facts, inputs, prompts=prompts, width=96, height=64)
    names = {"one": inputs.images[0], "mask": inputs.mask}
    want = {k: [names[x] for x in v] if isinstance(v, list) else names.get(v, v) for k, v in expected.items()}
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key


def test_later_images_go_to_their_own_arguments_and_checkpoints_set_the_counts():
    """Wan's first-last-frame: the second image is ``last_image`` (one copy per prompt where the first is); which
    checkpoints take it is read from the transformer config (`checkpoint_counts`), for a built-in, a pipeline and a
    local folder alike."""
    from xstage_dit.families.registry import image_inputs_for_model

    facts = ImageInputFacts(max_images=2, extra_arguments=("last_image",), batch="per_prompt")
    first, last = _image(1), _image(2)
    inputs = InputImages.of(facts, [first, last])
    assert image_kwargs(facts, inputs, prompts=1, width=64, height=64) == {"image": inputs.images[0],
                                                                          "last_image": inputs.images[1]}
    two = image_kwargs(facts, inputs, prompts=2, width=64, height=64)
    assert two["image"] == [inputs.images[0]] * 2 and two["last_image"] == [inputs.images[1]] * 2
    assert image_kwargs(facts, InputImages.of(facts, [first]), prompts=1, width=64, height=64).keys() == {"image"}
    with pytest.raises(ValueError, match="expected as_list=True or 2 extra_arguments for a pipeline taking 3"):
        ImageInputFacts(max_images=3, extra_arguments=("last_image",))
    counted = ImageInputFacts(max_images=2, extra_arguments=("last_image",), checkpoint_counts=lambda c: (2, c["n"]))
    assert (counted.for_transformer({"n": 2}).min_images, counted.for_transformer({"n": 2}).max_images) == (2, 2)
    with pytest.raises(ValueError, match="expected checkpoint counts within 1..2, got 2..3"):
        counted.for_transformer({"n": 3})
    assert [image_inputs_for_model(model_spec(m)).max_images for m in ("tiny-wan-i2v", "tiny-wan-flf2v")] == [1, 2]


def test_a_pipeline_that_sizes_its_output_fixes_the_requests_size():
    """HunyuanVideo 1.5 I2V takes no height / width: the request's size is the bucket its processor makes of the
    image (diffusers' own function, for the transformer's target size), an explicit other size is refused, and the
    pipeline gets no height / width."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    from xstage_dit.families import load_pipeline
    from xstage_dit.families.registry import image_inputs_for_model

    spec = model_spec("tiny-hunyuanvideo15-i2v")
    facts = image_inputs_for_model(spec)
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    for width, height in ((100, 60), (60, 100), (64, 64), (300, 40), (90, 88)):
        want = processor.calculate_default_height_width(height=height, width=width, target_size=64)[::-1]
        request = request_for(spec, prompt="a cat", images=[_image(1, width, height)])
        assert (request.width, request.height) == facts.made_size(width, height) == want, (width, height)
    with pytest.raises(ValueError, match="expected no width x height or 80x48 .* got 64x64"):
        request_for(spec, prompt="a cat", images=[_image(1, 100, 60)], width=64, height=64)
    assert request_for(spec, prompt="a", images=[_image(1, 100, 60)], width=80, height=48).width == 80
    pipe = load_pipeline("tiny-hunyuanvideo15-i2v", device="meta")
    kwargs = pipeline_kwargs(pipe, [request_for(spec, prompt="a cat", images=[_image(1, 100, 60)])], kind="video",
                             fixed=fixed_kwargs(spec))
    assert "height" not in kwargs and "width" not in kwargs and kwargs["image"].size == (100, 60)
    with pytest.raises(ValueError, match="resolved for a checkpoint"):
        image_inputs_for("HunyuanVideo15ImageToVideoPipeline").made_size(100, 60)


def test_a_local_folder_counts_its_own_checkpoint(tmp_path):
    from xstage_dit.families.registry import image_inputs_for_model

    folder = tmp_path / "flf2v"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text('{"_class_name": "WanImageToVideoPipeline"}')
    (folder / "transformer" / "config.json").write_text('{"image_dim": 1280, "pos_embed_seq_len": 514}')
    facts = image_inputs_for_model(model_spec(str(folder)))
    assert (facts.min_images, facts.max_images) == (2, 2)
    (folder / "transformer" / "config.json").write_text('{"image_dim": 1280}')
    assert image_inputs_for_model(model_spec(str(folder))).max_images == 1
    (folder / "transformer" / "config.json").unlink()
    with pytest.raises(ValueError, match="expected a readable .*config.json"):
        image_inputs_for_model(model_spec(str(folder)))


def test_an_alone_pipeline_refuses_two_prompts_and_a_required_image_is_checked_again():
    facts = ImageInputFacts(batch="alone")
    with pytest.raises(ValueError, match="expected one prompt a call .* got 2"):
        image_kwargs(facts, InputImages.of(facts, [_image(1)]), prompts=2, width=64, height=64)
    with pytest.raises(ImageInputError, match="expected at least 1 input image"):
        image_kwargs(facts, None, prompts=1, width=64, height=64)


def test_pipeline_kwargs_passes_them_to_the_real_pipelines():
    from xstage_dit.families import load_pipeline

    pipe = load_pipeline("tiny-flux-fill", device="meta")
    spec = model_spec("tiny-flux-fill")
    requests = [request_for(spec, prompt=p, images=[_image(1)], mask=_image(2, mode="L"), seed=s)
                for p, s in (("a cat", 1), ("a dog", 2))]
    kwargs = pipeline_kwargs(pipe, requests, kind="image", fixed=fixed_kwargs(spec))
    assert kwargs["image"] is requests[0].inputs.images[0] and kwargs["mask_image"] is requests[0].inputs.mask
    assert kwargs["prompt"] == ["a cat", "a dog"] and (kwargs["width"], kwargs["height"]) == (96, 64)
    plain = load_pipeline("tiny-flux", device="meta")
    with pytest.raises(ValueError, match="expected no input image for FluxPipeline"):
        pipeline_kwargs(plain, requests[:1], kind="image")
    with pytest.raises(ImageInputError, match="expected at least 1 input image"):
        pipeline_kwargs(pipe, [request_for(model_spec("tiny-flux"), prompt="a cat")], kind="image")
    assert image_inputs_for(pipe) is image_inputs_for("FluxFillPipeline") is not None


def test_warmup_inputs_are_deterministic_and_shaped_like_the_request():
    facts = image_inputs_for("FluxFillPipeline")
    a, b = warmup_inputs(facts, 96, 64), warmup_inputs(facts, 96, 64)
    assert a.digest == b.digest and a.images[0].size == a.mask.size == (96, 64)
    assert warmup_inputs(None, 96, 64) is None
    from xstage_dit.families.registry import image_inputs_for_model

    assert len(warmup_inputs(image_inputs_for_model(model_spec("tiny-wan-flf2v")), 64, 48).images) == 2  # both frames
    assert synthetic_image(8, 4).getpixel((7, 3)) == (255, 255, 128)
