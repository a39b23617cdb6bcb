"""Tokenizers built in code (no download) for the offline pipelines.

Each builder returns the real transformers tokenizer class the pipeline expects, over a small built-in
vocabulary: characters, their word-start forms and a list of common English words. Token ids always stay
below the text encoder's ``vocab_size`` (callers check this with :func:`max_token_id`).

How text outside the vocabulary is handled (non-ASCII prompts must work):

- CLIP and Qwen (byte-level BPE): every byte has a token, so any UTF-8 text encodes losslessly.
- Llama and Gemma (BPE with byte fallback): unknown characters become ``<0xNN>`` byte tokens.
- T5 / UMT5 (Unigram, as the real ones): unknown characters become ``<unk>``.

`quiet_prompt_truncation(pipe)` keeps a long or non-Latin prompt from filling the log: diffusers prints
the whole cut-off text (runs of ``<unk>`` for what a tokenizer lacks) on every call, and transformers
warns about an over-long sequence the pipeline only encodes to report what it cut.
"""

from __future__ import annotations

import logging
import re
import string
from functools import cache

# Common words of image/video prompts: they become single tokens, so prompts are not character soup.
WORDS = tuple(
    """a an the of and in on at with to for from by as is are be this that it its or not no
    photo photograph picture image painting drawing illustration render portrait landscape video scene shot
    close up wide view style art digital oil watercolor sketch cinematic realistic detailed high quality
    light dark bright soft warm cold sun sunset sunrise night day sky cloud clouds rain snow fog water sea
    ocean lake river beach mountain mountains forest tree trees flower flowers garden field grass road street
    city town house building room window door table chair bed car boat ship train plane bird birds cat cats
    dog dogs horse fish animal man woman person people child girl boy face eyes hair hand hands smile
    red orange yellow green blue purple pink brown black white gray grey gold silver color colors colorful
    big small large little tall old new young beautiful cute happy sad calm running walking flying sitting
    standing over under between near behind front left right top bottom center background foreground""".split()
)

_SPECIAL_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map, used by byte-level BPE (CLIP, Qwen)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _add(vocab: dict[str, int], token: str) -> None:
    if token not in vocab:
        vocab[token] = len(vocab)


def _word_merges(symbols: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], seen: set) -> None:
    """Left-to-right merges that fuse `symbols` into one token (valid BPE: each merge's parts exist)."""
    acc = symbols[0]
    for sym in symbols[1:]:
        pair = (acc, sym)
        acc = acc + sym
        if pair not in seen:
            seen.add(pair)
            merges.append(pair)
        _add(vocab, acc)


def clip_tokenizer(model_max_length: int = 77):
    """`CLIPTokenizer` (byte-level BPE with ``</w>`` word ends), bos/eos/pad as in CLIP."""
    from transformers import CLIPTokenizer

    byte_chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for special in ("<|startoftext|>", "<|endoftext|>"):
        _add(vocab, special)
    for ch in byte_chars:
        _add(vocab, ch)
    for ch in byte_chars:
        _add(vocab, ch + "</w>")
    merges: list[tuple[str, str]] = []
    seen: set = set()
    for word in WORDS:  # CLIP lowercases, so lowercase words suffice
        _word_merges([*word[:-1], word[-1] + "</w>"], vocab, merges, seen)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def qwen_tokenizer(model_max_length: int = 4096, extra_special_tokens: tuple[str, ...] = ()):
    """`Qwen2Tokenizer` (byte-level BPE, GPT-2 style spaces as ``Ġ``) with Qwen's chat special tokens."""
    from transformers import Qwen2Tokenizer

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for ch in b2u.values():
        _add(vocab, ch)
    merges: list[tuple[str, str]] = []
    seen: set = set()
    space = b2u[ord(" ")]
    # Word-start forms first: BPE applies merges by rank, so " photo" must not be split as " " + "photo".
    for word in WORDS:
        _word_merges([space, *word], vocab, merges, seen)
    for word in WORDS:
        _word_merges(list(word), vocab, merges, seen)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special_tokens]
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in tok.get_vocab()]})
    return tok


def _unigram_pieces() -> list[tuple[str, float]]:
    """SentencePiece-style pieces (``▁`` marks a word start). Equal scores: fewest pieces wins."""
    pieces: list[str] = ["▁"]
    for ch in _SPECIAL_CHARS:
        pieces += [ch, "▁" + ch]
    for word in WORDS:
        pieces += ["▁" + word, word, "▁" + word.capitalize()]
    out, seen = [], set()
    for p in pieces:
        if p not in seen:
            seen.add(p)
            out.append((p, -1.0))
    return out


def t5_tokenizer(model_max_length: int = 512):
    """`T5TokenizerFast` (Unigram; ``<pad>``=0, ``</s>``=1, ``<unk>``=2 as in T5/UMT5)."""
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *_unigram_pieces()]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def _byte_fallback_bpe(specials: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """SentencePiece-style BPE vocabulary with byte fallback (Llama, Gemma): `specials` first (their ids
    in order), the 256 ``<0xNN>`` byte tokens, characters, ``▁`` word starts and the common words."""
    vocab: dict[str, int] = {}
    for special in specials:
        _add(vocab, special)
    for b in range(256):
        _add(vocab, f"<0x{b:02X}>")
    for ch in _SPECIAL_CHARS + " ":
        _add(vocab, ch)
    _add(vocab, "▁")
    merges: list[tuple[str, str]] = []
    seen: set = set()
    for ch in _SPECIAL_CHARS:
        _word_merges(["▁", ch], vocab, merges, seen)
    for word in WORDS:
        _word_merges(["▁" + word[0], *word[1:]], vocab, merges, seen)
    for word in WORDS:
        _word_merges(list(word), vocab, merges, seen)
    return vocab, merges


#: LLaVA-Llama-3's chat header tokens and image placeholder (HunyuanVideo I2V's prompt template reads them)
LLAVA_SPECIAL_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<image>")


def llama_tokenizer(model_max_length: int = 8192, *, llava: bool = False):
    """`LlamaTokenizerFast`-style BPE with byte fallback, bos/eos as in Llama 3 instruct and a pad token.

    llava: as llava-llama-3's tokenizer that HunyuanVideo I2V ships: `LLAVA_SPECIAL_TOKENS` are single tokens,
    "assistant" one word (the pipeline crops the 4 tokens ``<|eot_id|><|start_header_id|>assistant<|end_header_id|>``)
    and padding on the right (the pipeline crops its template from the front of every row)."""
    from transformers import LlamaTokenizer

    vocab, merges = _byte_fallback_bpe(("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    tok = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        model_max_length=model_max_length,
    )
    # registered as a special (added) token, as Llama 3's own: the text "<|eot_id|>" is then one token, here and
    # after save_pretrained / from_pretrained (a plain `pad_token =` kept it a string the BPE split until a reload)
    tok.add_special_tokens({"pad_token": "<|eot_id|>"})
    if llava:
        tok.add_special_tokens({"additional_special_tokens": list(LLAVA_SPECIAL_TOKENS)})
        tok.add_tokens(["assistant"])
        tok.padding_side = "right"
    return tok


def gemma_tokenizer(model_max_length: int = 1024):
    """`GemmaTokenizer` (BPE with byte fallback; ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3 as in Gemma)."""
    from transformers import GemmaTokenizer

    vocab, merges = _byte_fallback_bpe(("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"))
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def max_token_id(tokenizer) -> int:
    """Largest id the tokenizer can emit (added tokens included)."""
    return max(tokenizer.get_vocab().values())



def template_prefix_tokens(tokenizer, template: str) -> int:
    """How many tokens `tokenizer` makes of `template` before its ``{}`` (where the prompt goes): the count a
    pipeline crops off its prompt template, whose literal (HunyuanImage's 34, HunyuanVideo 1.5's 108) counts
    the real tokenizer's tokens, not the in-code one's. ValueError if `template` has no ``{}``."""
    prefix, marker, _ = template.partition("{}")
    if not marker:
        raise ValueError(f"expected a prompt template with a '{{}}' where the prompt goes, got {template!r}")
    return len(tokenizer(prefix).input_ids)

# diffusers' pipelines: "... truncated because CLIP can only handle sequences up to 77 tokens: [<text>]"
# and "... because `max_sequence_length` is set to  512 tokens: [<text>]".
_TRUNCATED = re.compile(r"The following part of your input was truncated because (?P<why>.*?)"
                        r"(?:handle sequences up to|is set to)\s+(?P<tokens>\d+) tokens")
# transformers, on the untruncated encoding that diffusers makes only to find the cut-off text.
_TOO_LONG = "Token indices sequence length is longer than the specified maximum sequence length"
_TOKENIZER_LOGGER = "transformers.tokenization_utils_base"


class PromptTruncationFilter(logging.Filter):
    """One short line per cut instead of the cut-off text; drops the over-long-sequence warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_TOO_LONG):
            return False
        match = _TRUNCATED.match(message)
        if match:
            encoder = "CLIP" if "CLIP" in match["why"] else "max_sequence_length"
            record.msg, record.args = f"prompt truncated to its first {match['tokens']} tokens ({encoder})", ()
        return True


def quiet_prompt_truncation(pipe) -> None:
    """Installs `PromptTruncationFilter` on `pipe`'s pipeline module logger and on transformers'
    tokenizer logger (once each; the truncation itself is unchanged)."""
    for name in (type(pipe).__module__, _TOKENIZER_LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(f, PromptTruncationFilter) for f in logger.filters):
            logger.addFilter(PromptTruncationFilter())
