"""The NVLink peer target between two separate GPUs (skipped, and counted, on fewer than two GPUs):
rank 0's bursts land in rank 1's buffer on the other GPU, every word arrives, and the quick peer sweep
fits to finite numbers."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.multigpu


def test_peer_write_between_separate_gpus_arrives_whole():
    import torch

    from xstage_dit.calibration.peer import check_peer_write

    res = check_peer_write(torch.device("cuda", 0), k=16, bytes_per_producer=32 * 1024, allow_shared_gpu=False)
    assert res["shared_gpu"] is False, res
    assert res["rank1"]["ok"] is True and res["rank1"]["words_checked"] == 16 * 32 * 1024 // 4
    assert len(res["issue_s"]) == 16 and all(t > 0 for t in res["issue_s"])


def test_quick_peer_sweep_between_separate_gpus_fits():
    import torch

    from xstage_dit.calibration.peer import measure_peer
    from xstage_dit.calibration.fit import fit_sweep

    sweep = measure_peer(torch.device("cuda", 0), k=torch.cuda.get_device_properties(0).multi_processor_count,
                         quick=True)
    assert sweep["shared_gpu"] is False and len(set(sweep["devices"])) == 2, sweep["devices"]
    fit = fit_sweep(sweep)
    r = fit["params"].drain_rate_Bps
    assert math.isfinite(r) and r > 1e9, fit["params"]  # NVLink drains at hundreds of GB/s
