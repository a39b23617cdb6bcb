"""--compile, --compile-guards, --warmup-sizes and --max-compiled-shapes of serve, generate and bench: bad values
fail in milliseconds with a UsageError naming the option and the value (exit code 2), before any model is built."""

from __future__ import annotations

import argparse

import pytest

from xstage_dit.cli import build_parser, main
from xstage_dit.cli.compile_options import compile_mode, parse_warmup_sizes
from xstage_dit.errors import UsageError
from xstage_dit.families import model_spec


def _fails(argv, capsys, *needles):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_compile_values_name_the_option(command, capsys):
    _fails([command, "--model", "tiny-flux", "--compile", "fast"], capsys, "--compile", "'fast'",
           "off, regional, full, graphs")
    _fails([command, "--model", "tiny-flux", "--max-compiled-shapes", "0"], capsys, "--max-compiled-shapes", "got 0")
    _fails([command, "--model", "tiny-flux", "--compile-guards", "none"], capsys, "--compile-guards", "'none'")
    _fails([command, "--model", "tiny-flux", "--compile-extra", "text-encoder,vae"], capsys, "--compile-extra",
           "'vae'", "text-encoder, video-vae")
    _fails([command, "--model", "tiny-flux", "--warmup-sizes", "512"], capsys, "--warmup-sizes", "'512'")
    _fails([command, "--model", "tiny-flux", "--warmup-sizes", "512x512,500x512"], capsys, "--warmup-sizes",
           "500x512", "multiple of 16")


def test_bench_compile_takes_a_mode_and_a_bare_flag_means_regional(capsys):
    _fails(["bench", "--model", "tiny-flux", "--compile", "fast"], capsys, "--compile", "'fast'")
    parser = build_parser()
    assert parser.parse_args(["bench", "--compile"]).compile == "regional"
    assert parser.parse_args(["bench", "--compile", "full"]).compile == "full"
    assert parser.parse_args(["bench"]).compile == "off"
    assert parser.parse_args(["bench"]).compile_guards == "full"
    assert parser.parse_args(["bench", "--compile-guards", "warm"]).compile_guards == "warm"
    _fails(["bench", "--model", "tiny-flux", "--compile-guards", "some"], capsys, "--compile-guards", "'some'")
    assert parser.parse_args(["bench", "--compile-extra", "video-vae"]).compile_extra == "video-vae"
    _fails(["bench", "--model", "tiny-flux", "--compile", "--compile-extra", "all"], capsys, "--compile-extra", "'all'")


def test_serve_batching_options_reach_the_config(capsys):
    from xstage_dit.cli.serve import _argv, _config

    args = build_parser().parse_args(["serve", "--model", "tiny-flux", "--warmup-sizes", "64x32, 128x128",
                                      "--batching", "never", "--batch-margin", "0.2"])
    config = _config(args)
    assert config.warmup_sizes == ((64, 32), (128, 128)) and config.batching == "never" and config.batch_margin == 0.2
    assert "--compile" not in _argv(args)  # left to the device's default on every rank
    assert config.gc_freeze and "--no-gc-freeze" not in _argv(args)
    warm = build_parser().parse_args(["serve", "--model", "tiny-flux", "--compile-guards", "warm"])
    assert _argv(warm)[_argv(warm).index("--compile-guards") + 1] == "warm"  # every rank compiles alike
    extra = build_parser().parse_args(["serve", "--model", "tiny-flux", "--compile-extra", "text-encoder"])
    assert _argv(extra)[_argv(extra).index("--compile-extra") + 1] == "text-encoder"
    args = build_parser().parse_args(["serve", "--model", "tiny-flux", "--no-gc-freeze"])
    assert not _config(args).gc_freeze and "--no-gc-freeze" in _argv(args)  # every rank leaves its heap alone
    assert config.keep_freed_memory and "--no-keep-freed-memory" not in _argv(build_parser().parse_args(
        ["serve", "--model", "tiny-flux"]))
    args = build_parser().parse_args(["serve", "--model", "tiny-flux", "--no-keep-freed-memory"])
    assert not _config(args).keep_freed_memory and "--no-keep-freed-memory" in _argv(args)
    _fails(["serve", "--model", "tiny-flux", "--batching", "sometimes"], capsys, "--batching", "'sometimes'")
    _fails(["serve", "--model", "tiny-flux", "--batch-margin", "-1"], capsys, "--batch-margin", "-1")


def test_defaults_and_parsing():
    assert compile_mode(argparse.Namespace(compile=None), "cpu") == "off"
    assert compile_mode(argparse.Namespace(compile=None), "cuda") == "regional"
    assert compile_mode(argparse.Namespace(compile="full"), "cpu") == "full"
    assert parse_warmup_sizes("") == () and parse_warmup_sizes("512x256") == ((512, 256),)
    with pytest.raises(UsageError, match=r"--warmup-sizes: expected WxH\[,WxH...\] with positive integers, got '0x5'"):
        parse_warmup_sizes("0x5")
    with pytest.raises(UsageError, match="multiple of 16"):
        parse_warmup_sizes("24x32", model_spec("tiny-flux"))
