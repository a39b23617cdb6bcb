"""Private torch API is touched in one module, `xstage_dit/_torch_private.py`, behind a version check that names
the version; its recompile-limit raise and its owned compiles leave the process as they found it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from xstage_dit import _torch_private as tp

ROOT = Path(__file__).resolve().parents[2]
# torch._C..., torch._dynamo..., torch.distributed._symmetric_memory, torch._inductor, torch._TorchCompile...
PRIVATE = re.compile(r"\btorch\.(_[A-Za-z]\w*|distributed\._\w+)")
# The xfuser contender's own: a torch._dynamo.reset() after xfuser's compile and Inductor's overlap settings an
# xfuser runner sets process-wide (both about xfuser's stack, see _torch_private's docstring).
ALLOWED = {"xstage_dit/_torch_private.py", "xstage_dit/bench/xfuser_stack.py"}


def test_private_torch_api_only_in_the_one_module():
    found = []
    for path in sorted((ROOT / "xstage_dit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if PRIVATE.search(code.replace("torch.__version__", "")) and "``" not in code:
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "private torch API outside xstage_dit/_torch_private.py:\n" + "\n".join(found)


def test_the_version_check_names_the_version():
    assert tp.check_torch_version() == torch.__version__
    assert tp.check_torch_version("2.11.0+cu130") == "2.11.0+cu130"
    with pytest.raises(tp.TorchPrivateAPIError, match=r"expected torch 2\.11 to 2\.14 .*got torch 2\.10\.1"):
        tp.check_torch_version("2.10.1")
    with pytest.raises(tp.TorchPrivateAPIError, match=r"got torch 3\.0\.0"):
        tp.check_torch_version("3.0.0")
    with pytest.raises(tp.TorchPrivateAPIError, match="expected a torch version MAJOR.MINOR..., got 'dev'"):
        tp.check_torch_version("dev")


def test_a_missing_private_name_fails_naming_it(monkeypatch):
    monkeypatch.delattr(torch._C, "_construct_storage_from_data_pointer", raising=False)
    with pytest.raises(tp.TorchPrivateAPIError, match="torch._C._construct_storage_from_data_pointer"):
        tp.storage_from_data_pointer(0, torch.device("cpu"), 1)


def test_recompile_limits_are_the_largest_request_and_come_back_with_the_last_undo():
    config = torch._dynamo.config
    saved = (config.recompile_limit, config.accumulated_recompile_limit)
    first = tp.raise_recompile_limits(saved[0] + 10, saved[1] + 10)
    second = tp.raise_recompile_limits(saved[0] + 20, saved[1] + 5)
    assert (config.recompile_limit, config.accumulated_recompile_limit) == (saved[0] + 20, saved[1] + 10)
    second()
    assert (config.recompile_limit, config.accumulated_recompile_limit) == (saved[0] + 10, saved[1] + 10)
    second()  # idempotent: the other owner's request still holds
    assert config.recompile_limit == saved[0] + 10
    first()
    assert (config.recompile_limit, config.accumulated_recompile_limit) == saved


def test_an_owned_compile_drops_its_graphs_and_nobody_elses():
    """Two modules of one class: the other one's graph stays (no recompile, same output) while an owner compiles
    and drops its own twenty times; the owner's code objects leave no cache entry behind."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).relu()

    torch.manual_seed(0)
    x = torch.randn(2, 4)
    other = Block()
    other_compiled = torch.compile(other.forward, backend="eager")
    want = other_compiled(x)
    others = len(tp.cache_entries(Block.forward))
    frames = tp.frames_converted()
    mine = torch.nn.Sequential(Block(), Block())
    eager = mine(x)
    for _ in range(20):
        owner = tp.OwnedCompiler()
        for block in mine:
            owner.compile_region(block, backend="eager", dynamic=False)
        fast = owner.compile(mine.forward, backend="eager", dynamic=False)
        assert torch.equal(fast(x), eager) and torch.equal(mine(x), eager)
        codes = list(owner._codes)
        assert all(tp.cache_entries(code) for code in codes[1:])  # what this owner compiled sits on its own code
        owner.drop()
        assert not any(tp.cache_entries(code) for code in codes)
        assert not any("_compiled_call_impl" in vars(block) for block in mine)
    assert len(tp.cache_entries(Block.forward)) == others  # the shared forward keeps only the other's entry
    before = tp.frames_converted()
    assert torch.equal(other_compiled(x), want) and tp.frames_converted() == before  # no recompile
    assert before > frames  # the owners did compile
