"""One benchmark run's shared state: the prompts, the loaded pipeline every contender uses in turn
(`Bench`), and the names of files and GPUs in results."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[str]:
    """Prompts of a file, one per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"expected at least one prompt in {str(path)!r}, got none")
    if num_prompts is not None:
        if num_prompts > len(prompts):
            raise ValueError(f"expected --num-prompts <= {len(prompts)} (prompts in {path}), got {num_prompts}")
        prompts = prompts[:num_prompts]
    return prompts


def gpu_label(device: torch.device) -> str:
    """Short lower-case GPU model for file names ('NVIDIA H200' -> 'h200'); 'cpu' without a GPU."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    words = [w for w in re.split(r"[\s_]+", name) if w and w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    return re.sub(r"[^a-z0-9.-]", "", (words[0] if words else name).lower()) or "gpu"


def model_slug(model: str) -> str:
    """A file-name-safe model name: the registry name, or a local folder's base name."""
    base = Path(model).name if (os.sep in model or Path(model).is_dir()) else model
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "model"


def bench_inputs(args: argparse.Namespace, spec, width: int, height: int) -> tuple[tuple, object]:
    """(input images, mask) of a run: --image / --mask files; else, for a model whose pipeline edits or animates
    images (its record's task), synthetic images (as many as it needs, at least one; and a mask) of the run's size:
    the shape a served request has, FLUX.1 Kontext's image tokens appended to the sequence, Wan I2V's first frame
    (FLF2V's first and last). ((), None) for text models."""
    from PIL import Image

    from xstage_dit.families.record import IMAGE_TASKS
    from xstage_dit.families.registry import image_inputs_for_model, record_for_pipeline
    from xstage_dit.runtime.conditioning import synthetic_image

    facts = image_inputs_for_model(spec)
    family = record_for_pipeline(spec.pipeline_class)
    takes = facts is not None and family is not None and family.pipelines.get(spec.pipeline_class) in IMAGE_TASKS
    images = [Image.open(path).convert("RGB") for path in args.image or ()]
    if not images and takes:
        images = [synthetic_image(width, height)] * max(1, facts.min_images)
    mask = Image.open(args.mask) if args.mask is not None else None
    if mask is None and images and facts is not None and facts.mask_argument is not None:
        mask = synthetic_image(*images[0].size, "L")
    return tuple(images), mask


def error_text(exc: BaseException) -> str:
    """An exception as one short line for a result row (at most 400 characters)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 400 else text[:397] + "..."


@dataclasses.dataclass
class Bench:
    """Everything a contender needs: the pipeline, the settings, where this rank sits, the clock."""

    args: argparse.Namespace
    spec: object  # xstage_dit.families.ModelSpec
    pipe: object  # diffusers.DiffusionPipeline
    device: torch.device
    dtype: torch.dtype
    rank: int
    world_size: int
    prompts: list[str]
    steps: int
    height: int
    width: int
    frames: int
    t_start: float
    build_s: float = 0.0
    compiled: object = None  # the CompileHandle of the compiled contender running now
    # Which contender left the pipeline modified beyond undoing (None: pristine). A contender that does not
    # accept that state gets a freshly built pipeline first.
    dirty: str | None = None
    # an edit or image-to-video model's input images and mask (`bench_inputs`), in every contender's call
    images: tuple = ()
    mask: object = None

    def rebuild(self) -> None:
        """Drop the pipeline and build it again (after a contender that cannot be undone)."""
        import gc

        from xstage_dit.families import load_pipeline

        self.pipe = None
        self.compiled = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        self.pipe = load_pipeline(self.args.model, dtype=self.dtype, device=self.device, seed=self.args.weights_seed)
        self.pipe.set_progress_bar_config(disable=True)
        self.build_s = time.perf_counter() - t0
        self.dirty = None

    def call_kwargs(self, prompt: str, steps: int) -> dict:
        from xstage_dit.runtime.generation import call_kwargs

        return call_kwargs(self.pipe, self.spec, prompt=prompt, height=self.height, width=self.width,
                           frames=self.frames if self.spec.kind == "video" else None, steps=steps,
                           seed=self.args.seed, images=self.images, mask=self.mask)

    def seconds_left(self) -> float:
        if not self.args.time_budget_s:
            return math.inf
        return self.args.time_budget_s - (time.perf_counter() - self.t_start)

    def compile_transformer(self, vae: bool = True, guards: str = "full", mode: str | None = None,
                            extras: tuple[str, ...] = ()) -> str:
        """``apply_compile`` of the current transformer in `mode` (None: the --compile mode; regional: diffusers'
        ``compile_repeated_blocks``; full: the whole forward; graphs: full under CUDA graphs), with the image
        VAE's decoder where `vae`, under `guards` ("full" or "warm", `apply_compile`'s), with `extras`
        (`apply_compile`'s: text-encoder, video-vae); returns how."""
        from xstage_dit.features.compile import apply_compile

        self.compiled = apply_compile(self.pipe, mode or self.args.compile, vae=vae, guards=guards,
                                      extras=extras)
        return self.compiled.how

    def uncompile(self) -> None:
        if self.compiled is not None:
            self.compiled.restore()  # also drops the graphs: they hold on to the patched modules
            self.compiled = None

    def ensure_process_group(self) -> None:
        """A process group for contenders that need one: torchrun's, or a group of one on this machine."""
        if dist.is_initialized():
            return
        if self.world_size > 1:
            raise RuntimeError(f"expected the process group of the {self.world_size} launched ranks, found none")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo", rank=0, world_size=1)
