"""`python -m xstage_dit ...` (also what `torchrun -m xstage_dit` runs on every rank)."""

from xstage_dit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
