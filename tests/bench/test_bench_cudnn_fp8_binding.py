"""benchmarks/bench_cudnn_fp8_binding.py on the CPU: every binding it times binds the same addresses to the same
uids (the graph's tensors faked as in tests/ops/test_cudnn_fp8_pack.py), and its options are checked first."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_cudnn_fp8_binding as bench
from tests.ops.test_cudnn_fp8_pack import call, graph_tensors
from xstage_dit.ops.attention.cudnn_fp8 import pack_uids


class _Attention:  # what `packs` reads of a CudnnFp8Attention: P's fixed scales
    def __init__(self):
        self.p_scales = (torch.ones(1), torch.ones(1))

    def _p_scales(self, device):
        return self.p_scales


def _addresses(buffers, tensor_uids) -> dict:
    def ptr(value):
        return value if isinstance(value, int) else value.data_ptr()

    if tensor_uids is None:
        return {getattr(key, "uid", key): ptr(value) for key, value in buffers.items()}
    return {uid: ptr(value) for uid, value in zip(tensor_uids, buffers)}


def test_every_binding_binds_the_same_address_to_each_uid():
    attn, t, amax = _Attention(), graph_tensors(), torch.zeros(2, 4)
    entry = [object(), t, None, None, None, amax, pack_uids(t, attn.p_scales, amax), 0]
    x, out = call(1)
    packs = bench.packs(entry, attn, x, out)
    assert set(packs) == set(bench.BINDINGS)
    want = _addresses(*packs["tensor"])
    assert len(want) == 12  # q, k, v, o, four per-call scales, P's two, two amax outputs
    for name, (buffers, tensor_uids) in packs.items():
        assert _addresses(buffers, tensor_uids) == want, name


@pytest.mark.parametrize("argv, needle", [
    (["--bindings", "tensor,by_name"], "got 'by_name'"),
    (["--shape", "1,4608,24"], "--shape B,S,H,D"),
    (["--calls", "2", "--rounds", "4"], "--calls >= --rounds"),
])
def test_bad_options_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert needle in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the refusal is the CPU's")
    with pytest.raises(SystemExit):
        bench.main([])
    assert "expected a CUDA GPU" in capsys.readouterr().err
