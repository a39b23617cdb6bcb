"""Errors shared by the command layers (`xstage_dit.cli`, `xstage_dit.bench`): kept below both, so the
benchmark harness raises the CLI's error without importing the CLI."""

from __future__ import annotations


class UsageError(Exception):
    """A bad option value: printed by `xstage-dit` as one line `xstage-dit: error: ...` with exit code 2."""
