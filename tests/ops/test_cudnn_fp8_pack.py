"""cuDNN's FP8 attention binds a call's operands by uid and device address after a graph's first call
(`cudnn_fp8.variant_pack`): every address must be the one the tensor-keyed pack of the first call binds, the scale
slots included. The kernel itself runs on the GPU only (tests/ops/test_attention_fp8_gpu.py); the addresses are
checked here, on CPU tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xstage_dit.ops.attention.cudnn_fp8 import pack_counts, pack_uids, shared_attention, tensor_pack, variant_pack
from xstage_dit.ops.attention.fp8_quant import Fp8QKV

NAMES = ("q", "k", "v", "o", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


@dataclass(eq=False)
class GraphTensor:  # a frontend graph tensor: hashable by identity, with the uid lowering gave it
    uid: int


def graph_tensors(first_uid: int = 7, amax_outputs: int = 2) -> dict:
    t = {name: GraphTensor(first_uid + 3 * i) for i, name in enumerate(NAMES)}
    t["amax"] = [GraphTensor(first_uid + 100 + i) for i in range(amax_outputs)]
    return t


def call(seed: int) -> tuple[Fp8QKV, torch.Tensor]:
    """One call's fresh operands (new allocations, as Inductor hands them over), odd shapes."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).to(torch.float8_e4m3fn) for shape in
               [(1, 33, 3, 64), (1, 17, 3, 64), (1, 17, 3, 64)])
    scales = torch.rand(8, 4, generator=g)
    return Fp8QKV(q, k, v, scales), torch.empty_like(q)


def test_the_address_pack_binds_what_the_tensor_pack_binds():
    for amax_outputs in (1, 2):  # the graph without Amax_S, and with it
        t = graph_tensors(amax_outputs=amax_outputs)
        p_scales, amax = (torch.ones(1), torch.ones(1)), torch.zeros(amax_outputs, 4)
        uids = pack_uids(t, p_scales, amax)
        for seed in range(3):  # later calls: new operand buffers, the same graph
            x, out = call(seed)
            by_tensor = tensor_pack(t, x, out, p_scales, amax)
            by_address = variant_pack(uids, x, out)
            assert by_address == {key.uid: value.data_ptr() for key, value in by_tensor.items()}
            assert len(by_address) == len(NAMES) + amax_outputs


def test_a_padded_graph_binds_its_query_lengths_once_and_its_key_lengths_per_call():
    """With per-sample key lengths (a key-padding mask): the query lengths' address is fixed for the graph's life,
    the key lengths are an operand like q; a padded graph's call without them, or a plain one's with them, is refused
    (a wrong binding would read garbage lengths)."""
    import pytest

    t = graph_tensors()
    t.update(seq_len_q=GraphTensor(501), seq_len_kv=GraphTensor(502))
    p_scales, amax = (torch.ones(1), torch.ones(1)), torch.zeros(2, 4)
    q_lengths = torch.full((1, 1, 1, 1), 33, dtype=torch.int32)
    uids = pack_uids(t, p_scales, amax, (q_lengths, torch.ones(1, 1, 1, 1, dtype=torch.int32)))
    assert uids.kv_lengths == 502 and uids.fixed[501] == q_lengths.data_ptr()
    for seed in range(3):
        x, out = call(seed)
        kv_lengths = torch.full((1, 1, 1, 1), 10 + seed, dtype=torch.int32)
        by_tensor = tensor_pack(t, x, out, p_scales, amax, (q_lengths, kv_lengths))
        by_address = variant_pack(uids, x, out, kv_lengths)
        assert by_address == {key.uid: value.data_ptr() for key, value in by_tensor.items()}
        assert len(by_address) == len(NAMES) + 2 + 2
    with pytest.raises(ValueError, match=r"expected a padded graph \(key lengths\)'s call, got kv_lengths=None"):
        variant_pack(uids, x, out)
    with pytest.raises(ValueError, match=r"expected a plain graph \(no key lengths\)'s call, got kv_lengths=a tensor"):
        variant_pack(pack_uids(graph_tensors(), p_scales, amax), x, out, kv_lengths)
    t["seq_len_kv"] = GraphTensor(t["q"].uid)  # two operands on one uid
    assert pack_uids(t, p_scales, amax, (q_lengths, kv_lengths)) is None


def test_a_strided_scale_buffer_gives_each_slot_its_row():
    t = graph_tensors()
    p_scales, amax = (torch.ones(1), torch.ones(1)), torch.zeros(2, 4)
    x, out = call(0)
    x = Fp8QKV(x.q, x.k, x.v, torch.rand(8, 16)[:, ::4])  # rows 64 bytes apart
    by_address = variant_pack(pack_uids(t, p_scales, amax), x, out)
    assert by_address == {key.uid: value.data_ptr() for key, value in tensor_pack(t, x, out, p_scales, amax).items()}


def test_a_graph_without_its_uids_keeps_the_tensor_pack():
    """A uid of 0 (not lowered yet) or two operands on one uid: no address pack, the frontend's own binding."""
    p_scales, amax = (torch.ones(1), torch.ones(1)), torch.zeros(2, 4)
    unassigned = graph_tensors()
    unassigned["v"] = GraphTensor(0)
    assert pack_uids(unassigned, p_scales, amax) is None
    shared = graph_tensors()
    shared["k"] = GraphTensor(shared["q"].uid)
    assert pack_uids(shared, p_scales, amax) is None
    shared_scale = graph_tensors()
    shared_scale["descale_k"] = GraphTensor(shared_scale["descale_q"].uid)
    assert pack_uids(shared_scale, p_scales, amax) is None


def test_pack_counts_are_a_copy_of_the_shared_instances():
    shared = shared_attention()
    before = pack_counts()
    assert set(before) == {"uid", "tensor"}
    before["uid"] += 1  # a copy: the caller's arithmetic leaves the instance's counts alone
    assert pack_counts() == shared.calls_by_pack and pack_counts()["uid"] == before["uid"] - 1
