"""`to_jsonable(value)`: plain JSON data from the records we report (dataclasses such as `ScheduleChoice`
and `XStageParams`, dicts with non-string keys, tuples); anything else becomes its `str`.
Used by the server's `/v1/calibration` report and by the benchmark result files."""

from __future__ import annotations

import dataclasses
from typing import Any


def to_jsonable(value: Any) -> Any:
    """Recursively convert `value` to JSON-serialisable data (dicts, lists, str, int, float, bool, None)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
