"""Calibration of the X-Stage numbers on this machine: measure (the csrc burst kernels), fit, cache, and
the one provider of the numbers to everything above (`provider.params_for`).

Layer 2 (imports only `xstage`, `comm` and itself). The public entry points are re-exported here.
"""

from xstage_dit.calibration.cache import machine_key
from xstage_dit.calibration.fit import fit_sweep
from xstage_dit.calibration.provider import ChosenParams, params_for, serving_target
from xstage_dit.calibration.result import CalibrationResult, reference_result
from xstage_dit.calibration.runner import CalibrationConfig, calibrate, load_or_calibrate, run_calibration
from xstage_dit.calibration.targets import CalibrationUnavailable, available_targets, resolve_targets

__all__ = ["CalibrationConfig", "CalibrationResult", "CalibrationUnavailable", "ChosenParams", "available_targets",
           "calibrate", "fit_sweep", "load_or_calibrate", "machine_key", "params_for", "reference_result",
           "resolve_targets", "run_calibration", "serving_target"]
