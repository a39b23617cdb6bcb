"""Per-request overhead of the Ray Serve path (`xstage_dit.deploy`, one replica) against ``xstage-dit serve``: the
same model, options and request, one run, medians.

Both servers are built from one ``xstage-dit serve`` command line: ``xstage-dit serve ARGS`` as a subprocess (the
baseline), and the same ARGS plus ``--replicas 1`` as a Ray Serve application on a local Ray cluster started by
this script (the replica's `DeployOptions` come from the CLI's own parsing, so nothing differs but the path).
Each request is one image of `--size` and `--steps`, sent alone (one at a time, keep-alive client), the answer in
JSON as clients get it. By default both servers stay up and the requests alternate in rounds (A B, B A, ...), so a
drift of the GPU over the run reads on both alike; ``--sequential`` runs one server, then the other (for a GPU that
cannot hold the model twice).

Per path: the median, p20 and p80 of the client's latency, the median of the server's own time for the job
(``timings.total_s``: queued + pipeline + encode) and of the rest (client latency minus that: HTTP, the Ray proxy
hop, the JSON). The headline is ``ratio`` = median latency of Ray Serve / median latency of ``xstage-dit serve``
(target <= 1.02 at full FLUX 1024x1024).

Example (one GPU; the device needs the ray[serve] wheels, see docs/ray.md)::

    python benchmarks/bench_ray_serve.py --model full-flux --size 1024x1024 --steps 28 --requests 12 \\
        --out .gpu_out/ray-serve
    python benchmarks/bench_ray_serve.py --model tiny-flux --size 64x64 --steps 2 --requests 6 --out /tmp/rs  # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout, when run as a script

import httpx  # noqa: E402

from benchmarks._common import environment, write_results  # noqa: E402

COLUMNS = ["path", "requests", "median_s", "p20_s", "p80_s", "server_median_s", "rest_median_ms", "ratio"]
READY_S = 1800.0  # load + warm-up (+ compile) of full FLUX


def _free_port() -> int:
    from xstage_dit.comm.launcher import free_port

    return free_port()


def _wait_ready(url: str, what: str, proc: subprocess.Popen | None = None, timeout_s: float = READY_S) -> float:
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
            try:
                if client.get("/health").status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{what} not ready within {timeout_s:.0f} s")
            time.sleep(1.0)


@contextlib.contextmanager
def plain_server(serve_argv: list[str]):
    """``xstage-dit serve SERVE_ARGV`` as a subprocess; yields its URL."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "xstage_dit", *serve_argv, "--port", str(port)], cwd=ROOT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        print(f"xstage-dit serve ready in {_wait_ready(url, 'xstage-dit serve', proc):.1f} s", flush=True)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def ray_server(serve_argv: list[str], gpus_per_rank: float, cpus_per_rank: float):
    """The same command with ``--replicas 1`` as a Ray Serve application on a local cluster; yields its URL.
    cpus_per_rank: the cores a rank of ``xstage-dit serve`` has (its torch threads follow them, as Ray's do)."""
    import ray
    from ray import serve

    from xstage_dit.cli import build_parser
    from xstage_dit.cli.serve import _config
    from xstage_dit.cli.serve_replicas import options
    from xstage_dit.deploy.application import build

    args = build_parser().parse_args([*serve_argv, "--replicas", "1", "--gpus-per-rank", str(gpus_per_rank),
                                      "--cpus-per-rank", str(cpus_per_rank)])
    deploy = options(args, _config(args))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # the GPU machine has no internet
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.monotonic()
        serve.run(build(deploy), name=deploy.app_name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, "Ray Serve")
        print(f"Ray Serve (1 replica of {deploy.world_size} rank(s)) ready in {time.monotonic() - started:.1f} s",
              flush=True)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def one_request(client: httpx.Client, body: dict) -> tuple[float, float]:
    """(client latency, the server's own total_s) of one request, in seconds."""
    started = time.perf_counter()
    r = client.post("/v1/images/generations", json=body)
    latency = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"expected 200, got {r.status_code}: {r.text[:300]}")
    return latency, float(r.json()["timings"]["total_s"])


def measure(urls: dict[str, str], body: dict, requests: int, warmup: int, sequential_order: bool) -> dict:
    """{path: [(latency, server total), ...]}: `warmup` untimed requests per path, then `requests` timed ones,
    alternating in rounds of one request per path (forward, then backward) unless only one URL is up."""
    clients = {name: httpx.Client(base_url=url, timeout=3600) for name, url in urls.items()}
    try:
        for name, client in clients.items():
            for _ in range(warmup):
                one_request(client, body)
        out: dict[str, list] = {name: [] for name in clients}
        names = list(clients)
        for r in range(requests):
            for name in (names if r % 2 == 0 or sequential_order else names[::-1]):
                out[name].append(one_request(clients[name], body))
        return out
    finally:
        for client in clients.values():
            client.close()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def rows_of(samples: dict[str, list]) -> list[dict]:
    rows = []
    for name, pairs in samples.items():
        latency = [p[0] for p in pairs]
        rows.append({"path": name, "requests": len(pairs), "median_s": statistics.median(latency),
                     "p20_s": _quantile(latency, 0.2), "p80_s": _quantile(latency, 0.8),
                     "server_median_s": statistics.median(p[1] for p in pairs),
                     "rest_median_ms": 1e3 * statistics.median(p[0] - p[1] for p in pairs), "ratio": None})
    base = rows[0]["median_s"]
    for row in rows:
        row["ratio"] = row["median_s"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="full-flux")
    p.add_argument("--size", default="1024x1024", help="WxH of every request")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--requests", type=int, default=12, help="timed requests per path")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per path first")
    p.add_argument("--compile", default=None, help="--compile of both servers (default: the server's)")
    p.add_argument("--gpus-per-rank", type=float, default=None, help="default: 1 with CUDA, else 0")
    p.add_argument("--sequential", action="store_true",
                   help="one server at a time (a GPU that cannot hold the model twice)")
    p.add_argument("--out", default="benchmarks/results/serving/ray-serve", help="output folder")
    p.add_argument("--target", type=float, default=1.02, help="ratio the Ray path should stay under")
    args = p.parse_args(argv)
    try:  # before either server starts: a Ray that does not import costs seconds here, not a server's warm-up
        import ray.serve  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure (a missing package, a grpcio mismatch) is named
        p.error(f"expected Ray Serve to import (pip install 'xstage-dit[ray]'), got {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:300]}")
    import torch

    gpus = args.gpus_per_rank if args.gpus_per_rank is not None else (1.0 if torch.cuda.is_available() else 0.0)
    cpus = max(1, (os.cpu_count() or 1) // args.sp)  # a rank's cores under `xstage-dit serve --sp N`
    serve_argv = ["serve", "--model", args.model, "--sp", str(args.sp), "--batching", "never", "--max-batch-size",
                  "1", "--warmup-sizes", args.size, "--log-level", "warning",
                  *(["--compile", args.compile] if args.compile else [])]
    width, height = (int(v) for v in args.size.lower().split("x"))
    body = {"prompt": "a red fox in the snow", "size": f"{width}x{height}", "num_inference_steps": args.steps,
            "seed": 1}
    names = ("xstage-dit serve", "ray serve")
    if args.sequential:
        samples = {}
        with plain_server(serve_argv) as url:
            samples.update(measure({names[0]: url}, body, args.requests, args.warmup, True))
        with ray_server(serve_argv, gpus, cpus) as url:
            samples.update(measure({names[1]: url}, body, args.requests, args.warmup, True))
    else:
        with plain_server(serve_argv) as plain, ray_server(serve_argv, gpus, cpus) as ray_url:
            samples = measure({names[0]: plain, names[1]: ray_url}, body, args.requests, args.warmup, False)
    rows = rows_of(samples)
    ratio = rows[1]["ratio"]
    summary = {"model": args.model, "size": args.size, "steps": args.steps, "sp": args.sp, "ratio": ratio,
               "target": args.target, "within_target": ratio <= args.target,
               "order": "sequential" if args.sequential else "alternating rounds",
               "extra_ms": 1e3 * (rows[1]["median_s"] - rows[0]["median_s"])}
    json_path, _ = write_results(Path(args.out) / f"ray-serve-{args.model}-{args.size}", "ray-serve", rows, summary,
                                 COLUMNS, notes="ratio: median latency over `xstage-dit serve`'s; rest: client "
                                                "latency minus the server's own job time.",
                                 env=environment())
    for row in rows:
        print(f"{row['path']:>18}: median {row['median_s']:.4f} s (p20 {row['p20_s']:.4f}, p80 {row['p80_s']:.4f}), "
              f"server {row['server_median_s']:.4f} s, rest {row['rest_median_ms']:.1f} ms, ratio {row['ratio']:.4f}")
    print(f"ratio {ratio:.4f} (target <= {args.target}): {'ok' if ratio <= args.target else 'OVER'}; {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
