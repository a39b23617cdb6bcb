"""The ranks of one replica's engine as Ray actors: rank 0 is the Serve replica itself (it runs the worker thread
and answers HTTP, as rank 0 of ``xstage-dit serve`` does), ranks 1 to world-1 are `RankActor`s that the replica
starts in its own placement group.

The replica's placement group has one bundle per rank (one GPU and `cpus_per_rank` CPUs on a GPU cluster),
``STRICT_PACK``: every rank of a replica on one node, so its collectives stay on that node's NVLink; rank r takes
bundle r (the replica actor takes bundle 0). The ranks then form the torch.distributed group exactly as under our
launcher (`comm.launcher.rank_env`): torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT), the NVLink-multicast-off settings, then `RankContext.join` and the same
`Worker` protocol (control broadcasts, heartbeats, agreement checks, fail-together, recovery).

GPUs: Ray gives each rank actor one GPU and sets its CUDA_VISIBLE_DEVICES to that one. A rank must see its peers'
GPUs too (CUDA IPC and symmetric memory map peer memory through device indices), so every rank of a replica gets
the union of the replica's GPU ids, in one order, and LOCAL_RANK = the index of its own GPU in it
(`rank_envs`); NCCL then runs as under the launcher. Fewer GPUs than ranks (fractional ``gpus_per_rank``) share GPUs
as the launcher's ranks do on a one-GPU machine (gloo control, TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1).

Failure: a rank actor that dies (killed, out of memory, its process exited) ends its ``run`` call with an error;
`EngineGroup.watch` sees it at once and fails the worker with the rank named (every waiting and running job ends
with 503, as when the worker's heartbeat monitor notices; that one stays as the slower second signal). A rank whose
follower loop raises exits its process, as a rank of ``xstage-dit serve`` does.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from xstage_dit.comm.distributed import SAFE_ENV
from xstage_dit.comm.launcher import free_port

log = logging.getLogger(__name__)


def rank_envs(places: list[dict], port: int) -> list[dict[str, str]]:
    """The environment of each rank of one replica, from where each runs (``places[r]``: ``{"node": node id,
    "gpus": [GPU ids Ray assigned it]}``, rank 0 first). ValueError when the ranks are on several nodes (the
    placement group is STRICT_PACK) or when only some ranks have GPUs.

    Example: two ranks holding GPUs 3 and 5 both get CUDA_VISIBLE_DEVICES="3,5", LOCAL_RANK 0 and 1.
    """
    world = len(places)
    nodes = {p["node"] for p in places}
    if len(nodes) != 1:
        raise ValueError(f"expected every rank of a replica on one node (STRICT_PACK), got nodes {sorted(nodes)}")
    with_gpus = [bool(p["gpus"]) for p in places]
    if any(with_gpus) and not all(with_gpus):
        raise ValueError(f"expected a GPU for every rank of a replica or for none, got {[p['gpus'] for p in places]}")
    union = sorted({str(g) for p in places for g in p["gpus"]}, key=lambda g: (len(g), g))
    envs = []
    for rank, place in enumerate(places):
        env = dict(SAFE_ENV, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if union:
            env.update(CUDA_VISIBLE_DEVICES=",".join(union), LOCAL_RANK=str(union.index(str(place["gpus"][0]))))
            if len(union) < world:
                env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        else:
            env["LOCAL_RANK"] = str(rank)
        envs.append(env)
    return envs


def here() -> dict:
    """This process's place for `rank_envs`: its node and the GPUs Ray assigned it."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid()}


def set_threads(env: dict[str, str], cpus: float) -> None:
    """Apply a rank's environment to this process and give torch `cpus` intra-op threads on a CPU rank (ranks
    share the node's cores, as `xstage-dit serve` divides them)."""
    os.environ.update(env)
    if "CUDA_VISIBLE_DEVICES" not in env:
        import torch

        torch.set_num_threads(max(1, int(cpus)))


class RankActor:
    """Rank r > 0 of a replica (a Ray actor, `EngineGroup` starts it): `place`, then `run` until rank 0 says stop."""

    def place(self) -> dict:
        return here()

    def run(self, env: dict[str, str], options: Any) -> int:
        """Join the ranks and serve rank 0's batches (`Worker.run_follower`) of the deployment's `DeployOptions`;
        returns 0 when rank 0 stops them. A failure exits this process (rank 0 then fails its jobs with 503 and
        Serve replaces the replica)."""
        from xstage_dit.server.ranks import RankContext
        from xstage_dit.server.startup import model_loader
        from xstage_dit.server.worker import Worker

        set_threads(env, options.cpus_per_rank)
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{env['RANK']} %(levelname)s %(name)s: "
                                                      "%(message)s")
        config = options.server
        try:
            load = model_loader(options.model, config.parallel, **options.loader_kwargs())
            return Worker(load, config, join=lambda: RankContext.join(config.parallel.timeout_s)).run_follower()
        except Exception as exc:  # noqa: BLE001 - as a rank of `xstage-dit serve`: one line, then exit
            log.error("rank %s stopping: %s", env["RANK"], str(exc).splitlines()[0] if str(exc) else repr(exc))
            os._exit(1)


class EngineGroup:
    """The ranks > 0 of the replica this runs in (module docstring), of the deployment's `DeployOptions`: its world
    size, each rank's CPUs and GPUs (its bundle), and what every rank loads."""

    def __init__(self, options: Any):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.options = options
        group = ray.util.get_current_placement_group()
        remote = ray.remote(RankActor)
        self.actors = []
        for rank in range(1, options.world_size):
            strategy = None if group is None else PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank)
            self.actors.append(remote.options(num_cpus=options.cpus_per_rank, num_gpus=options.gpus_per_rank,
                                              max_restarts=0, scheduling_strategy=strategy).remote())
        self.runs: list = []
        self.places: list[dict] = []
        self.stopping = False

    async def start(self) -> dict[str, str]:
        """Place every rank, start ranks 1.. joining, and return rank 0's environment (apply it before joining)."""
        import asyncio

        self.places = [here(), *await asyncio.gather(*(actor.place.remote() for actor in self.actors))]
        envs = rank_envs(self.places, free_port())
        self.runs = [actor.run.remote(env, self.options) for actor, env in zip(self.actors, envs[1:])]
        return envs[0]

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(reason)`` (from a thread) as soon as a rank's ``run`` ends (its actor died, or it
        stopped before rank 0 told it to)."""
        if not self.runs:
            return

        def wait() -> None:
            import ray

            done, _ = ray.wait(self.runs, num_returns=1, timeout=None)
            if self.stopping:
                return  # rank 0 told them to stop
            rank = self.runs.index(done[0]) + 1
            try:
                reason = f"exited with {ray.get(done[0])}"
            except Exception as exc:  # noqa: BLE001 - the actor died: the error says how
                reason = f"died ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
            on_death(f"lost a rank: rank {rank} (pid {self.places[rank].get('pid')}) {reason}")

        threading.Thread(target=wait, name="xstage-rank-watch", daemon=True).start()

    def stop(self) -> None:
        """Kill the rank actors (after rank 0 told them to stop, or when the replica goes)."""
        import ray

        self.stopping = True
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
