"""The benchmark's step-cache contenders (`xstage_dit.bench.cache_contenders`): ``xstage-cache`` stands for one row
per method and forced ratio, ``cache-dit`` for cache-dit's default cache and the same forced ratios on plain
diffusers; each row records the computed and skipped work of its timed call, and the summary sets our First Block
Cache against cache-dit at the same computed steps. On tiny FLUX (CPU): at a forced ratio both compute the same
steps and give the same image (the same blocks skipped, the same residual added), and cache-dit's default cache,
which computes 8 first blocks, says why it cannot run on a model with fewer. ``--cache`` puts a cache on the xstage
contenders' engines, as ``generate`` and ``serve`` do."""

from __future__ import annotations

import json

import pytest
import torch

from xstage_dit import cli
from xstage_dit.bench import options
from xstage_dit.errors import UsageError


def _args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, needle", [
    (["--cache-contender-methods", "teacache"], "--cache-contender-methods from"),
    (["--cache-contender-every", "4,0"], "--cache-contender-every as integers >= 1"),
    (["--cache", "pab", "--cache-threshold", "0.1"], "--cache-threshold: cache threshold applies to fbcache"),
])
def test_bad_cache_options_are_refused_by_name(argv, needle):
    with pytest.raises(UsageError, match=needle):
        options.validate(_args(*argv))


def test_the_cache_contenders_expand_into_a_row_per_method_and_ratio():
    from xstage_dit.bench.cache_contenders import cache_entries
    from xstage_dit.bench.lineup import make_contenders

    methods, every = options.cache_variants(_args("--cache-contender-methods", "fbcache,pab",
                                                  "--cache-contender-every", "4,2"))
    expand = {name: cache_entries(name, methods, every) for name in options.CACHE_CONTENDERS}
    names = [c.name for c in make_contenders(["diffusers", "xstage-cache", "cache-dit"], False, expand=expand)]
    assert names[0] == "diffusers" and {"xstage-cache:fbcache@1/4", "xstage-cache:pab@1/2", "cache-dit",
                                        "cache-dit@1/4", "cache-dit@1/2"} <= set(names)
    assert len([n for n in names if not n.endswith("+compile")]) == 1 + 4 + 3


def test_forced_ratios_against_cache_dit_on_tiny_flux(tmp_path):
    pytest.importorskip("cache_dit", reason="cache-dit is in the bench extra: pip install 'xstage-dit[bench]'")
    rc = cli.main(["bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "8", "--height", "64",
                   "--width", "64", "--warmup", "0", "--contenders", "diffusers,xstage-cache,cache-dit",
                   "--cache-contender-methods", "fbcache,magcache,pab", "--cache-contender-every", "4",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    record = json.loads((tmp_path / "e2e-tiny-flux-1xcpu.json").read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in record["rows"]}
    for name in ("xstage-cache:fbcache@1/4", "xstage-cache:magcache@1/4", "cache-dit@1/4"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["step_cache"]["computed"] == 2 and rows[name]["step_cache"]["skipped"] == 6, rows[name]
        assert "step cache: 2 steps computed, 6 skipped" in rows[name]["note"]
    assert rows["xstage-cache:pab@1/4"]["step_cache"]["unit"] == "attention calls"
    ours, theirs = rows["xstage-cache:fbcache@1/4"], rows["cache-dit@1/4"]
    assert ours["output_max_abs_diff_vs_diffusers"] > 1e-3  # steps were skipped
    assert ours["output_max_abs_diff_vs_diffusers"] == pytest.approx(theirs["output_max_abs_diff_vs_diffusers"],
                                                                     rel=1e-4)
    assert rows["cache-dit"]["status"] == "cannot run" and "Fn_compute_blocks=8" in rows["cache-dit"]["reason"]
    summary = record["summary"]["step_cache"]["@1/4"]
    assert summary["cache_dit"]["computed"] == 2 and set(summary["methods"]) == {"fbcache", "magcache", "pab"}
    assert summary["fbcache_over_cache_dit"] == pytest.approx(ours["median_s"] / theirs["median_s"])


def test_cache_puts_the_cache_on_the_xstage_engines(tmp_path):
    rc = cli.main(["bench", "--model", "tiny-flux", "--num-prompts", "1", "--steps", "4", "--warmup", "0",
                   "--contenders", "xstage-calibrated", "--cache", "taylorseer", "--cache-compute-every", "2",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    record = json.loads((tmp_path / "e2e-tiny-flux-1xcpu.json").read_text(encoding="utf-8"))
    row = next(r for r in record["rows"] if r["name"] == "xstage-calibrated")
    assert row["status"] == "ok" and row["step_cache"] == {"method": "taylorseer", "unit": "steps", "computed": 2,
                                                           "skipped": 2}
    assert "--cache taylorseer" in record["summary"]["settings"]["command"]


def test_cache_dit_counts_the_blocks_of_a_model_whose_list_is_not_transformer_blocks():
    """Wan's blocks are `blocks`: the default cache-dit contender runs there (an H100 run, 2026-12-06, called
    Wan's 40 blocks 0)."""
    pytest.importorskip("cache_dit", reason="cache-dit is in the bench extra: pip install 'xstage-dit[bench]'")
    from types import SimpleNamespace

    from xstage_dit.bench.cache_contenders import CacheDit

    def bench(n: int):
        transformer = torch.nn.Module()
        transformer.blocks = torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))
        return SimpleNamespace(world_size=1, pipe=SimpleNamespace(transformer=transformer))

    assert CacheDit(False, None).check(bench(40)) is None
    assert "has 7" in CacheDit(False, None).check(bench(7))
