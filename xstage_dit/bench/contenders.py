"""The contenders of the end-to-end benchmark, each with ``check`` (the reason it cannot run, found before
any GPU work), ``apply``, ``call`` and ``restore``: plain diffusers, the xstage stack bare and served, diffusers'
context parallelism. The FP8 ones are in `fp8_contenders`, the step caches' in `cache_contenders`, xfuser's in
`xfuser_stack`; their run order in `lineup`."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import numpy as np
import torch

from xstage_dit.bench.contender import Contender
from xstage_dit.bench.options import BASELINE_REPEAT
from xstage_dit.bench.session import Bench, error_text
from xstage_dit.families.registry import record
from xstage_dit.engine import Engine, EngineConfig
from xstage_dit.features.compile import CompileConfig, parse_extras
from xstage_dit.features.compile_fixes import fix_grouped_mm_offsets
from xstage_dit.features.config import ParallelConfig, cfg_batch_of
from xstage_dit.jsonable import to_jsonable
from xstage_dit.features.step_cache import cache_request
from xstage_dit.features.step_cache.options import cache_config
from xstage_dit.runtime.generation import run_pipeline


def fp8_refusal(b: Bench) -> str | None:
    """Why an FP8 contender cannot run on the bench's device (row-wise FP8 GEMMs), None where it can."""
    from xstage_dit.features.fp8 import require_fp8_device

    try:
        require_fp8_device(b.device, "row")
    except ValueError as exc:
        return str(exc)
    return None


class PlainDiffusers(Contender):
    """The unmodified diffusers pipeline; at a GPU count > 1 every rank runs it alone on its GPU."""

    family = "diffusers"
    compile_vae = False  # what a diffusers user compiles: the transformer's repeated blocks alone

    def apply(self, b: Bench) -> None:
        # Plain diffusers' NucleusMoE does not compile (Inductor drops the dtype of its experts' offsets cumsum:
        # `features.compile_fixes`). The compiled baseline takes that one-function fix, as a user who compiles it
        # must, and the row says so: a failed row is no figure to compare with.
        self._unfix = None
        if self.compile:
            self._unfix, fixed = fix_grouped_mm_offsets(b.pipe.transformer)
            if fixed:
                self.info["compile_fix"] = (f"diffusers' grouped_mm offsets fixed in {fixed} SwiGLUExperts "
                                            "(plain diffusers does not compile them: pytorch/pytorch#189518)")
        super().apply(b)
        if self.info.get("compile_fix"):
            self.info["compile_mode"] = f"{self.info['compile_mode']}; {self.info['compile_fix']}"

    def restore(self, b: Bench) -> None:
        super().restore(b)
        unfix, self._unfix = getattr(self, "_unfix", None), None
        if unfix is not None:
            unfix()


class PlainDiffusersRepeat(PlainDiffusers):
    """Plain diffusers again, after the eager xstage contenders (an A/B/A order, at ``--rounds 1``): the
    baseline's own drift over the run (clocks, temperature) shows, and the xstage rows pair with both runs."""

    family = BASELINE_REPEAT


class XStage(Contender):
    """The xstage stack (`xstage_dit.engine.Engine`: ``parallelize``'s features, batch invariance, compile last)
    with the serial schedule, or with the calibrated ones: the pipeline `serve` and `generate` run."""

    ours = True
    quantize = "none"  # the FP8 contenders: "fp8"
    fp8_attention = "off"  # the FP8-attention contenders: "auto"

    def __init__(self, compile: bool, schedule: str):
        super().__init__(compile)
        self.schedule = schedule
        self.family = "xstage-serial" if schedule == "serial" else "xstage-calibrated"
        self.engine = None

    def _config(self, b: Bench) -> ParallelConfig:
        moe = record(b.spec.family).experts is not None  # its MoE layers share the sequence-parallel ranks (EP)
        common = dict(sp=b.world_size, ep=b.world_size if moe else 1, cfg=1,
                      cfg_batch=cfg_batch_of(b.args))
        if self.schedule == "serial":
            return ParallelConfig(**common, schedule="serial", calibrate=False)
        return ParallelConfig(**common, schedule="auto", calibrate=True)

    def _engine_config(self, b: Bench) -> EngineConfig:
        """The engine of this contender: its ParallelConfig, batch invariance for images, and in the compiled
        variant --compile's mode (or its own), --compile-guards and --compile-extra, the VAE decoder too."""
        compiled = CompileConfig("off")
        if self.compile:
            compiled = CompileConfig(self.compile_mode or b.args.compile, vae=self.compile_vae,
                                     guards=getattr(b.args, "compile_guards", "full"),
                                     extras=parse_extras(getattr(b.args, "compile_extra", "")))
        return EngineConfig(device=b.device, dtype=b.dtype, parallel=self._config(b), compile=compiled,
                            quantize=self.quantize, fp8_attention=self.fp8_attention, cache=self._cache(b))

    def _cache(self, b: Bench):
        """The step cache of this contender's engine: --cache's (None: none)."""
        return cache_config(b.args)

    def check(self, b: Bench) -> str | None:
        try:
            self.info["parallel_config"] = to_jsonable(self._config(b))
        except Exception as exc:
            return f"ParallelConfig refuses this configuration: {error_text(exc)}"
        if self._cache(b) is not None and self.compile and (self.compile_mode or b.args.compile) == "graphs":
            return "a step cache does not run under CUDA graphs (a recorded forward cannot skip)"
        return fp8_refusal(b) if self.quantize == "fp8" else None

    def apply(self, b: Bench) -> None:
        self.engine = Engine(self._engine_config(b))
        stack = self.engine.apply(b.pipe, kind=b.spec.kind)
        calibration = stack.calibration
        self.info["calibration"] = None if calibration is None else {
            "source": getattr(calibration, "source", None),
            "machine_key": getattr(calibration, "machine_key", None),
            "params": to_jsonable(getattr(calibration, "params", None)),
        }
        if self.compile:
            self.info["compile_mode"] = stack.compiled.how
        if stack.fp8:
            self.info["fp8"] = [handle.describe() for handle in stack.fp8]

    def call(self, b: Bench, kwargs: dict):
        # as `serve` and `generate` run it (inference mode; a step cache's state its own, its counts recorded)
        with cache_request(b.pipe, steps=kwargs["num_inference_steps"]) as run:
            out = run_pipeline(b.pipe, **kwargs)
        if run.stats is not None:
            self.info["step_cache"] = run.stats  # the last call's: a timed one, at the benchmark's steps
        return out

    def restore(self, b: Bench) -> None:
        super().restore(b)
        engine, self.engine = self.engine, None
        if engine is None:
            return
        # The attention schedule per distinct layer shape, filled as the shapes were first seen.
        self.info["schedules"] = to_jsonable(engine.stack.schedule_choices)
        if engine.stack.masked_choices:  # world-1 calls with a key-padding mask: their kernel per query shape
            self.info["masked_attention"] = to_jsonable(engine.stack.masked_choices)
        engine.restore()


class XStageCFGBatch(XStage):
    """``xstage-calibrated`` with ``cfg_batch=True``: a step's two guidance calls as one forward on a batch of two
    (`patches.cfg_batch`). Pipelines CFG batching knows only. The xstage contenders follow ``--cfg-batch``, whose
    default ("auto") batches those pipelines too: ``--cfg-batch off`` makes ``xstage-calibrated`` the calls one by
    one, for a run that compares the two."""

    def __init__(self, compile: bool):
        super().__init__(compile, "auto")
        self.family = "xstage-cfgbatch"

    def _config(self, b: Bench) -> ParallelConfig:
        return dataclasses.replace(super()._config(b), cfg_batch=True)

    def check(self, b: Bench) -> str | None:
        from xstage_dit.features.cfg_batch import batching_pipelines

        if b.spec.pipeline_class not in batching_pipelines():
            return f"CFG batching does not know {b.spec.pipeline_class} (it knows {', '.join(batching_pipelines())})"
        return super().check(b)


class XStageServed(XStage):
    """The ``xstage-calibrated`` contender's pipeline (``parallelize`` with the configuration ``xstage-dit
    serve`` uses: schedule auto, calibrated: the measured attention kernel; compiled when
    asked) behind the HTTP server in this process: one ``POST /v1/images/generations`` per prompt, its PNG
    decoded. The difference to ``xstage-calibrated`` is what the server costs (queue, step callback, PNG,
    HTTP); ``info["served_timings"]`` splits it per call.

    serve: ``xstage_dit.server.inprocess.serve_pipeline`` (handed in by ``xstage-dit bench``: bench sits
    beside the server in the layer order and may not import it)."""

    def __init__(self, compile: bool, serve=None):
        super().__init__(compile, "auto")
        self.family = "xstage-served"
        self.serve = serve
        self._server = None
        self.client = None
        self.image_client = None
        self._encoded = None

    def check(self, b: Bench) -> str | None:
        if self.serve is None:
            return "needs the in-process server, which `xstage-dit bench` hands in (not python -m xstage_dit.bench.e2e)"
        if b.world_size > 1:
            return "the in-process server runs one rank; several ranks are served by `xstage-dit serve --sp N`"
        return super().check(b)

    def apply(self, b: Bench) -> None:
        import httpx

        from xstage_dit.bench.http_client import JsonClient

        super().apply(b)  # the engine's stack (the one the server's loader applies)
        self._server = self.serve(b.pipe, b.args.model, b.spec, batching="never", max_batch_size=1,
                                  warmup_sizes=((b.width, b.height),), max_steps=max(100, b.steps),
                                  max_size=max(2048, b.width, b.height),
                                  max_pixels=max(2048 * 2048, b.width * b.height),
                                  max_image_pixels=max([4096 * 4096] + [i.width * i.height for i in b.images]),
                                  request_timeout_s=3600.0, max_queue=4)
        url, _ = self._server.__enter__()
        self.client = httpx.Client(base_url=url, timeout=3600.0)  # videos: a job, its event stream, its content
        self.image_client = JsonClient(url, timeout_s=3600.0)  # images: the answer read as `requests` would

    def _body(self, b: Bench, kwargs: dict) -> dict:
        body = {"prompt": kwargs["prompt"], "size": f"{kwargs['width']}x{kwargs['height']}", "seed": b.args.seed,
                "num_inference_steps": kwargs["num_inference_steps"], "guidance_scale": kwargs["guidance_scale"]}
        if b.spec.kind == "video":
            body["num_frames"] = kwargs["num_frames"]
        if kwargs.get("negative_prompt"):
            body["negative_prompt"] = kwargs["negative_prompt"]
        return {**body, **self._inputs(b)}

    def _inputs(self, b: Bench) -> dict:
        """The run's input images as a JSON client sends them (base64 PNGs, encoded once): an edit's ``image`` (and
        ``mask``), a video's ``input_reference`` (a list of the first and last frame for first-last-frame models);
        {} for a text model."""
        if not b.images:
            return {}
        if self._encoded is None:
            import base64
            import io

            def b64(image) -> str:
                buf = io.BytesIO()
                image.save(buf, "PNG")
                return base64.b64encode(buf.getvalue()).decode()

            if b.spec.kind == "video":
                frames = [b64(i) for i in b.images]
                self._encoded = {"input_reference": frames[0] if len(frames) == 1 else frames}
            else:
                self._encoded = {"image": [b64(i) for i in b.images],
                                 **({"mask": b64(b.mask)} if b.mask is not None else {})}
        return self._encoded

    def call(self, b: Bench, kwargs: dict):
        """One request; timed until the client holds the encoded bytes (PNG or MP4). The pixels for the
        output comparison are decoded lazily, after the stopwatch (a client's display work is its own)."""
        t0 = time.perf_counter()
        if b.spec.kind == "video":
            data, timings = self._video(self._body(b, kwargs))
        else:
            # The binary answer: what a client that wants the image (not OpenAI's JSON) asks for.
            path = "/v1/images/edits" if b.images else "/v1/images/generations"  # an edit: its images (JSON)
            status, headers, data = self.image_client.post(path, {**self._body(b, kwargs), "response_format": "png"})
            if status != 200 or headers.get("content-type") != "image/png":
                raise RuntimeError(f"expected 200 image/png from the served request, got {status} "
                                   f"{headers.get('content-type')}: {data[:300]!r}")
            timings = json.loads(headers.get("x-timings") or "{}")
        # Where a served request's time goes (server: queue, pipeline call, encoding; then HTTP), one entry per
        # call: the overhead over the bare call, located.
        self.info.setdefault("served_timings", []).append({
            **{k: timings.get(k) for k in ("queued_s", "pipeline_s", "encode_s", "gc_s", "total_s")},
            "client_s": time.perf_counter() - t0, "bytes": len(data)})
        return _EncodedOutput(data, b.spec.kind)

    def _video(self, body: dict) -> tuple[bytes, dict]:
        r = self.client.post("/v1/videos", json=body)
        if r.status_code != 202:
            raise RuntimeError(f"expected 202 from POST /v1/videos, got {r.status_code}: {r.text[:300]}")
        job_id = r.json()["id"]
        # Wait on the job's event stream, as a client that wants the video does: the end arrives when it happens
        # (10 ms polls were up to 10 ms late and cost the server ~100 requests a second during the call).
        name, end = None, None
        with self.client.stream("GET", f"/v1/videos/{job_id}/events") as events:
            for line in events.iter_lines():
                if line.startswith("event:"):
                    name = line[len("event:"):].strip()
                elif line.startswith("data:") and name in ("completed", "error"):
                    end = (name, json.loads(line[len("data:"):]))
                    break
        if end is None or end[0] != "completed":
            raise RuntimeError(f"expected the video job to complete, got {end}")
        content = self.client.get(f"/v1/videos/{job_id}/content")
        if content.status_code != 200:
            raise RuntimeError(f"expected 200 from the video content, got {content.status_code}")
        return content.content, end[1].get("timings") or {}

    def restore(self, b: Bench) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.image_client is not None:
            self.image_client.close()
            self.image_client = None
        server, self._server = self._server, None
        if server is not None:
            server.__exit__(None, None, None)
        super().restore(b)


class _EncodedOutput:
    """A served answer: the encoded bytes, decoded to float pixels on first access of ``images`` / ``frames``
    (MP4 is lossy: a served video differs from the bare call's frames by the codec's error)."""

    def __init__(self, data: bytes, kind: str):
        self.data, self.kind, self._pixels = data, kind, None

    def _decode(self) -> np.ndarray:
        if self._pixels is None:
            if self.kind == "video":
                from xstage_dit.runtime.generation import read_mp4

                self._pixels = read_mp4(self.data).astype(np.float32)[None] / 255.0
            else:
                from PIL import Image

                image = Image.open(io.BytesIO(self.data)).convert("RGB")
                self._pixels = np.asarray(image, dtype=np.float32)[None] / 255.0
        return self._pixels

    @property
    def images(self):
        return None if self.kind == "video" else self._decode()

    @property
    def frames(self):
        return self._decode() if self.kind == "video" else None


class DiffusersCP(Contender):
    """diffusers' native context parallelism (Ulysses) through ``enable_parallelism``."""

    family = "diffusers-cp"
    irreversible = True
    compile_vae = False  # diffusers' own stack: its users compile the transformer alone

    def accepts(self, dirty: str | None) -> bool:
        return dirty in (None, self.family)  # the compiled variant reuses the eager variant's sharding

    def check(self, b: Bench) -> str | None:
        import diffusers

        transformer = b.pipe.transformer
        if torch.accelerator.device_count() == 0:
            # enable_parallelism places rank r on accelerator r % device_count (a ZeroDivisionError here).
            return f"diffusers {diffusers.__version__} context parallelism needs an accelerator, found none"
        if getattr(transformer, "_cp_plan", None) is None:
            return f"{type(transformer).__name__} ships no _cp_plan in diffusers {diffusers.__version__}"
        try:
            from diffusers import ContextParallelConfig

            ContextParallelConfig(ulysses_degree=b.world_size)
        except Exception as exc:
            return (f"diffusers {diffusers.__version__} ContextParallelConfig(ulysses_degree={b.world_size}) "
                    f"refuses: {error_text(exc)}")
        return None

    def apply(self, b: Bench) -> None:
        if b.dirty != self.family:
            from diffusers import ContextParallelConfig

            b.ensure_process_group()
            b.dirty = self.family  # from here on, even if enabling fails half-way
            b.pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=b.world_size))
        super().apply(b)
