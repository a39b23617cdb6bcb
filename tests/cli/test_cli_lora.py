"""`xstage-dit generate --lora NAME[:SCALE]`: an adapter by path (named by its file stem) or by name in --lora-dir gives
the PNG the server gives for the same request with that adapter; bad --lora values are one-line usage errors."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch

from xstage_dit.cli import main
from xstage_dit.server.app import create_app
from xstage_dit.server.config import ServerConfig
from tests.helpers.lora import QV_ONLY, lora_worker, write_peft
from tests.helpers.server import live_server, one_torch_thread

ARGS = ["--model", "tiny-flux", "--prompt", "a red fox", "--seed", "7", "--steps", "2", "--width", "32", "--height",
        "32", "--no-progress"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _generate(tmp_path, name: str, *extra: str) -> bytes:
    out = tmp_path / f"{name}.png"
    assert main(["generate", *ARGS, "--output", str(out), *extra]) == 0
    return out.read_bytes()


def test_generate_with_adapters_gives_the_served_png(tmp_path):
    from xstage_dit.families import load_pipeline

    shapes = load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=0).transformer
    lora_dir = tmp_path / "loras"
    write_peft(shapes, lora_dir / "style.safetensors", rank=4, seed=1)
    write_peft(shapes, lora_dir / "detail.safetensors", rank=2, seed=2, words=QV_ONLY)
    plain = _generate(tmp_path, "plain")
    by_path = _generate(tmp_path, "path", "--lora", f"{lora_dir / 'style.safetensors'}:0.7")
    by_name = _generate(tmp_path, "name", "--lora-dir", str(lora_dir), "--lora", "style:0.7", "--lora", "detail")
    worker = lora_worker("tiny-flux", {"lora_dir": str(lora_dir)}, ServerConfig(api_key=None, warmup=False,
                                                                              max_batch_size=1))
    try:
        with live_server(create_app(worker)) as url, httpx.Client(base_url=url, timeout=300) as client:
            def served(lora):
                r = client.post("/v1/images/generations", json={"prompt": "a red fox", "seed": 7, "size": "32x32",
                                                                "num_inference_steps": 2, "lora": lora})
                assert r.status_code == 200, r.text
                return base64.b64decode(r.json()["data"][0]["b64_json"])

            assert served([]) == plain
            assert served([{"name": "style", "scale": 0.7}]) == by_path != plain
            assert served([{"name": "style", "scale": 0.7}, "detail"]) == by_name != by_path
    finally:
        worker.stop()


@pytest.mark.parametrize("extra, words", [
    (["--lora", "style"], "--lora: expected a file or folder path, or --lora-dir holding 'style'"),
    (["--lora", "/no/such/file.safetensors:0.5"], "--lora"),
    (["--lora", "x:9"], "expected NAME[:SCALE] with a number in [-4, 4]"),
    (["--lora-mode", "merged"], "argument --lora-mode: invalid choice: 'merged'"),
])
def test_bad_lora_options_are_usage_errors(tmp_path, capsys, extra, words):
    with pytest.raises(SystemExit) as exc:
        main(["generate", *ARGS, "--output", str(tmp_path / "x.png"), *extra])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_serve_checks_its_lora_options_before_any_rank_starts(tmp_path, capsys):
    for extra, words in ((["--lora-dir", str(tmp_path / "none")], "--lora-dir: expected lora_dir to be a folder"),
                         (["--lora-dir", str(tmp_path), "--max-loras", "1", "--max-loras-per-request", "2"],
                          "--max-loras-per-request: expected max_per_request <= max_loras (1"),
                         (["--lora-dir", str(tmp_path), "--max-loras", "1", "--max-loras-per-request", "1",
                           "--preload-loras", "a,b"], "--preload-loras: expected at most max_loras=1 preloaded")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "tiny-flux", *extra])
        assert exc.value.code == 2 and words in capsys.readouterr().err, words


def test_lora_mode_reaches_the_engine_config_and_the_ranks(tmp_path):
    from xstage_dit.cli import build_parser
    from xstage_dit.cli.engine_options import lora_options
    from xstage_dit.cli.serve import _argv
    from xstage_dit.engine import EngineConfig

    args = build_parser().parse_args(["serve", "--lora-dir", str(tmp_path), "--lora-mode", "fused"])
    fields, _ = lora_options(args)
    assert EngineConfig(device="cpu", **fields).lora_config().mode == "fused"
    argv = _argv(args)
    assert argv[argv.index("--lora-mode") + 1] == "fused"
    default = lora_options(build_parser().parse_args(["generate", "--lora-dir", str(tmp_path)]))[0]
    assert EngineConfig(device="cpu", **default).lora_config().facts()["mode"] == "auto"
