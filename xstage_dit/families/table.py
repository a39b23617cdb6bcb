"""The README's model table, generated from the family records (one row per `FamilyRecord`).

    python scripts/model_table.py                     # print the table of this package's families
    python scripts/model_table.py --readme README.md  # rewrite the block between the README's markers

Columns: the family and its transformer classes; what ``xstage_dit.parallelize`` shards (sequence, experts,
CFG branches with their style); the diffusers pipeline classes ``xstage-dit generate`` / ``serve --model DIR``
load from a local folder (its ``model_index.json`` names one); the built-in random-weight models; the kinds of
input its pipelines take. tests/docs/test_readme.py fails when the README's block is not this table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from xstage_dit.families.record import FamilyRecord

BEGIN = "<!-- models:begin (generated from the family records: python scripts/model_table.py --readme README.md) -->"
END = "<!-- models:end -->"
HEADER = ("| family (transformer) | Python `parallelize` | CLI / server, local weights | built-in tiny / full "
          "| inputs |\n|---|---|---|---|---|")
# what each pipeline task takes and makes (record.TASKS)
TASK_LABELS = {"t2i": "text->image", "t2v": "text->video", "i2v": "image->video", "edit": "image edit",
               "i2i": "image->image", "inpaint": "inpainting"}

def _code(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) or "-"


def _parallel(record: FamilyRecord) -> str:
    """sp always; ep where the family has MoE layers to shard; cfg with its style where CFG parallel applies."""
    sp = record.sp
    parts = ["sp"]
    if record.experts is not None:
        parts.append("ep")
    if sp.cfg:
        parts.append(f"cfg ({sp.cfg})")
    return ", ".join(parts)


def _builtins(record: FamilyRecord) -> str:
    """Every built-in model of the record, tiny ones / full ones (a family may build several pipelines)."""
    return " / ".join(", ".join(f"`{s.name}`" for s in record.specs if s.size == size) or "-"
                      for size in ("tiny", "full"))


def _inputs(record: FamilyRecord) -> str:
    tasks = set(record.pipelines.values())
    # a text pipeline taking optional reference images (FLUX.2) edits images too
    tasks |= {"edit" for p in record.image_inputs if record.pipelines.get(p) == "t2i"}
    return ", ".join(label for task, label in TASK_LABELS.items() if task in tasks) or "-"


def row(record: FamilyRecord) -> str:
    """One Markdown table row: family (transformers) | parallelize | local-weights pipelines | built-ins | inputs."""
    if not isinstance(record, FamilyRecord):
        raise TypeError(f"expected a FamilyRecord, got {type(record).__name__}")
    cells = (f"{record.title} ({_code(record.transformers)})", _parallel(record), _code(record.served_pipelines),
             _builtins(record), _inputs(record))
    return "| " + " | ".join(cells) + " |"


def model_table_markdown(records: Iterable[FamilyRecord]) -> str:
    """The table of `records`: images first, then videos, each by title. Example::

        model_table_markdown(registry.records().values())
    """
    records = list(records)
    for record in records:
        if not isinstance(record, FamilyRecord):
            raise TypeError(f"expected FamilyRecord values, got {type(record).__name__}")
    ordered = sorted(records, key=lambda r: (r.kind != "image", r.title.lower()))
    return "\n".join([HEADER, *(row(r) for r in ordered)])


def rewrite_block(path: Path, block: str) -> bool:
    """Put `block` between `BEGIN` and `END` in the file at `path`; True when it changed. ValueError naming the
    file when a marker is missing."""
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"expected the markers {BEGIN!r} and {END!r} in {path}, got neither or one")
    head, rest = text.split(BEGIN, 1)
    new = f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text
