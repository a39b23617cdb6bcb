"""The X-Stage model (DESIGN §2), pure Python: the parameters and laws (`laws`) and their fits (`fits`).

The first layer: it imports nothing of the project. Everything here is re-exported for
``from xstage_dit.xstage import XStageParams, design_test, fit_params``.
"""

from xstage_dit.xstage.fits import *  # noqa: F401,F403
from xstage_dit.xstage.fits import __all__ as _fits_all
from xstage_dit.xstage.laws import *  # noqa: F401,F403
from xstage_dit.xstage.laws import __all__ as _laws_all

__all__ = [*_laws_all, *_fits_all]
