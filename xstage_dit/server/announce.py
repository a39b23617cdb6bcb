"""What `xstage-dit serve` prints once every rank is ready: where to go, a curl line that works as
printed (with the Authorization header when the server needs a key; the key itself is never printed,
the line reads it from $XSTAGE_API_KEY), and, for a built-in model, that its weights are random and
how to use real ones."""

from __future__ import annotations

from xstage_dit.server.config import API_KEY_ENV, ServedModel


def curl_example(served: ServedModel, base: str, needs_key: bool) -> str:
    """A first request for `served` at `base`, ready to paste."""
    auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if needs_key else ""
    if served.kind == "image":
        return (f"curl -s {base}/v1/images/generations -H 'Content-Type: application/json'{auth} "
                f"-d '{{\"prompt\": \"a red fox in the snow\", \"size\": \"{served.default_width}x"
                f"{served.default_height}\", \"seed\": 1}}'")
    return (f"curl -s {base}/v1/videos -H 'Content-Type: application/json'{auth} "
            f"-d '{{\"prompt\": \"a cat walking on grass\", \"seed\": 1}}'")


def ready_lines(served: ServedModel, base: str, world_size: int, needs_key: bool) -> list[str]:
    """The start-up lines, in order: ready, the weights notice (random weights only), the curl line."""
    lines = [f"xstage-dit serve: {served.name} ready on {base} ({world_size} rank(s)); web page at {base}/ , "
             f"API docs at {base}/docs" + (f" (API key required: ${API_KEY_ENV})" if needs_key else "")]
    if served.weights_notice:
        lines.append(f"xstage-dit serve: note: {served.weights_notice}")
    lines.append(f"xstage-dit serve: try  {curl_example(served, base, needs_key)}")
    return lines
