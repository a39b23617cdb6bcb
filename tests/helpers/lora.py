"""Random LoRA adapters for the tiny pipelines, written as users get them: diffusers/PEFT format (the keys
``pipe.save_lora_weights`` writes: ``transformer.<module>.lora_A.weight`` / ``lora_B.weight``) and kohya's sd-scripts
format for FLUX (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` / ``lora_up`` / ``alpha``, which
diffusers converts); and the images a tiny pipeline makes."""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from xstage_dit.features.batch_invariance import is_linear

# Which Linear layers an adapter of each kind targets: attention and MLP projections (what trainers target).
ATTN_MLP = (".attn", ".ff", "proj_mlp", "img_mlp", "txt_mlp", ".ffn")
QV_ONLY = ("to_q", "to_v")


def targets(transformer: torch.nn.Module, words=ATTN_MLP) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, m) for name, m in transformer.named_modules()
            if is_linear(m) and any(w in name for w in words)]


def write_peft(transformer: torch.nn.Module, path: Path, *, rank: int, seed: int, words=ATTN_MLP,
               std: float = 0.2, prefix: str = "transformer", alpha: float | None = None) -> Path:
    """A random adapter of `rank` on `transformer`'s layers named by `words`, in diffusers/PEFT format; `alpha`:
    PEFT's lora_alpha in the file's adapter metadata, as ``save_lora_weights`` writes it (None: none, alpha = rank)."""
    g = torch.Generator().manual_seed(seed)
    state, names = {}, []
    for name, m in targets(transformer, words):
        state[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * std
        state[f"{prefix}.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * std
        names.append(name)
    metadata = None
    if alpha is not None:
        config = {f"{prefix}.r": rank, f"{prefix}.lora_alpha": alpha, f"{prefix}.target_modules": names}
        metadata = {"lora_adapter_metadata": json.dumps(config)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)
    return path


def write_kohya_flux(path: Path, *, dim: int, mlp: int, rank: int, seed: int, std: float = 0.2) -> Path:
    """A random FLUX adapter in kohya sd-scripts format (BFL block names, fused qkv, alpha = rank / 2) for a FLUX
    transformer of width `dim` and MLP width `mlp` with one double and one single block."""
    g = torch.Generator().manual_seed(seed)
    state = {}

    def pair(key: str, d_in: int, d_out: int) -> None:
        state[f"{key}.lora_down.weight"] = torch.randn(rank, d_in, generator=g) * std
        state[f"{key}.lora_up.weight"] = torch.randn(d_out, rank, generator=g) * std
        state[f"{key}.alpha"] = torch.tensor(rank / 2.0)

    pair("lora_unet_double_blocks_0_img_attn_qkv", dim, 3 * dim)
    pair("lora_unet_double_blocks_0_img_attn_proj", dim, dim)
    pair("lora_unet_double_blocks_0_img_mlp_0", dim, mlp)
    pair("lora_unet_double_blocks_0_txt_attn_qkv", dim, 3 * dim)
    pair("lora_unet_single_blocks_0_linear2", dim + mlp, dim)
    save_file(state, str(path))
    return path


def image(pipe, model: str, seed: int = 3, **values) -> np.ndarray:
    """The pipeline's float output (images, or a video's frames) for "a fox", 2 steps, `seed`, the model's tiny
    default size, as the server and `generate` call it (under inference mode)."""
    from xstage_dit.families import model_spec
    from xstage_dit.runtime.generation import call_kwargs, run_pipeline

    spec = model_spec(model)
    out = run_pipeline(pipe, **call_kwargs(pipe, spec, prompt="a fox", seed=seed, steps=2, **values))
    return np.asarray(out.frames if spec.kind == "video" else out.images, dtype=np.float32)


def load_reference_adapters(ref, model: str, folder: Path) -> np.ndarray:
    """Write `diffusers_references`' adapters ``a`` and ``b`` under `folder` and load them into `ref` with
    ``load_lora_weights``; returns `ref`'s image without adapters (made first)."""
    a = write_peft(ref.transformer, folder / "a.safetensors", rank=4, seed=1)
    b = write_peft(ref.transformer, folder / "b.safetensors", rank=2, seed=2, words=QV_ONLY)
    plain = image(ref, model)
    ref.load_lora_weights(str(a), adapter_name="a")
    ref.load_lora_weights(str(b), adapter_name="b")
    return plain


def diffusers_references(ref, model: str, folder: Path, ab_scales: tuple[float, float]) -> tuple[np.ndarray, dict]:
    """The reference images of two random adapters through diffusers' own LoRA API on the untouched pipeline `ref`:
    adapter ``a`` (rank 4, every attention and MLP projection) and ``b`` (rank 2, q and v only) are written under
    `folder` and loaded with ``load_lora_weights``; returns (the image without adapters, {"a": a at 0.7, "b": b at
    1.0, "ab": a and b at `ab_scales`}), each set with ``set_adapters``."""
    plain = load_reference_adapters(ref, model, folder)
    want = {}
    for key, names, scales in (("a", ["a"], [0.7]), ("b", ["b"], [1.0]), ("ab", ["a", "b"], list(ab_scales))):
        ref.set_adapters(names, scales)
        want[key] = image(ref, model)
    return plain, want


def diffusers_fused_references(ref, model: str, sets, render=None) -> dict:
    """The images diffusers' own ``set_adapters`` + ``fuse_lora(adapter_names=...)`` give on `ref` (its adapters
    loaded, none fused): `sets` is ``((key, names, scales), ...)``; returns {key: image} (`image`, or
    ``render(ref)``). After each image the adapters are unfused and every base weight is put back from a copy taken
    first (unmerging subtracts the delta again, which does not give the weights back bit for bit)."""
    bases = {name: m.base_layer for name, m in ref.transformer.named_modules()
             if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)}
    originals = {name: base.weight.detach().clone() for name, base in bases.items()}
    out = {}
    for key, names, scales in sets:
        ref.set_adapters(list(names), list(scales))
        ref.fuse_lora(adapter_names=list(names))
        out[key] = image(ref, model) if render is None else render(ref)
        with warnings.catch_warnings():  # PEFT warns for every layer no adapter of the set was merged into
            warnings.filterwarnings("ignore", message="Already unmerged")
            ref.unfuse_lora()
        with torch.no_grad():
            for name, base in bases.items():
                base.weight.copy_(originals[name])
    return out


def linear_weights(transformer: torch.nn.Module, names=None) -> dict[str, torch.Tensor]:
    """name -> a copy of the weight of every Linear layer of `transformer` (a LoRA layer counts as the Linear it
    wraps, under the same name; the adapters' own A and B layers are left out), or of the layers `names`."""
    out = {}
    for name, m in transformer.named_modules():
        base = getattr(m, "base_layer", m)
        own = not name.endswith(".base_layer") and ".lora_" not in name  # not a LoRA layer's parts
        if is_linear(base) and own and (names is None or name in names):
            out[name] = base.weight.detach().clone()
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in any byte (or exist in one only)."""
    return sorted(n for n in a.keys() | b.keys()
                  if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                  or not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)))


def snapshot(transformer: torch.nn.Module) -> tuple:
    """What "nothing changed" compares: module types by name, own attributes, and every weight's values."""
    types = tuple((n, type(m).__name__) for n, m in transformer.named_modules())
    state = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    return types, tuple(sorted(vars(transformer))), state


def same_snapshot(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and a[2].keys() == b[2].keys() and all(
        torch.equal(a[2][k], b[2][k]) for k in a[2])


def lora_worker(model: str, lora: dict, config):
    """A started, ready worker serving `model` on the CPU through the server's own loader (`startup.model_loader`)
    with the LoRA options `lora` (EngineConfig's fields: ``lora_dir``, ``max_loras``, ...) and the `ServerConfig`
    `config`; the caller stops it. A worker that does not become ready is stopped, then the test fails with its
    reason."""
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.ranks import RankContext
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.worker import Worker

    worker = Worker(model_loader(model, ParallelConfig(), lora=lora), config,
                    join=lambda: RankContext(device=torch.device("cpu"))).start()
    ready = worker.wait_ready(300)
    if not ready:
        worker.stop()
    assert ready, worker.reason
    return worker


def load_fp32(model: str):
    """A built-in tiny pipeline in float32 on the CPU, weights seed 0 (what the LoRA feature tests compare)."""
    from xstage_dit.families import load_pipeline

    return load_pipeline(model, dtype=torch.float32, device="cpu", seed=0)


def png_of(response) -> bytes:
    """The PNG bytes of a 200 answer of /v1/images/generations (its first image)."""
    import base64

    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


@contextlib.contextmanager
def served_tiny_flux(lora_dir: Path, **lora):
    """(url, worker): tiny FLUX served on the CPU with adapters ``a`` (rank 4, attention and MLP) and ``b`` (rank 2,
    q/v only) written into `lora_dir`, the LoRA options `lora` (besides lora_dir, max_loras 2, 2 a request), and
    batching every compatible request; stopped on exit."""
    from xstage_dit.server.app import create_app
    from xstage_dit.server.config import ServerConfig
    from tests.helpers.server import live_server, one_torch_thread

    with one_torch_thread():
        shapes = load_fp32("tiny-flux").transformer
        write_peft(shapes, lora_dir / "a.safetensors", rank=4, seed=1)
        write_peft(shapes, lora_dir / "b.safetensors", rank=2, seed=2, words=QV_ONLY)
        worker = lora_worker("tiny-flux", {"lora_dir": str(lora_dir), "max_loras": 2, "max_loras_per_request": 2,
                                           **lora},
                             ServerConfig(api_key=None, warmup=False, max_batch_size=4, batch_wait_s=0.5,
                                          batching="always"))
        try:
            with live_server(create_app(worker)) as url:
                yield url, worker
        finally:
            worker.stop()
