"""benchmarks/_attention_window.window_summary on synthetic rows (the GPU table's numbers are in
benchmarks/results/attention/): minima over all rows, the residual of each row's best kernel, and the rows and
kernels that failed, by shape."""

from __future__ import annotations


def _row(seq, world, scope, x_fused, best, residual, **extra):
    return {"seq_len": seq, "heads": 24, "world": world, "scope": scope, "x_fused": x_fused, "best_window": best,
            f"residual_{best.split('_')[0]}_pct": residual, **extra}


def test_summary_takes_minima_and_names_failures():
    from benchmarks._attention_window import window_summary

    rows = [_row(4608, 8, "rank", 1.06, "fa4_window", 3.0),
            _row(4608, 8, "all", 0.97, "fa4_window", 1.0,
                 kernel_errors={"cudnn_window": "RuntimeError('capture')"}),
            _row(32768, 8, "rank", 1.10, "fa4_window", 0.5),
            _row(32768, 1, "all", 1.12, "fa4gqa_window", -1.5),
            {"seq_len": 8192, "heads": 24, "world": 4, "scope": "rank", "error": "RuntimeError('oom')"}]
    s = window_summary(rows)
    assert s["fused_over_cudnn"] == 0.97 and s["fused_over_cudnn_below_16k"] == 0.97
    assert s["fused_over_cudnn_from_16k"] == 1.10 and s["residual_pct_max"] == 3.0
    # per rank: the launches a rank runs (P > 1); the P = 1 row's window is the local layout: its |residual| is noise
    assert s["residual_pct_max_per_rank"] == 3.0 and s["residual_noise_floor_pct"] == 1.5
    assert s["failed_rows"] == ["S8192_H24_P4_rank"]
    assert s["failed_kernels"] == {"S4608_H24_P8_all": {"cudnn_window": "RuntimeError('capture')"}}
    assert s["by_shape"]["S4608_H24_P8_rank"] == 1.06
