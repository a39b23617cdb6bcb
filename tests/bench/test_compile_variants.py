"""`benchmarks/bench_compile_variants.py`'s variant names: the Inductor options each one compiles with."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_compile_variants import GRAPHS, TUNED, parse_variant


def test_variant_names_give_their_mode_options_and_schedule():
    assert parse_variant("eager") == ("eager", None, False, "serial")
    assert parse_variant("regional+qkv@auto") == ("regional", None, True, "auto")
    assert parse_variant("full+graphs") == ("full", {"triton.cudagraphs": True}, False, "serial")
    assert parse_variant("full+tuned+graphs@none") == ("full", {**TUNED, **GRAPHS}, False, "none")


@pytest.mark.parametrize("bad", ["eager+graphs", "eager+tuned", "full+fast", "regional@fastest", "max"])
def test_a_bad_variant_is_named(bad):
    with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
        parse_variant(bad)
