"""What a new family's test file shares with every other (tests/families/test_<family>.py): the tiny pipeline's
image for a case (for an image-conditioned one, with seeded input images through the product's request type:
`request_output`), the parallel-vs-one-process comparison with its token probe, the launch of the file as its own
rank program, and a saved folder generated through the real CLI and the real HTTP server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def pipeline_image(pipe, model: str, case: dict, guidance: float, **extra) -> np.ndarray:
    """The pipeline's images for `case` (prompt or prompts, height, width), 2 steps, seeds 7, 8, ...:
    (images, height, width, 3) float32 in [0, 1]."""
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import fixed_kwargs

    prompts = case["prompt"] if isinstance(case["prompt"], list) else [case["prompt"]]
    generators = [torch.Generator("cpu").manual_seed(7 + i) for i in range(len(prompts))]
    out = pipe(**fixed_kwargs(model_spec(model)), prompt=case["prompt"], height=case["height"], width=case["width"],
               num_inference_steps=2, guidance_scale=guidance, generator=generators, output_type="np", **extra)
    return np.asarray(out.images, dtype=np.float32)


def seeded_image(seed: int, width: int, height: int, mode: str = "RGB"):
    """An input image drawn from `seed` (smooth colour fields plus noise, so a VAE sees structure): what the image
    tests edit, animate or mask ("L": a mask whose right part, from a seeded column, is white = repaint)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    if mode == "L":
        mask = np.zeros((height, width), dtype=np.uint8)
        mask[:, int(rng.integers(width // 4, 3 * width // 4)):] = 255
        return Image.fromarray(mask, mode="L")
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack([np.sin(6 * x + 4 * y + p) for p in phase], -1) * 90 + 128
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8), mode="RGB")


def request_output(pipe, model: str, case: dict) -> np.ndarray:
    """The pipeline's output for an image-conditioned `case`, through the product's own request type and argument
    policy (`request_for`, `pipeline_kwargs`): prompt (or a list: one request each, seeds 7, 8, ..., the same
    images), height, width, images (a list of (width, height): seeded images 100, 101, ...), mask (True: a seeded
    mask of the first image's size), and optionally frames, negative_prompt, true_cfg_scale, guidance. 2 steps.
    Returns (outputs, [frames,] height, width, 3) float32 in [0, 1]."""
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import fixed_kwargs, pipeline_kwargs, request_for

    spec = model_spec(model)
    prompts = case["prompt"] if isinstance(case["prompt"], list) else [case["prompt"]]
    images = [seeded_image(100 + i, w, h) for i, (w, h) in enumerate(case.get("images", ()))]
    mask = seeded_image(99, *case["images"][0], mode="L") if case.get("mask") else None
    requests = [request_for(spec, prompt=p, seed=7 + i, images=images, mask=mask, height=case["height"],
                            width=case["width"], frames=case.get("frames"), steps=2, guidance=case.get("guidance"),
                            negative_prompt=case.get("negative_prompt"), true_cfg_scale=case.get("true_cfg_scale"))
                for i, p in enumerate(prompts)]
    out = pipe(**pipeline_kwargs(pipe, requests, kind=spec.kind, fixed=fixed_kwargs(spec)))
    return np.asarray(out.frames if spec.kind == "video" else out.images, dtype=np.float32)


class Tokens:
    """Query tokens every attention's ``to_q`` projects: fewer under sp = the split really ran. (Attentions with a
    fused projection, FLUX.2's single blocks, are not counted: no ``to_q``.)"""

    def __init__(self, model):
        self.modules = [m.to_q for m in model.modules()
                        if getattr(m, "processor", None) is not None and hasattr(m, "to_q")]
        self.seen: list[int] = []

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(lambda _, args: self.seen.append(args[0].shape[1]))
                        for m in self.modules]
        return self.seen

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def equivalence(pipe, config: dict, image, ref: np.ndarray) -> dict:
    """`image()` under ``parallelize(pipe, ParallelConfig(**config))`` against `ref`, and again after restore:
    {"max_abs", "restored", "ref_std", "tokens" (queries projected under the config)}."""
    from xstage_dit.features import ParallelConfig, parallelize

    handle = parallelize(pipe, ParallelConfig(**config))
    with Tokens(pipe.transformer) as tokens:
        par = image()
    handle.restore()
    back = image()
    return {"max_abs": float(np.abs(par - ref).max()), "restored": float(np.abs(back - ref).max()),
            "ref_std": float(ref.std()), "tokens": sum(tokens)}


def check_parallel_ranks(ranks: list[dict], world: int, cases: dict[str, dict[str, dict]]) -> None:
    """Every rank's parallel results (`equivalence`) against one process: `cases` maps a result key's prefix
    (``"<case>"`` or ``"<model>/<case>"``) to that case's {config name: config}. Each config within
    `TOL.fp32_pipeline` of the one-process image, restore exact, and at sp > 1 fewer attention tokens than the
    prefix's ``single-tokens`` (the attention ran on shards)."""
    from tests.helpers.tolerances import TOL

    for rank, results in enumerate(ranks):
        for prefix, configs in cases.items():
            single = results[f"{prefix}/single-tokens"]
            for config_name, config in configs.items():
                r = results[f"{prefix}/{config_name}"]
                if rank == 0:
                    print(f"world {world} {prefix} {config_name}: max abs error {r['max_abs']:.2e} (pixels in [0, 1])")
                where = (prefix, config_name, r)
                assert r["ref_std"] > 1e-3 and r["max_abs"] <= TOL.fp32_pipeline, where
                assert r["restored"] == 0.0, where  # restore gives the pipeline back exactly
                if config.get("sp", 1) > 1:
                    assert r["tokens"] < single, where


def launch_ranks(rank_program: str, name: str, world: int, tmp_path: Path, *args: str,
                 timeout_s: float = 400) -> list[dict]:
    """Run `rank_program` (``python FILE OUT WORLD [ARGS...]``) on `world` gloo ranks, forked from the preloaded
    server (`tests.helpers.preloaded`); each rank's ``OUT.<rank>`` JSON."""
    from tests.helpers.preloaded import launch_preloaded

    out = tmp_path / f"{name}-w{world}"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    code = launch_preloaded(world, rank_program, [str(out), str(world), *args], env=env, timeout_s=timeout_s,
                            logs=out)
    assert code == 0, f"world {world}: a rank exited with {code}"
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def saved_folder_outputs(model: str, folder: Path, *, prompt: str, seed: int, height: int, width: int,
                         bad_size: str) -> dict:
    """Save `model`'s tiny pipeline to `folder`, then generate from it three ways: the unpatched pipeline a
    diffusers user loads ("direct", uint8 pixels), the real CLI ("cli", PNG bytes) and the real HTTP server
    ("served", the answer's base64 PNG); "bad" is the server's answer to `bad_size`, "spec" the folder's ModelSpec."""
    import httpx

    from xstage_dit.cli import main
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.runtime.generation import call_kwargs, to_uint8
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.worker import Worker
    from tests.helpers.server import live_server, one_torch_thread

    load_pipeline(model, seed=3).save_pretrained(folder)
    with one_torch_thread():
        pipe = load_pipeline(str(folder))  # unpatched: what a diffusers user gets
        spec = model_spec(str(folder))
        kwargs = call_kwargs(pipe, spec, prompt=prompt, seed=seed, steps=2, height=height, width=width)
        direct = to_uint8(np.asarray(pipe(**kwargs).images[0]))

        png = folder.parent / "cli.png"
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--seed", str(seed), "--steps", "2",
                     "--height", str(height), "--width", str(width), "--output", str(png), "--no-progress"]) == 0

        loader = model_loader(str(folder), ParallelConfig())
        worker = Worker(loader, ServerConfig(api_key=None, warmup=False, max_batch_size=1),
                        join=lambda: RankContext(device=torch.device("cpu"))).start()
        try:
            assert worker.wait_ready(300), worker.reason
            with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
                r = client.post("/v1/images/generations", json={
                    "prompt": prompt, "seed": seed, "size": f"{width}x{height}", "num_inference_steps": 2})
                assert r.status_code == 200, r.text
                served = r.json()["data"][0]["b64_json"]
                bad = client.post("/v1/images/generations", json={"prompt": prompt, "size": bad_size})
        finally:
            worker.stop()
    return {"spec": spec, "direct": direct, "cli": png.read_bytes(), "served": served, "bad": bad}
