"""Hardware gating in one place: `gpu` and `multigpu` tests are skipped, visibly and counted, without
the hardware. A GPU test never passes without running its subject."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_SKIPPED: dict[str, int] = {"gpu": 0, "multigpu": 0}


def pytest_collection_modifyitems(config, items):
    num_gpus = _cuda_device_count()
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"multigpu: needs >= 2 CUDA GPUs, found {num_gpus}"))
            _SKIPPED["multigpu"] += 1
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA GPU, found none"))
            _SKIPPED["gpu"] += 1


def pytest_terminal_summary(terminalreporter):
    if any(_SKIPPED.values()):
        terminalreporter.write_line(
            f"hardware-gated tests skipped: gpu={_SKIPPED['gpu']} multigpu={_SKIPPED['multigpu']} "
            "(run scripts/gpu_tests.sh on a GPU machine)",
            yellow=True,
        )
