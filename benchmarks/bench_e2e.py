"""End-to-end latency benchmark: the same as `xstage-dit bench` (the harness lives in `xstage_dit.bench.e2e`;
the command hands it the in-process server the xstage-served contender needs)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when run as a script

from xstage_dit.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
