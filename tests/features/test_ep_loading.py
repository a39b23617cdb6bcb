"""Each rank loads only its experts: ``load_pipeline(..., expert_shard=(rank, world))`` (issue 6).

In-process: the shard a rank builds or reads is exactly its slice of the full model (values, shapes, bytes
counted), for the built-in random models and for a saved diffusers folder; bad shards fail naming the values.
Spawned (gloo, world 2 and 4, tests/_ep_loading_worker.py): the sharded pipelines, parallelized, give the
single-process output; restore() unbinds; the unbound pipeline and a wrong ep refuse to run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.expert_loads import count_expert_loads

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "features" / "_ep_loading_worker.py")
TOL = 1e-4  # as tests/test_parallelize.py: fp32 pipelines, images in [0, 1], float reassociation only

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _moe(model, name):
    return [m for m in model.modules() if type(m).__name__ == name]


def _expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


def _full_slices(family, full_layer, lo, hi):
    """(gate_up, down) of experts [lo, hi) of a full diffusers layer, in the EP layer's packing."""
    if family == "nucleusmoe":
        return full_layer.experts.gate_up_proj[lo:hi], full_layer.experts.down_proj[lo:hi]
    mine = [full_layer.experts[e] for e in range(lo, hi)]
    return (torch.stack([torch.cat([m.w1.weight.t(), m.w3.weight.t()], 1) for m in mine]),
            torch.stack([m.w2.weight.t() for m in mine]))


FAMILIES = {"nucleusmoe": ("tiny-nucleusmoe", "NucleusMoELayer", "NucleusMoEEPLayer"),
            "hidream": ("tiny-hidream", "MOEFeedForwardSwiGLU", "HiDreamMoEEPLayer")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builtin_shards_are_slices_of_the_full_model(family):
    from xstage_dit.families import load_transformer

    model, moe_class, ep_class = FAMILIES[family]
    full = load_transformer(model, seed=3)
    full_layers = _moe(full, moe_class)
    assert full_layers and all(torch.isfinite(p).all() for p in full.parameters())
    num_experts = 4
    full_state = full.state_dict()
    for world in (2, 4):
        for rank in range(world):
            with count_expert_loads() as seen:
                part = load_transformer(model, seed=3, expert_shard=(rank, world))
            # Only this rank's experts were ever created: the bytes the random init returned, and held shapes.
            assert seen["expert_bytes"] == _expert_bytes(full) // world
            assert not _moe(part, moe_class)
            eps = _moe(part, ep_class)
            assert len(eps) == len(full_layers)
            lo, hi = rank * num_experts // world, (rank + 1) * num_experts // world
            for ep, layer in zip(eps, full_layers):
                assert ep.shard == (rank, world) and not ep.bound and ep.num_experts_per_rank == hi - lo
                gate_up, down = (p for _, p in ep.named_parameters(recurse=False))
                want_gate_up, want_down = _full_slices(family, layer, lo, hi)
                assert torch.equal(gate_up, want_gate_up) and torch.equal(down, want_down)
            # Every non-expert tensor is the full model's.
            for key, value in part.state_dict().items():
                if key in full_state:
                    assert torch.equal(value, full_state[key]), key
                else:
                    assert key.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj", "gate_up", "down"), key


def test_bad_expert_shards_name_the_values():
    from xstage_dit.families import load_pipeline, load_transformer

    with pytest.raises(ValueError, match=r"0 <= rank < world, got \(2, 2\)"):
        load_transformer("tiny-nucleusmoe", expert_shard=(2, 2))
    with pytest.raises(ValueError, match="world=3 for num_experts=4"):
        load_transformer("tiny-hidream", expert_shard=(0, 3))
    with pytest.raises(ValueError, match="expected expert_shard=None for tiny-flux"):
        load_pipeline("tiny-flux", expert_shard=(0, 2))
    with pytest.raises(ValueError, match=r"expected expert_shard=\(rank, world\) or None, got 2"):
        load_transformer("tiny-hidream", expert_shard=2)


def test_unbound_shard_refuses_to_run_and_a_wrong_group_is_named():
    from xstage_dit.families import load_transformer

    part = load_transformer("tiny-hidream", expert_shard=(1, 2))
    ep = _moe(part, "HiDreamMoEEPLayer")[0]
    with pytest.raises(RuntimeError, match=r"ParallelConfig\(sp=2, ep=2\).*shard 1 of 2"):
        ep(torch.randn(1, 3, ep.gate_up.shape[1]))
    with pytest.raises(ValueError, match="rank 1 of 2 .* got rank 0 of 1"):
        ep.bind(None)  # no process group: world 1
    assert not ep.bound
    with pytest.raises(RuntimeError, match="expected a bound HiDreamMoEEPLayer"):
        ep.to_layer()


def test_local_folder_reads_only_this_ranks_experts(tmp_path):
    from xstage_dit.families import load_pipeline

    full = load_pipeline("tiny-hidream", seed=5)
    full.save_pretrained(tmp_path / "hd")
    full_layers = _moe(full.transformer, "MOEFeedForwardSwiGLU")
    full_state = full.transformer.state_dict()
    for rank in range(2):
        with count_expert_loads() as seen:
            pipe = load_pipeline(str(tmp_path / "hd"), expert_shard=(rank, 2))
        # 2 layers x 2 local experts x (w1, w2, w3): the other rank's experts were never read.
        assert seen["expert_tensors_read"] == len(full_layers) * 2 * 3
        assert seen["expert_bytes"] == _expert_bytes(full.transformer) // 2
        eps = _moe(pipe.transformer, "HiDreamMoEEPLayer")
        assert len(eps) == len(full_layers) and not _moe(pipe.transformer, "MOEFeedForwardSwiGLU")
        for ep, layer in zip(eps, full_layers):
            want = _full_slices("hidream", layer, 2 * rank, 2 * rank + 2)
            assert torch.equal(ep.gate_up, want[0]) and torch.equal(ep.down, want[1])
        for key, value in pipe.transformer.state_dict().items():
            if key in full_state:
                assert torch.equal(value, full_state[key]), key
        assert type(pipe).__name__ == "HiDreamImagePipeline" and pipe.vae is not None


def test_local_packed_experts_are_read_by_slice(tmp_path):
    """NucleusMoE packs experts in one tensor: the sharded load reads rows [lo, hi) only (get_slice)."""
    from xstage_dit.families import load_transformer
    from xstage_dit.families.experts import load_transformer_sharded

    full = load_transformer("tiny-nucleusmoe", seed=4)
    full.save_pretrained(tmp_path / "nm" / "transformer")
    layer = _moe(full, "NucleusMoELayer")[0]
    for world in (2, 4):
        rank = world - 1
        with count_expert_loads() as seen:
            part = load_transformer_sharded(tmp_path / "nm", "nucleusmoe", (rank, world), dtype=torch.float32,
                                            device="cpu")
        assert seen["expert_tensors_read"] == 2  # gate_up_proj and down_proj, one slice each
        assert seen["expert_bytes"] == _expert_bytes(full) // world
        ep = _moe(part, "NucleusMoEEPLayer")[0]
        lo, hi = rank * 4 // world, (rank + 1) * 4 // world
        assert torch.equal(ep.gate_up_proj, layer.experts.gate_up_proj[lo:hi])
        assert torch.equal(ep.down_proj, layer.experts.down_proj[lo:hi])


def _run_group(world: int, tmp_path: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "features"))
    import _ep_loading_worker as worker

    from tests.helpers.preloaded import launch_preloaded

    for family in ("nucleusmoe", "hidream"):  # the real-weights folders the ranks read their experts from
        worker.build_transformer(family, None).save_pretrained(tmp_path / family / "transformer")
    out = tmp_path / f"world{world}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XSTAGE_TEST_TIMEOUT="60", OMP_NUM_THREADS="1")
    code = launch_preloaded(world, WORKER, [str(out), str(tmp_path), "nucleusmoe", "hidream"], env=env, timeout_s=240,
                            logs=out)
    assert code == 0, f"world {world}: a rank exited with {code}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_loads_match_the_single_process_output(world, tmp_path):
    results = _run_group(world, tmp_path)
    assert sorted(results) == ["hidream", "nucleusmoe"]
    for family, ranks in results.items():
        assert len(ranks) == world
        for rank, r in enumerate(ranks):
            where = (family, world, rank)
            assert r["ref_std"] > 1e-3, where  # a real image, not a constant
            assert r["max_abs_full"] <= TOL, (where, r)
            # Built-in random weights, only this rank's experts made: same output as the full load.
            assert r["built_values_match"], where
            assert r["built_expert_bytes"] == r["full_expert_bytes"] // world, (where, r)
            assert r["built_held"]["shards"] == [[rank, world]] and not r["built_held"]["full_moe_layers"], (where, r)
            assert r["built_held"]["num_experts_per_rank"] == [4 // world], (where, r)
            assert r["built_moe_layers"] == len(r["built_held"]["expert_shapes"]) >= 1, (where, r)
            assert r["max_abs_built"] <= TOL, (where, r)
            assert r["built_vs_full_parallel"] == 0.0, (where, r)  # same weights, same EP path
            # restore() unbinds: the loaded pipeline refuses to run alone, and a wrong ep is named.
            assert r["restored_same_objects"], where
            assert "the pipeline was loaded with expert_shard" in r["unbound_run"], (where, r)
            assert f"expected ep={world} for a pipeline loaded with expert_shard" in r["wrong_ep"], (where, r)
            # Real weights from safetensors: only this rank's experts read, same output.
            assert r["local_values_match"], where
            assert r["local_expert_bytes"] == r["full_expert_bytes"] // world, (where, r)
            assert r["local_held"] == r["built_held"], where
            assert r["max_abs_local"] <= TOL, (where, r)


def test_config_gives_each_rank_its_ep_group_rank():
    from xstage_dit.features.config import ParallelConfig

    assert ParallelConfig(sp=2, ep=2, cfg=2).expert_shard(3) == (1, 2)  # cfg branch 1, sequence shard 1
    assert ParallelConfig(sp=4, ep=4).expert_shard(2) == (2, 4)
    assert ParallelConfig(sp=4).expert_shard(2) is None  # ep=1: every expert on every rank
    with pytest.raises(ValueError, match=r"rank in \[0, 2\), got 2"):
        ParallelConfig(sp=2, ep=2).expert_shard(2)


def test_serve_loader_loads_the_ranks_shard(monkeypatch):
    import xstage_dit.families as models
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.server.startup import model_loader
    from xstage_dit.server.ranks import RankContext

    seen = {}

    class Stop(Exception):
        pass

    def fake_load(model, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(models, "load_pipeline", fake_load)
    with pytest.raises(Stop):
        model_loader("tiny-hidream", ParallelConfig(sp=2, ep=2, cfg=2))(RankContext(rank=3, world_size=4))
    assert seen["expert_shard"] == (1, 2)
    with pytest.raises(Stop):
        model_loader("tiny-hidream", ParallelConfig(sp=2, ep=1, cfg=2))(RankContext(rank=3, world_size=4))
    assert seen["expert_shard"] is None


def test_generate_ep2_loads_shards_and_writes_the_single_process_image(tmp_path):
    import subprocess

    import numpy as np
    from PIL import Image

    from xstage_dit.cli import main

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    args = ["generate", "--model", "tiny-hidream", "--steps", "1", "--no-progress", "--device", "cpu"]
    assert main([*args, "-o", str(tmp_path / "one.png")]) == 0  # one process, every expert
    proc = subprocess.run([sys.executable, "-m", "xstage_dit", *args, "-o", str(tmp_path / "ep2.png"), "--sp", "2",
                           "--ep", "2"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "read only its 2 of 4 experts in 2 MoE layers (ep=2)" in proc.stdout, proc.stdout
    one = np.asarray(Image.open(tmp_path / "one.png"), dtype=np.int16)
    ep2 = np.asarray(Image.open(tmp_path / "ep2.png"), dtype=np.int16)
    assert np.abs(one - ep2).max() <= 1  # 8-bit images of outputs equal within fp32 reassociation


def test_generate_ep_on_a_dense_model_is_refused_before_starting_ranks(capsys):
    from xstage_dit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny-flux", "--sp", "2", "--ep", "2"])
    assert exc.value.code == 2
    assert "--ep: expected --ep 1 for tiny-flux (no MoE layers to shard), got 2" in capsys.readouterr().err


def test_meta_build_of_a_shard_has_the_shard_shapes():
    from xstage_dit.families import load_transformer

    full = load_transformer("tiny-nucleusmoe", device="meta")
    part = load_transformer("tiny-nucleusmoe", device="meta", expert_shard=(1, 4))
    ep = _moe(part, "NucleusMoEEPLayer")[0]
    assert ep.gate_up_proj.is_meta and ep.gate_up_proj.shape[0] == 1
    assert sum(p.numel() for p in full.parameters()) - sum(p.numel() for p in part.parameters()) == \
        _expert_bytes(full) // full.dtype.itemsize * 3 // 4
