"""distributed.py: the single-process paths (world 1, virtual-rank tables) that need no GPU."""

import pytest
import torch

from xstage_dit.comm import distributed


def test_local_buffer_table_holds_each_tensor_address():
    tensors = [torch.randn(3, 5) for _ in range(4)]
    table = distributed.local_buffer_table(tensors)
    assert table.dtype == torch.int64
    assert table.tolist() == [t.data_ptr() for t in tensors]


def test_local_buffer_table_rejects_empty_list():
    with pytest.raises(ValueError, match="at least one tensor"):
        distributed.local_buffer_table([])


def test_symmetric_buffer_world1_is_cached_and_needs_no_rendezvous():
    distributed.free_symmetric_buffers()
    a = distributed.symmetric_buffer("out", (2, 7), torch.float32, torch.device("cpu"))
    b = distributed.symmetric_buffer("out", (2, 7), torch.float32, torch.device("cpu"))
    assert a is b and a.world_size == 1 and a.handle is None
    assert a.ptr_table.tolist() == [a.tensor.data_ptr()]
    c = distributed.symmetric_buffer("out", (2, 8), torch.float32, torch.device("cpu"))
    assert c is not a
    distributed.free_symmetric_buffers()


def test_init_distributed_without_torchrun_is_one_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.init_distributed()
    assert (info.rank, info.world_size) == (0, 1)


def test_nvlink_multicast_is_disabled_by_default():
    import os

    for key, value in distributed.SAFE_ENV.items():
        assert os.environ[key] == value
