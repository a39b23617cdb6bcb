"""`ParallelConfig`: what the user sets for `parallelize`, validated on construction.

Degrees (DESIGN §1):

- ``sp``: Ulysses sequence-parallel degree. Every rank of an sp group holds a slice of the token
  sequence; attention exchanges heads for tokens (fused op in `xstage_dit.ops.attention`).
- ``ep``: expert-parallel degree for MoE transformers. EP shares the ranks of the sp group (the MoE
  layer's tokens are the rank's sequence shard), so ``ep`` is 1 (experts replicated) or ``sp``.
- ``cfg``: classifier-free-guidance parallel degree, 1 or 2: the conditional and unconditional
  branches run on different sp groups at the same time.

``world_size == sp * cfg``. Rank ``r`` is in cfg group ``r // sp`` and holds sequence shard ``r % sp``.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("auto", "fused", "serial")
# The commands' --cfg-batch values (`xstage-dit generate / serve / bench`; a bare --cfg-batch is "on") and the
# ParallelConfig.cfg_batch each stands for.
CFG_BATCH_FLAGS = {"auto": "auto", "on": True, "off": False}
CFG_BATCH = tuple(CFG_BATCH_FLAGS.values())
CFG_BATCH_HELP = ("a step's two guidance calls as one batch of two (patches.cfg_batch; NucleusMoE, --cfg 1): auto = "
                  "where it applies (default), on = an error where it does not, off")


def add_cfg_batch_option(parser, help_prefix: str = "") -> None:
    """The commands' one ``--cfg-batch [auto|on|off]`` (default auto) on an argparse parser."""
    parser.add_argument("--cfg-batch", nargs="?", const="on", default="auto", choices=tuple(CFG_BATCH_FLAGS),
                        help=help_prefix + CFG_BATCH_HELP)


def cfg_batch_of(args) -> bool | str:
    """``ParallelConfig.cfg_batch`` for parsed arguments (`add_cfg_batch_option`'s; "off" where they have none)."""
    return CFG_BATCH_FLAGS[getattr(args, "cfg_batch", "off")]


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism and schedule policy for `xstage_dit.parallelize`.

    sp: sequence-parallel (Ulysses) degree, >= 1.
    ep: expert-parallel degree: 1 or equal to ``sp`` (EP shares the sp ranks).
    cfg: 1 or 2 (conditional / unconditional branch on separate rank groups).
    schedule: attention schedule, "auto" (per shape: the kernel the machine's sweep measured fastest, then the
        calibrated design test: "fused:<kernel>" or "serial"; at world 1 FA4 where it beat torch SDPA), "fused"
        or "serial".
    calibrate: run/load the X-Stage calibration at startup and time the attention kernels of a new shape at its
        first call, both cached per machine (GPU only; False: caches only; on a CPU the choice falls back to
        the uncalibrated rule and says so in the log).
    timeout_s: collective timeout used when `parallelize` has to create the process group itself.
    check_inputs: before every eager forward, compare a fingerprint of the transformer's inputs over the
        sp ranks (one small all-gather and a host sync): ranks whose generators were seeded differently
        then fail on every rank instead of returning an image no single process makes. False skips it
        when the caller guarantees identical inputs (a server that broadcasts each request).
    cfg_batch: run a step's two guidance calls (cond, uncond) as one forward on a batch of two
        (`patches.cfg_batch`; NucleusMoE; with cfg=1 only). True: on, an error where it does not apply; "auto":
        on where it applies (a pipeline and transformer CFG batching knows, cfg=1), else off, with the reason in
        the log and ``ParallelHandle.cfg_batch_reason`` (the commands' default: NucleusMoE 1024², 4 steps on
        an H100 at b3a1445, 0.90x the time eager and 0.935x compiled); False (the library's default): off.

    Example: ``ParallelConfig(sp=4)`` on 4 ranks; ``ParallelConfig(sp=2, ep=2, cfg=2)`` on 4 ranks.
    """

    sp: int = 1
    ep: int = 1
    cfg: int = 1
    schedule: str = "auto"
    calibrate: bool = True
    timeout_s: float = 600.0
    check_inputs: bool = True
    cfg_batch: bool | str = False

    def __post_init__(self) -> None:
        for name in ("sp", "ep", "cfg"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected {name} to be an int >= 1, got {value!r}")
        if self.cfg not in (1, 2):
            raise ValueError(f"expected cfg to be 1 or 2 (two guidance branches), got {self.cfg}")
        if self.ep not in (1, self.sp):
            raise ValueError(
                f"expected ep to be 1 or equal to sp={self.sp} (expert parallelism shares the sequence-parallel "
                f"ranks), got ep={self.ep}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"expected schedule to be one of {SCHEDULES}, got {self.schedule!r}")
        if not (self.timeout_s > 0):
            raise ValueError(f"expected timeout_s > 0, got {self.timeout_s!r}")
        if not (isinstance(self.cfg_batch, bool) or self.cfg_batch == "auto"):
            raise ValueError(f"expected cfg_batch to be one of {CFG_BATCH}, got {self.cfg_batch!r}")
        if self.cfg_batch is True and self.cfg != 1:
            raise ValueError(f"expected cfg=1 with cfg_batch (the two guidance calls batched on the same ranks), "
                             f"got cfg={self.cfg}")

    @property
    def world_size(self) -> int:
        """Number of ranks this configuration needs: ``sp * cfg``."""
        return self.sp * self.cfg

    def expert_shard(self, rank: int) -> tuple[int, int] | None:
        """What global rank `rank` loads with ``load_pipeline(..., expert_shard=...)``: (its rank in the EP
        group, ep) when ep > 1, None when experts are replicated (ep=1).

        The EP group is the sp group, where global rank ``r`` has rank ``r % sp``.
        """
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"expected a rank in [0, {self.world_size}), got {rank!r}")
        return (rank % self.sp, self.ep) if self.ep > 1 else None

    def check_world(self, world_size: int) -> None:
        """Raise if the degrees do not multiply to `world_size`."""
        if self.world_size != world_size:
            raise ValueError(
                f"expected sp * cfg == world size, got sp={self.sp} * cfg={self.cfg} = {self.world_size} "
                f"for a world of {world_size} ranks"
            )
