"""JSON with multi-megabyte base64 strings in it, written once: the small fields are rendered around placeholder
strings (pydantic or json), then each blob's base64 goes straight into one output buffer in chunks (base64's
alphabet needs no JSON escaping).

Why: through ``JSONResponse`` an image answer's base64 was copied five times (encode, decode to str, the dump, its
encoding), each multi-megabyte copy mapped afresh by malloc, on the HTTP thread (the times and page faults of both
ways: benchmarks/results/serving/NOTES.md). The images endpoint answers and streams through `splice`.

    token = new_token()
    shell = json.dumps({"b64_json": placeholder(token, 0)}).encode()
    body = splice(shell, token, [png])     # == json.dumps({"b64_json": base64(png)}), as one buffer
"""

from __future__ import annotations

import binascii
import secrets

_B64_CHUNK = 3 * 16384  # bytes per base64 call (a multiple of 3: no padding inside): 64 KB out, a heap block


def new_token() -> str:
    """A random placeholder prefix that no field value of an answer can contain by chance."""
    return secrets.token_hex(8)


def placeholder(token: str, index: int) -> str:
    """The string value that stands for blob `index` in the shell."""
    return f"{token}-{index}"


def splice(shell: bytes, token: str, blobs: list[bytes]) -> memoryview:
    """`shell` (rendered JSON holding ``placeholder(token, i)`` as a string value, in order of i) with each
    placeholder replaced by blob i's base64, as one buffer."""
    pieces, rest = [], shell
    for i, blob in enumerate(blobs):
        before, rest = rest.split(f'"{placeholder(token, i)}"'.encode(), 1)
        pieces.append((before, blob))
    out = bytearray(sum(len(before) + 2 + 4 * -(-len(blob) // 3) for before, blob in pieces) + len(rest))
    at = 0
    for before, blob in pieces:
        for part in (before, b'"', *(binascii.b2a_base64(memoryview(blob)[i:i + _B64_CHUNK], newline=False)
                                      for i in range(0, len(blob), _B64_CHUNK)), b'"'):
            out[at:at + len(part)] = part
            at += len(part)
    out[at:] = rest
    return memoryview(out)
