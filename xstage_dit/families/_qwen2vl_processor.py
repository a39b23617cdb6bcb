"""`TextImageQwen2VLProcessor`: `Qwen2VLProcessor` without a video processor, the processor of the built-in
Qwen-Image-Edit pipelines (their Qwen2.5-VL text encoder reads the prompt and the input image). transformers' video
processors require torchvision, which this project does not install; these pipelines pass images only (calling it
with videos raises). Its attributes are the image processor and the tokenizer only, so ``save_pretrained`` writes it
and ``from_pretrained`` reads it back: a saved folder's model_index.json names this module and class.

Its own module, named with a leading underscore, because it imports transformers: the family registry imports
every other module of the package to find the records (`registry.records`), and the CLI's pre-checks read them in
about the time of ``--help``.
"""

from __future__ import annotations

# ProcessorMixin is imported by name: diffusers finds a component's loading method among the names of the module
# its model_index.json entry names (this one).
from transformers import ProcessorMixin, Qwen2VLProcessor  # noqa: F401

__all__ = ["TextImageQwen2VLProcessor"]


class TextImageQwen2VLProcessor(Qwen2VLProcessor):
    """A `Qwen2VLProcessor` of an image processor and a tokenizer (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                         chat_template=chat_template, **kwargs)
