"""distributed.py: the single-process paths (world 1, virtual-rank tables) that need no GPU."""

import pytest
import torch

from xstage_dit.comm import buffers, distributed
from xstage_dit.comm.buffers import CommBuffers


def test_local_buffer_table_holds_each_tensor_address():
    tensors = [torch.randn(3, 5) for _ in range(4)]
    table = distributed.local_buffer_table(tensors)
    assert table.dtype == torch.int64
    assert table.tolist() == [t.data_ptr() for t in tensors]


def test_local_buffer_table_rejects_empty_list():
    with pytest.raises(ValueError, match="at least one tensor"):
        distributed.local_buffer_table([])


def test_symmetric_buffer_world1_is_kept_by_its_owner_and_needs_no_rendezvous():
    owner = CommBuffers("test")
    a = owner.symmetric_buffer("out", (2, 7), torch.float32, torch.device("cpu"))
    b = owner.symmetric_buffer("out", (2, 7), torch.float32, torch.device("cpu"))
    assert a is b and a.world_size == 1 and a.handle is None
    assert a.ptr_table.tolist() == [a.tensor.data_ptr()]
    c = owner.symmetric_buffer("out", (2, 8), torch.float32, torch.device("cpu"))
    assert c is not a and owner.describe()["buffers"] == 2
    owner.free()
    assert owner.describe() == {"buffers": 0, "windows": 0, "bytes": 0}
    assert owner.symmetric_buffer("out", (2, 7), torch.float32, torch.device("cpu")) is not a  # allocated again
    owner.free()


def test_the_ops_allocate_into_the_owner_serving_their_group_and_freeing_it_leaves_nothing():
    """What the ops call (`symmetric_buffer(..., group)`) lands in the owner registered last for the group; a
    released owner no longer serves it (the process default does, for bare op calls), and `free()` drops what it
    held: a restored handle keeps no communication memory."""
    cpu = torch.device("cpu")
    found = buffers.owner_for(None)  # the process default, or an owner an earlier live handle registered
    first, second = CommBuffers("first"), CommBuffers("second")
    release_first, release_second = first.serve(None), second.serve(None)
    assert buffers.owner_for(None) is second
    held = buffers.symmetric_buffer("ulysses.out", (4,), torch.float32, cpu)
    assert second.describe()["buffers"] == 1 and first.describe()["buffers"] == 0
    release_second()
    release_second()  # idempotent
    assert buffers.owner_for(None) is first
    second.free()
    assert second.describe()["buffers"] == 0 and held is not buffers.symmetric_buffer("ulysses.out", (4,),
                                                                                        torch.float32, cpu)
    release_first()
    first.free()
    assert buffers.owner_for(None) is found
    if found is buffers._DEFAULT:
        buffers.free_symmetric_buffers()
        assert buffers._DEFAULT.describe()["buffers"] == 0


def test_init_distributed_without_torchrun_is_one_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = distributed.init_distributed()
    assert (info.rank, info.world_size) == (0, 1)


def test_nvlink_multicast_is_off_where_we_start_and_untouched_at_import(monkeypatch):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if k not in distributed.SAFE_ENV}
    probe = "import os, xstage_dit.comm.distributed as d; print(sorted(k for k in d.SAFE_ENV if k in os.environ))"
    out = subprocess.run([sys.executable, "-c", probe], env=clean, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", "importing xstage_dit.comm.distributed wrote os.environ"
    env = distributed.apply_safe_env({"NCCL_NVLS_ENABLE": "1"})
    assert env == {**distributed.SAFE_ENV, "NCCL_NVLS_ENABLE": "1"}  # a user's value stays
    assert distributed.apply_safe_env({"NCCL_NVLS_ENABLE": "1"}, force=True) == distributed.SAFE_ENV
    for key in distributed.SAFE_ENV:
        monkeypatch.delenv(key, raising=False)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    distributed.init_distributed()
    for key, value in distributed.SAFE_ENV.items():
        assert os.environ[key] == value


def test_launcher_gives_its_ranks_the_safe_env(monkeypatch):
    from xstage_dit.comm.launcher import rank_env

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = rank_env(1, 2, 12345)
    assert {k: env[k] for k in distributed.SAFE_ENV} == distributed.SAFE_ENV
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("1", "2", "1", "12345")


_EXIT_WORKER = r"""
import json, os, sys, time
import torch.distributed as dist
from xstage_dit.comm.distributed import close_distributed, init_distributed
info = init_distributed(backend="gloo", timeout_s=30)
got = [None] * info.world_size
dist.all_gather_object(got, info.rank)   # leaves gloo work behind, as every worker does
absent = sys.argv[2] == "absent" and info.rank == 1
t0 = time.monotonic()
if absent:
    time.sleep(4)                        # never leaves: rank 0 closes after its timeout all the same
else:
    close_distributed(timeout_s=2)
    close_distributed()                  # a second call (nothing left to close) is a no-op
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as f:
    json.dump({"gathered": got, "initialized_after_close": dist.is_initialized() and not absent,
               "close_s": time.monotonic() - t0}, f)
if absent:
    os._exit(0)                          # its store host (rank 0) is gone: skip the interpreter's teardown
"""


@pytest.mark.parametrize("case", ["together", "absent"])
def test_close_distributed_leaves_the_group_and_the_ranks_exit_cleanly(case, tmp_path):
    """close_distributed is the last call of every rank: the ranks meet on the store, then each destroys its
    group before interpreter finalization (a gloo rank left to finalization was aborted in CI, exit 134), and
    every rank exits 0. A rank that never comes costs the others the timeout, then they close anyway."""
    import json
    import os
    import sys

    from xstage_dit.comm.launcher import launch

    script = tmp_path / "worker.py"
    script.write_text(_EXIT_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    assert launch(2, [sys.executable, str(script), str(tmp_path), case], timeout_s=120, env=env) == 0
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(r["gathered"] == [0, 1] and r["initialized_after_close"] is False for r in results), results
    if case == "absent":
        assert 1.5 < results[0]["close_s"] < 10, results  # waited out its 2 s, no longer
    else:
        assert all(r["close_s"] < 10 for r in results), results
