"""End-to-end latency benchmark: the same as `xstage-dit bench` (the harness lives in `xstage_dit.bench.e2e`;
the command hands it the in-process server the xstage-served contender needs).

    python benchmarks/bench_e2e.py --model full-flux --compile ...   # = xstage-dit bench ...
    python benchmarks/bench_e2e.py sync-points --model full-nucleusmoe --steps 4 --compile regional

``sync-points`` (GPU only, `benchmarks/_e2e_sync_points.py`): every synchronizing CUDA operation of one warm
pipeline call, by the line that asked for it (where a host-bound call waits for the GPU).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when run as a script


def main(argv: list[str]) -> int:
    """``sync-points ...`` runs that measurement; anything else is ``xstage-dit bench`` with these arguments."""
    if argv and argv[0] == "sync-points":
        from benchmarks._e2e_sync_points import main as sync_points

        return sync_points(argv[1:])
    from xstage_dit.cli import main as cli

    return cli(["bench", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
