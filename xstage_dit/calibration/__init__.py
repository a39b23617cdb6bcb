"""Calibration of the X-Stage numbers on this machine: measure (the csrc burst kernels), fit, cache.

Layer 2 (imports only `xstage`, `comm` and itself). The public entry points are re-exported here.
"""

from xstage_dit.calibration.runner import (CalibrationConfig, CalibrationResult, CalibrationUnavailable,
                                           available_targets, calibrate, load_or_calibrate, machine_key,
                                           reference_result, resolve_targets, run_calibration)

__all__ = ["CalibrationConfig", "CalibrationResult", "CalibrationUnavailable", "available_targets", "calibrate",
           "load_or_calibrate", "machine_key", "reference_result", "resolve_targets", "run_calibration"]
