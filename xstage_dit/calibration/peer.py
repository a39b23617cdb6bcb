"""The peer ("nvlink") calibration target: two processes, rank 0 stores into rank 1's buffer.

Rank 1's buffer is a torch symmetric-memory allocation; rank 0 gets its address as mapped in rank 0's
process from the rendezvous handle (``buffer_ptrs[1]``) and the burst kernel stores through it. With
two GPUs that is NVLink (or PCIe peer-to-peer); with one GPU, two processes can share it
(``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): the same code path, but the stores land in the same
HBM, so that is a functional test, not an NVLink measurement. A gloo group carries the control.

``measure_peer`` starts the two processes (``python -m xstage_dit.calibration.peer``) with a timeout
and returns rank 0's sweep; ``check_peer_write`` runs a few bursts and has rank 1 verify the data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from xstage_dit.calibration.sweep import plan_for, sweep_target, warm_up
from xstage_dit.calibration.targets import CalibrationUnavailable
from xstage_dit.comm.launcher import free_port
from xstage_dit.xstage import KIB


def _peer_devices(device_index: int, allow_shared_gpu: bool) -> tuple[int, int, bool]:
    import torch

    n = torch.cuda.device_count()
    for j in range(n):
        if j != device_index and torch.cuda.can_device_access_peer(device_index, j):
            return device_index, j, False
    if allow_shared_gpu:
        return device_index, device_index, True
    raise CalibrationUnavailable(f"target 'nvlink' needs a second GPU with peer access to cuda:{device_index}, "
                                 f"found {n} GPU(s) without one")


def _launch(mode: str, device, *, k: int, quick: bool, threads: int, allow_shared_gpu: bool,
            timeout_s: float) -> dict:
    d0, d1, shared = _peer_devices(device.index or 0, allow_shared_gpu)
    port = free_port()
    env = dict(os.environ)
    from xstage_dit.comm.distributed import SAFE_ENV

    env.update(SAFE_ENV)
    if shared:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        procs = []
        for rank, dev in ((0, d0), (1, d1)):
            cmd = [sys.executable, "-m", "xstage_dit.calibration.peer", "--mode", mode, "--rank", str(rank),
                   "--port", str(port), "--device", str(dev), "--producers", str(k), "--threads", str(threads),
                   "--out", str(Path(tmp) / f"rank{rank}.json")]
            if quick:
                cmd.append("--quick")
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"peer {mode} did not finish within {timeout_s} s")
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RuntimeError(f"peer {mode} failed (exit codes {codes}):\n" + "\n".join(
                f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(logs)))
        result = json.loads(out.read_text())
        rank1 = json.loads((Path(tmp) / "rank1.json").read_text())
    result["shared_gpu"] = shared
    result["devices"] = [d0, d1]
    result["rank1"] = rank1
    return result


def measure_peer(device, *, k: int, quick: bool, threads: int = 512, allow_shared_gpu: bool = False,
                 timeout_s: float = 300.0) -> dict:
    """Rank 0's sweep (the dict of ``calibration.fit.fit_sweep``) of stores into rank 1's buffer."""
    res = _launch("sweep", device, k=k, quick=quick, threads=threads, allow_shared_gpu=allow_shared_gpu,
                  timeout_s=timeout_s)
    sweep = res["sweep"]
    sweep["shared_gpu"] = res["shared_gpu"]
    sweep["devices"] = res["devices"]
    return sweep


def check_peer_write(device, *, k: int, bytes_per_producer: int = 16 * KIB, allow_shared_gpu: bool = False,
                     timeout_s: float = 120.0) -> dict:
    """Rank 0 runs 3 bursts into rank 1's buffer; rank 1 checks every word of the last burst's pattern.
    Returns ``{"ok": True, "rank1": {...}}`` or raises with the first wrong word."""
    return _launch(f"check:{bytes_per_producer}", device, k=k, quick=True, threads=512,
                   allow_shared_gpu=allow_shared_gpu, timeout_s=timeout_s)


def _worker(args: argparse.Namespace) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from xstage_dit.calibration.csrc.burst import check_written, peer_target, run_bursts
    from xstage_dit.comm.buffers import symmetric_buffer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(args.rank), WORLD_SIZE="2")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=args.rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        if args.mode == "sweep":
            plan = plan_for("nvlink", args.quick)
            nbytes = plan.max_kib * KIB * args.producers
        else:
            bpp = int(args.mode.split(":")[1])
            nbytes = bpp * args.producers
        buf = symmetric_buffer("xstage-calibration-peer", (nbytes,), torch.uint8, device)
        buf.tensor.fill_(0xAB)  # poison: a word never written keeps 0xABABABAB
        torch.cuda.synchronize()
        dist.barrier()
        result: dict = {"rank": args.rank}
        if args.rank == 0:
            target = peer_target(buf.handle.buffer_ptrs[1], nbytes, device, keepalive=buf)
            if args.mode == "sweep":
                clock_hz = warm_up(device)
                result["sweep"] = sweep_target(target, plan=plan, num_producers=args.producers, clock_hz=clock_hz,
                                               threads=args.threads)
                result["sweep"]["target"] = "nvlink"
            else:
                clock_hz = warm_up(device)
                t = run_bursts(target, bytes_per_producer=bpp, num_producers=args.producers, num_bursts=3,
                               gap_iters=64, clock_hz=clock_hz)
                result["issue_s"] = t.issue_s.tolist()
            torch.cuda.synchronize()
        dist.barrier()  # rank 0's kernels are complete: its stores are visible in rank 1's buffer
        if args.rank == 1 and args.mode != "sweep":
            from xstage_dit.calibration.csrc.burst import BurstTarget

            mine = BurstTarget("nvlink", buf.tensor.data_ptr(), nbytes, device, lambda: buf.tensor.cpu(), buf)
            check_written(mine, args.producers, bpp, last_burst=2)
            result["ok"] = True
            result["words_checked"] = nbytes // 4
        Path(args.out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of the peer-target calibration (internal)")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", type=int, required=True)
    parser.add_argument("--producers", type=int, required=True)
    parser.add_argument("--threads", type=int, default=512)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    return _worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
