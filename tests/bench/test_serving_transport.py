"""benchmarks/bench_serving.py transport on the CPU: every listener and answer size is timed and written, and the
in-process server's listener answers a small POST without the delayed-ACK stall the old socket had."""

from __future__ import annotations

import json


def test_transport_times_every_listener_and_size(tmp_path):
    from benchmarks._serving_transport import SIZES
    from benchmarks.bench_serving import main

    assert main(["transport", "--reps", "5", "--out-dir", str(tmp_path), "--tag", "test"]) == 0
    data = json.loads((tmp_path / "http-transport-test.json").read_text())
    rows = {(r["listener"], r["answer_bytes"]): r for r in data["rows"]}
    assert set(rows) == {(way, size) for way in ("uvicorn binds", "loopback_listener", "socket.socket()")
                         for size in SIZES}
    assert all(r["post_ms"] > 0 and r["get_ms"] > 0 for r in rows.values())
    # The stall is >= 40 ms (Linux's shortest delayed ACK); a loopback round trip of 100 bytes is ~1 ms.
    assert rows[("loopback_listener", 100)]["post_ms"] < 30, rows[("loopback_listener", 100)]
    assert (tmp_path / "http-transport-test.md").read_text().startswith("# http-transport")
