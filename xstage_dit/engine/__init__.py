"""The engine layer: a pipeline and its feature stack from one configuration (between features and runtime).

`EngineConfig` (`engine.config`) holds everything that decides what runs; `Engine` (`engine.engine`) loads
the pipeline through the family records and applies the stack in its one declared order
(`xstage_dit.features.stack.ORDER`), which ``generate``, ``serve`` and ``bench`` all use.
"""

from xstage_dit.engine.config import EngineConfig
from xstage_dit.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
