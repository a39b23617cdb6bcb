"""`ModelSpec`: the facts about a model that the CLI, the server and the benchmarks need."""

from __future__ import annotations

from dataclasses import dataclass, field

# The component names diffusers pipelines give their text encoders (up to four: HiDream), in the pipelines' order.
TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


@dataclass(frozen=True)
class ModelSpec:
    """What a model is and how to run it by default.

    name: registry name (``tiny-flux``) or the local folder path.
    family: the name of its family record (`xstage_dit.families.record.FamilyRecord`).
    size: ``tiny`` (random weights, seconds on a CPU) | ``full`` (published dimensions, random weights)
        | ``local`` (a diffusers folder with real weights).
    kind: ``image`` | ``video``.
    pipeline_class: the diffusers pipeline class name.
    patch_multiple: height and width must be multiples of this many pixels (VAE factor x patch size).
    frame_multiple: for video, ``(frames - 1)`` must be a multiple of this (VAE temporal factor); 1 for images.
    height, width, frames, steps, guidance: defaults for generation (``frames`` is 1 for images).
    max_sequence_length: text tokens passed to the pipeline (``None``: the pipeline's default).
    fps: frames per second of a written video.
    square_under_sp: width must equal height at sp > 1 (set from the family record's `SizeLimits`).
    real_weights_example: a published checkpoint of the family, named in the random-weights notice (set from
        the family record).
    variant: which of its family's pipelines a built-in model builds, passed to the record's build functions as
        ``variant=`` ("kontext", "fill", "i2v", ...); "" for the family's text-to-image / text-to-video one.
    """

    name: str
    family: str
    size: str
    kind: str
    pipeline_class: str
    patch_multiple: int
    height: int
    width: int
    steps: int
    guidance: float
    frames: int = 1
    frame_multiple: int = 1
    max_sequence_length: int | None = None
    fps: int = 16
    description: str = ""
    call_kwargs: dict = field(default_factory=dict)
    square_under_sp: bool = False
    real_weights_example: str = "a diffusers checkpoint"
    variant: str = ""

    def __post_init__(self):
        if self.kind not in ("image", "video"):
            raise ValueError(f"expected kind 'image' or 'video', got {self.kind!r}")
        if self.size not in ("tiny", "full", "local"):
            raise ValueError(f"expected size 'tiny', 'full' or 'local', got {self.size!r}")
        for name in ("patch_multiple", "height", "width", "steps", "frames", "frame_multiple", "fps"):
            if getattr(self, name) < 1:
                raise ValueError(f"expected {name} >= 1, got {getattr(self, name)}")

    @property
    def random_weights(self) -> bool:
        """Built-in models (tiny, full) are made with random weights; a local folder has real ones."""
        return self.size != "local"

    @property
    def weights_notice(self) -> str | None:
        """What a user must be told once (start-up, `/v1/models`, the page) when the weights are random."""
        if not self.random_weights:
            return None
        example = self.real_weights_example
        return (f"{self.name} has random weights (built in, nothing downloaded), so every {self.kind} is coloured "
                f"noise whatever the prompt. For real {self.kind}s pass a local diffusers folder: "
                f"--model /path/to/{example}")

    def check_size(self, height: int, width: int, frames: int | None = None, sp: int = 1) -> None:
        """Raise ValueError naming the bad value when (height, width, frames) cannot be generated on `sp`
        sequence-parallel ranks."""
        for label, value in (("height", height), ("width", width)):
            if value < self.patch_multiple or value % self.patch_multiple:
                raise ValueError(
                    f"expected {label} to be a positive multiple of {self.patch_multiple} for {self.name}, got {value}"
                )
        if frames is not None:
            if self.kind == "image" and frames != 1:
                raise ValueError(f"expected frames 1 for the image model {self.name}, got {frames}")
            if frames < 1 or (frames - 1) % self.frame_multiple:
                raise ValueError(
                    f"expected frames = 1 + a multiple of {self.frame_multiple} for {self.name}, got {frames}"
                )
        if self.square_under_sp and sp > 1 and width != height:
            raise ValueError(f"expected a square size (width == height) for {self.name} at sp={sp} (its transformer "
                             f"splits only square latents), got {width}x{height}")
