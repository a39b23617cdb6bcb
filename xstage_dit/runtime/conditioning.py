"""Input images of a request (image edit, image-to-video): `InputImages`, the one value a `GenerationRequest`
carries them in, checked against the pipeline's `ImageInputFacts` (its family record) when it is made; and the
one rule that turns them into the pipeline's keyword arguments (`image_kwargs`), the default output size they
imply (`default_size`) and the synthetic inputs a warm-up runs with (`warmup_inputs`).

Shared by ``xstage-dit generate --image``, the server's ``/v1/images/edits`` and ``input_reference`` of
``/v1/videos``, so one image, prompt and seed give the same output from each.

Example::

    facts = image_inputs_for("FluxKontextPipeline")
    inputs = InputImages.of(facts, [Image.open("cat.png")], model="tiny-flux-kontext")
    image_kwargs(facts, inputs, prompts=1, width=128, height=128)   # {"image": <PIL RGB>, "max_area": 16384}
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from xstage_dit.families.record import ImageInputFacts


class ImageInputError(ValueError):
    """A bad input image: `param` names the field ("image" or "mask"), the message says what was expected."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.detail = message


def mask_from_image(mask: Image.Image) -> Image.Image:
    """The one mask rule, as a grayscale image where white = repaint (what diffusers' inpainting pipelines read):
    a mask with an alpha channel follows OpenAI's edits API (fully transparent = edit there: 255 - alpha); one
    without follows diffusers (white = repaint)."""
    if "A" in mask.getbands() or (mask.mode == "P" and "transparency" in mask.info):
        alpha = np.asarray(mask.convert("RGBA"))[..., 3]
        return Image.fromarray((255 - alpha).astype(np.uint8), mode="L")
    return mask.convert("L")


def refuse_untaken(images: int, mask: bool, model: str) -> None:
    """`ImageInputError` where `model`'s pipeline, which takes no image, is given `images` images or a mask (what
    `InputImages.of` raises for it; callable before any image is decoded)."""
    if images or mask:
        what = "image" if images else "mask"
        raise ImageInputError(what, f"expected no input {what} for {model} (its pipeline takes none), got "
                                    f"{images if images else 1}")


@dataclass(frozen=True, eq=False)
class InputImages:
    """The conditioning images of one request: `images` (RGB, in order) and `mask` (grayscale, white = repaint, the
    first image's size) or None. `digest`: a hash of their pixels (requests batch only with equal digests).
    `alone`: the pipeline takes one prompt a call (`ImageInputFacts.batch` "alone"). Make it with `of`."""

    images: tuple[Image.Image, ...]
    mask: Image.Image | None = None
    alone: bool = False
    digest: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        h = hashlib.sha256()
        for image in (*self.images, *([self.mask] if self.mask is not None else [])):
            h.update(f"{image.mode}{image.size}".encode())
            h.update(image.tobytes())
        object.__setattr__(self, "digest", h.hexdigest())

    @classmethod
    def of(cls, facts: ImageInputFacts | None, images: Sequence[Image.Image], mask: Image.Image | None = None, *,
           model: str = "this model") -> "InputImages | None":
        """`images` and `mask` checked against `facts` (how `model`'s pipeline takes images; None: it takes none):
        None when there are none to pass. Raises `ImageInputError` naming "image" or "mask": an image given to a
        model that takes none, fewer or more images than it takes, a mask it does not take (or without an image),
        a mask whose size is not the first image's."""
        images = list(images)
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ImageInputError("image", f"expected PIL images, got {type(image).__name__} at position {i}")
        if facts is None:
            refuse_untaken(len(images), mask is not None, model)
            return None
        if not facts.min_images <= len(images) <= facts.max_images:
            expected = (f"{facts.max_images}" if facts.min_images == facts.max_images
                        else f"{facts.min_images} to {facts.max_images}")
            raise ImageInputError("image", f"expected {expected} input image(s) for {model}, got {len(images)}")
        for i, image in enumerate(images):
            short, long = sorted(image.size)
            if short < facts.min_side:
                raise ImageInputError("image", f"expected images of at least {facts.min_side}x{facts.min_side} pixels "
                                               f"for {model}, got {image.width}x{image.height} (image {i + 1})")
            if facts.max_aspect and long > facts.max_aspect * short:
                raise ImageInputError("image", f"expected an aspect ratio of at most {facts.max_aspect:g}:1 for "
                                               f"{model}, got {image.width}x{image.height} (image {i + 1})")
        if mask is not None:
            if facts.mask_argument is None:
                raise ImageInputError("mask", f"expected no mask for {model} (its pipeline takes none), got one")
            if not images:
                raise ImageInputError("mask", "expected an image with the mask, got a mask alone")
            if mask.size != images[0].size:
                raise ImageInputError("mask", f"expected the image's size {images[0].width}x{images[0].height}, got "
                                              f"{mask.width}x{mask.height}")
            mask = mask_from_image(mask)
        if not images:
            return None
        return cls(tuple(image.convert("RGB") for image in images), mask, alone=facts.batch == "alone")

    def key(self, seed: int) -> tuple:
        """What a request's batch key adds: the digest, and the seed where each request must run alone."""
        return (self.digest, seed) if self.alone else (self.digest,)


def image_kwargs(facts: ImageInputFacts, inputs: InputImages | None, *, prompts: int, width: int,
                 height: int) -> dict:
    """The pipeline's keyword arguments for `inputs` in one call of `prompts` prompts at width x height: the images
    under ``facts.argument`` (one, a list of references, or one copy per prompt, per ``facts.batch``; the next ones
    under ``facts.extra_arguments``, one each, likewise), the mask under ``facts.mask_argument``, width * height
    under ``facts.area_argument``. ValueError naming what the pipeline cannot take (more prompts than one for an
    "alone" pipeline)."""
    kwargs: dict = {}
    if facts.area_argument is not None:
        kwargs[facts.area_argument] = int(width) * int(height)
    if inputs is None:
        if facts.min_images:
            raise ImageInputError("image", f"expected at least {facts.min_images} input image(s), got none")
        return kwargs
    if facts.batch == "alone" and prompts != 1:
        raise ValueError(f"expected one prompt a call for a pipeline taking input images one request at a time, "
                         f"got {prompts}")
    images = list(inputs.images)
    per_prompt = facts.batch == "per_prompt" and prompts > 1
    if facts.as_list:
        kwargs[facts.argument] = images
    else:
        for name, image in zip((facts.argument, *facts.extra_arguments), images):
            kwargs[name] = [image] * prompts if per_prompt else image
    if inputs.mask is not None:
        kwargs[facts.mask_argument] = [inputs.mask] * prompts if facts.batch == "per_prompt" and prompts > 1 \
            else inputs.mask
    return kwargs


def made_size(facts: ImageInputFacts | None, inputs: InputImages | None) -> tuple[int, int] | None:
    """(width, height) the pipeline makes from `inputs` where it takes no size (`ImageInputFacts.output_size`,
    HunyuanVideo 1.5 I2V): the only size a request with these images may have; None elsewhere."""
    if facts is None or inputs is None:
        return None
    return facts.made_size(*inputs.images[0].size)


def default_size(facts: ImageInputFacts | None, inputs: InputImages | None, multiple: int) -> tuple[int, int] | None:
    """(width, height) a request without a size makes: the pipeline's own for these images (`made_size`), or the
    first image's, rounded down to `multiple` (at least one multiple), where the pipeline sizes its output after
    its input (`ImageInputFacts.size_from_image`); None where the model's default size applies."""
    made = made_size(facts, inputs)
    if made is not None:
        return made
    if facts is None or inputs is None or not facts.size_from_image:
        return None
    width, height = inputs.images[0].size
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


def synthetic_image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A deterministic test card of width x height: red grows to the right, green downwards, blue constant (a mask,
    mode "L": the right half white = repaint). What warm-ups and the tests' seeds start from."""
    if mode == "L":
        pixels = np.zeros((height, width), dtype=np.uint8)
        pixels[:, width // 2:] = 255
        return Image.fromarray(pixels, mode="L")
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None].repeat(width, 1)
    pixels = np.stack([x, y, np.full_like(x, 128.0)], axis=-1).round().astype(np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def warmup_inputs(facts: ImageInputFacts | None, width: int, height: int) -> InputImages | None:
    """The inputs a warm-up of a pipeline taking images runs with (so the shapes it serves are the ones warmed,
    compiled and measured): synthetic images of the warm-up size, as many as it needs (at least one), and a mask
    where the pipeline takes one."""
    if facts is None:
        return None
    mask = synthetic_image(width, height, "L") if facts.mask_argument is not None else None
    return InputImages.of(facts, [synthetic_image(width, height)] * max(1, facts.min_images), mask)
