"""Helpers of the server tests: a tiny real FluxPipeline, and a live uvicorn server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_flux(seed: int = 0):
    """The project's tiny-flux pipeline (random weights from the real diffusers classes) and its ServedModel."""
    from server.config import ServedModel

    try:
        from xstage_dit.models import load_pipeline, model_spec
    except ImportError:
        return _own_tiny_flux(seed), ServedModel("tiny-flux", "image", 2, 32, 32, 2, 3.5,
                                                 pipeline_kwargs={"max_sequence_length": 32})
    return load_pipeline("tiny-flux", dtype=torch.float32, device="cpu", seed=seed), ServedModel.from_spec(
        "tiny-flux", model_spec("tiny-flux"))


def _own_tiny_flux(seed: int):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    def tok(max_len):
        vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
        for i, w in enumerate("a the cat dog red blue photo of on in sofa grass".split()):
            vocab[w] = 3 + i
        t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                       model_max_length=max_len)

    torch.manual_seed(seed)
    te = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=4, projection_dim=32, max_position_embeddings=77,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=0))
    te2 = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4))
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                axes_dims_rope=[4, 4, 8])
    vae = AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=te, tokenizer=tok(77),
                        text_encoder_2=te2, tokenizer_2=tok(32), transformer=tr, vae=vae)


@contextlib.contextmanager
def live_server(app, port: int | None = None):
    """Run `app` under uvicorn on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
