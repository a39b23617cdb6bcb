"""The family registry: every family record of the package (one file per family: ``families/<family>.py`` with
``RECORD = FamilyRecord(...)``), found by module, not listed; and what is derived from them: the built-in models
(`MODELS`: each record's ``tiny-*`` / ``full-*`` specs), the record of a pipeline class (a local folder's
model_index.json) or of a transformer (what `parallelize` and the features look facts up by).

    record_for_pipeline("FluxPipeline").name                 # "flux"
    record_for_transformer(pipe.transformer).sp.cfg          # "paired"
    video_vae_facts(pipe.vae)                                # the VAE's facts, or None
    image_inputs_for(pipe)                                   # how it takes input images, or None

Sub-module facts (rope modules, expert modules, causal convolutions, MoE layers) are also offered as the union
over the records (`rope_host_sync_classes`, ...): the features that patch them take a whole transformer or one
of its layers.

`NOT_SUPPORTED`: transformers with a diffusers pipeline that `parallelize` refuses, and why (shown under the
README's model table).
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
from pathlib import Path

from xstage_dit.families.record import FamilyRecord, ImageInputFacts, VideoVAEFacts
from xstage_dit.families.spec import ModelSpec

# Transformers with a diffusers pipeline that `parallelize` refuses, and why.
NOT_SUPPORTED = {
    "Cosmos3OmniTransformer": "Cosmos 3: a mixture-of-transformers model (separate experts per modality inside "
                              "each block, its context parallelism written inside the model), not a DiT plan",
}


@functools.cache
def records() -> dict[str, FamilyRecord]:
    """Every family record of this package, by family name, in module-name order: each module of
    `xstage_dit.families` that defines ``RECORD`` (found, not listed, so a new family is one new file)."""
    import xstage_dit.families as package

    found: dict[str, FamilyRecord] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        record = getattr(module, "RECORD", None)
        if not isinstance(record, FamilyRecord):
            continue
        if record.name in found:
            raise ValueError(f"expected one record per family, got two named {record.name!r}")
        found[record.name] = record
    return found


def record(family: str) -> FamilyRecord:
    """The record of `family`; ValueError naming the known families otherwise."""
    known = records()
    if family not in known:
        raise ValueError(f"expected a family in {sorted(known)}, got {family!r}")
    return known[family]


def record_for_pipeline(pipeline) -> FamilyRecord | None:
    """The record whose pipelines include `pipeline`: a class name (model_index.json's ``_class_name``: that
    name exactly), or a pipeline (its class or nearest diffusers base class, so a user's subclass resolves to its
    family); None if no record names it."""
    by_class = {name: r for r in records().values() for name in r.pipelines}
    if isinstance(pipeline, str):
        return by_class.get(pipeline)
    return _by_mro(pipeline, by_class)


def record_for_transformer(model) -> FamilyRecord | None:
    """The record of `model`'s transformer class or of its nearest diffusers base class (a user's subclass
    resolves to its family); None if no record names one. `model`: a module or a class."""
    return _by_mro(model, {name: r for r in records().values() for name in r.transformers})


def _by_mro(obj, by_class: dict[str, FamilyRecord]) -> FamilyRecord | None:
    cls = obj if isinstance(obj, type) else type(obj)
    for base in cls.__mro__:
        found = by_class.get(base.__name__)
        # the name must be the diffusers class itself, not an unrelated class of the same name
        if found is not None and base.__module__.startswith("diffusers."):
            return found
    return None


def image_inputs_for(pipeline) -> ImageInputFacts | None:
    """How `pipeline` (an instance, a class or a class name, as `record_for_pipeline`) takes conditioning images,
    from its family record (`FamilyRecord.image_inputs`); None when it takes none (or no record names it). For an
    instance, the counts of its own checkpoint (`ImageInputFacts.for_transformer` on its transformer's config)."""
    found = record_for_pipeline(pipeline)
    if found is None:
        return None
    if isinstance(pipeline, str):
        return found.image_inputs.get(pipeline)
    cls = pipeline if isinstance(pipeline, type) else type(pipeline)
    facts = next((found.image_inputs[b.__name__] for b in cls.__mro__ if b.__name__ in found.image_inputs
                  and b.__module__.startswith("diffusers.")), None)
    if facts is None or isinstance(pipeline, type) or not facts.per_checkpoint:
        return facts
    transformer = getattr(pipeline, "transformer", None) or getattr(pipeline, "transformer_2", None)
    return facts.for_transformer(dict(transformer.config))


def image_inputs_for_model(spec: ModelSpec) -> ImageInputFacts | None:
    """`image_inputs_for` the model of `spec` (a built-in or a local folder), resolved for its checkpoint
    (`ImageInputFacts.for_transformer` on its `transformer_config`) where they depend on it: what a request is
    checked with before any pipeline is built."""
    facts = image_inputs_for(spec.pipeline_class)
    if facts is None or not facts.per_checkpoint:
        return facts
    return facts.for_transformer(transformer_config(spec))


def transformer_config(spec: ModelSpec) -> dict:
    """The transformer config of a built-in model (its family record's dims) or of a local folder (its
    ``transformer/config.json``); ValueError naming the file when it cannot be read."""
    if spec.size == "local":
        path = Path(spec.name).expanduser() / "transformer" / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"expected a readable {path}, got {type(exc).__name__}: {exc}") from None
    return record(spec.family).dims(spec)


def video_vae_facts(vae) -> VideoVAEFacts | None:
    """The facts of `vae`'s class (a module or a class name) from the family records that use it, or None."""
    name = vae if isinstance(vae, str) else type(vae).__name__
    return next((f for f in _video_vaes() if f.vae_class == name), None)


def causal_conv_classes() -> tuple[str, ...]:
    """The zero-padded causal 3-D convolution classes of the records' video VAEs (`VideoVAEFacts`)."""
    return tuple(sorted({f.causal_conv_class for f in _video_vaes()}))


def _video_vaes() -> list[VideoVAEFacts]:
    return [r.facts.video_vae for r in records().values() if r.facts.video_vae is not None]


# Classes of sub-modules a feature patches wherever they sit (a whole transformer, or one layer of it in a
# test or a benchmark): the union over the records, each named by the family whose transformer has them.

def rope_host_sync_classes() -> tuple[str, ...]:
    """Rope modules whose per-forward host copies `host_syncs` removes (`FeatureFacts.rope_host_sync_classes`)."""
    return tuple(sorted({c for r in records().values() for c in r.facts.rope_host_sync_classes}))


def grouped_mm_expert_classes() -> tuple[str, ...]:
    """Expert modules that take `compile_fixes`' grouped_mm offsets (`FeatureFacts.grouped_mm_expert_classes`)."""
    return tuple(sorted({c for r in records().values() for c in r.facts.grouped_mm_expert_classes}))


def moe_layer_classes() -> tuple[str, ...]:
    """The diffusers MoE layer classes of the MoE families (`ExpertFacts.layer_class`)."""
    return tuple(sorted({r.experts.layer_class for r in records().values() if r.experts is not None}))


def supported_pipelines() -> dict[str, str]:
    """Pipeline class -> family, for every pipeline `generate` and `serve` run from a local folder."""
    return {p: r.name for r in records().values() for p in r.served_pipelines}


def _models() -> dict[str, ModelSpec]:
    models: dict[str, ModelSpec] = {}
    for r in records().values():
        for spec in r.specs:
            if spec.name in models:
                raise ValueError(f"expected one built-in model named {spec.name!r}, got it in {models[spec.name].family!r} "
                                 f"and {r.name!r}")
            models[spec.name] = spec
    return models


#: every built-in model, by name: the family records' specs (tiny-*: CPU seconds; full-*: published dimensions)
MODELS: dict[str, ModelSpec] = _models()
