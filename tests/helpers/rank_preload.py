"""What the fork server of `tests.helpers.preloaded` imports before it forks the tests' ranks: the libraries every
rank program imports and the pipeline class of every registered family (diffusers loads them lazily: ~1.5 s a rank).
Imports only: nothing runs, so no thread exists when the server forks."""

import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import diffusers
import transformers  # noqa: F401

import xstage_dit.comm.distributed  # noqa: F401
import xstage_dit.features  # noqa: F401
from xstage_dit.families.registry import supported_pipelines

import tests.helpers.family_harness  # noqa: F401

for _name in supported_pipelines():
    getattr(diffusers, _name, None)  # a class diffusers lacks fails in the rank that asks for it, not here
