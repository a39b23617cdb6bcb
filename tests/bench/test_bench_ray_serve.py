"""`benchmarks/bench_ray_serve.py`: a Ray Serve that does not import is named before either server starts (the
H100 run of 2026-12-07 found Ray Serve's grpcio-reflection refusing the image's grpcio only after the plain server's
warm-up)."""

from __future__ import annotations

import sys

import pytest


def test_a_ray_serve_that_does_not_import_is_named_before_any_server_starts(monkeypatch, capsys):
    from benchmarks import bench_ray_serve

    started = []
    monkeypatch.setattr(bench_ray_serve, "plain_server", lambda *a, **k: started.append("plain"))
    monkeypatch.setitem(sys.modules, "ray.serve", None)  # `import ray.serve` raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        bench_ray_serve.main(["--model", "tiny-flux", "--size", "64x64", "--steps", "1"])
    assert exit_info.value.code == 2 and not started
    err = capsys.readouterr().err
    assert "expected Ray Serve to import (pip install 'xstage-dit[ray]'), got ModuleNotFoundError" in err, err
