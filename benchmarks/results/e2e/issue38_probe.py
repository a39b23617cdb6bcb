"""Issue 38 probe: the `xstage-calibrated` contender's setup on full NucleusMoE (bf16, 1024^2, 4 steps), in the
tree first on PYTHONPATH ("old" d384ddf: parallelize + batch_invariant_for; "new": Engine.apply). Prints and
writes (to argv[3]) the per-call median of wall timings of synchronized calls, the Python calls of one warm call (cProfile),
the CUDA kernels and runtime API calls of one warm call (torch.profiler) and the hooks/processors installed."""
import cProfile, collections, json, pstats, statistics, sys, time
import torch
tree, variant, out = sys.argv[1], sys.argv[2], sys.argv[3]
if tree == "old":
    from xstage_dit.models import load_pipeline, model_spec
    from xstage_dit.models.generation import fixed_kwargs, pipeline_kwargs, request_for, run_pipeline
    from xstage_dit import parallelize, ParallelConfig
    from xstage_dit.patches.batch_invariance import batch_invariant_for
else:
    from xstage_dit.families import load_pipeline, model_spec
    from xstage_dit.runtime.generation import fixed_kwargs, pipeline_kwargs, request_for, run_pipeline
    from xstage_dit.features.config import ParallelConfig
    from xstage_dit.engine import Engine, EngineConfig
    from xstage_dit.features.compile import CompileConfig
import os
model = os.environ.get("PROBE_MODEL", "full-nucleusmoe")
dev = os.environ.get("PROBE_DEVICE", "cuda")
size = int(os.environ.get("PROBE_SIZE", "1024"))
spec = model_spec(model)
t0 = time.perf_counter()
pipe = load_pipeline(model, dtype=torch.bfloat16, device=dev, seed=0)
pipe.set_progress_bar_config(disable=True)
load_s = time.perf_counter() - t0
cfg = ParallelConfig(sp=1, ep=1, cfg=1, cfg_batch=("auto" if variant != "cfgbatch-off" else False),
                     schedule="auto", calibrate=True)
if variant == "untouched":
    pass
elif tree == "old":
    handle = parallelize(pipe, cfg); inv = batch_invariant_for(pipe, spec.kind)
else:
    eng = Engine(EngineConfig(device=torch.device(dev), dtype=torch.bfloat16, parallel=cfg, compile=CompileConfig("off"),
                              host_syncs=(variant != "no-host-syncs")))
    eng.apply(pipe, kind=spec.kind)
req = request_for(spec, prompt="a red fox in the snow", height=size, width=size, steps=4, seed=1)
def kwargs():
    return pipeline_kwargs(pipe, [req], kind=spec.kind, fixed=fixed_kwargs(spec))
for _ in range(2):
    run_pipeline(pipe, **kwargs())
torch.cuda.synchronize() if dev == 'cuda' else None
times = []
for _ in range(8):
    kw = kwargs(); t = time.perf_counter(); run_pipeline(pipe, **kw); torch.cuda.synchronize() if dev == 'cuda' else None; times.append(time.perf_counter() - t)
pr = cProfile.Profile(); kw = kwargs(); pr.enable(); run_pipeline(pipe, **kw); pr.disable()
st = pstats.Stats(pr)
top = sorted(((v[1], f"{k[0].split('site-packages/')[-1]}:{k[1]}:{k[2]}") for k, v in st.stats.items()), reverse=True)[:40]
from torch.profiler import profile, ProfilerActivity
kw = kwargs()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    run_pipeline(pipe, **kw); torch.cuda.synchronize() if dev == 'cuda' else None if dev == 'cuda' else None
kern = collections.Counter(); api = collections.Counter()
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        kern[e.name[:90]] += 1
    elif e.name.startswith("cuda") or e.name.startswith("cu"):
        api[e.name] += 1
tr = pipe.transformer
hooks = collections.Counter()
for m in tr.modules():
    for d in ("_forward_hooks", "_forward_pre_hooks"):
        hooks[d] += len(getattr(m, d))
    if hasattr(m, "processor"):
        hooks["proc:" + type(m.processor).__name__] += 1
    if "forward" in m.__dict__:
        hooks["instance_forward:" + type(m).__name__] += 1
res = dict(tree=tree, variant=variant, load_s=load_s, times=times, median=statistics.median(times),
           py_calls=st.total_calls, top_py=top, kernels=sum(kern.values()), api=dict(api),
           kernel_top=kern.most_common(60), hooks=dict(hooks), gpu=torch.cuda.get_device_name() if dev == 'cuda' else 'cpu',
           torch=torch.__version__)
print(json.dumps({k: res[k] for k in ("tree", "variant", "median", "py_calls", "kernels", "api", "hooks")}))
print("times", [round(t, 4) for t in times])
json.dump(res, open(out, "w"), indent=1)
