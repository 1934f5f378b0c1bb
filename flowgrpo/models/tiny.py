"""A tiny random FLUX-architecture pipeline, built offline and saved in the diffusers folder format.

It exercises exactly the code path a real FLUX.1 folder takes (``FluxPipeline.from_pretrained``): the same
transformer, VAE, CLIP and T5 classes, only with a few thousand-fold fewer parameters. The CLIP tokenizer is the
real 49,408-token BPE (its vocabulary ships inside open-clip-torch); the T5 tokenizer is a small unigram model
built in memory (characters plus the words of the given prompts), since no package ships T5's sentencepiece file.

    python -m flowgrpo.models.tiny OUT_DIR
"""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import string
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from flowgrpo.argtypes import OneLineParser
from flowgrpo.writing.outputs import claim_for_command

logger = logging.getLogger(__name__)

TEXT_DIM = 32  # hidden size of both tiny text encoders (= the transformer's joint_attention_dim)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable-unicode table (Radford et al. 2019, the CLIP BPE tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def build_clip_tokenizer(model_max_length: int = 77):
    """The real CLIP BPE tokenizer (49,408 tokens) from the vocabulary file that open-clip-torch ships."""
    import open_clip
    from transformers import CLIPTokenizer

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    units = list(_bytes_to_unicode().values())
    tokens = units + [u + "</w>" for u in units] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def build_t5_tokenizer(words: Iterable[str] = (), model_max_length: int = 32):
    """A small T5 (unigram) tokenizer: every printable character, plus ``▁word`` pieces for ``words``."""
    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [(c, -5.0) for c in chars]
    seen = {p for p, _ in vocab}
    for w in sorted({w.lower() for w in words}):
        if "▁" + w not in seen:
            vocab.append(("▁" + w, -1.0))
            seen.add("▁" + w)
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def build_text_encoders(words: Iterable[str] = (), t5_max_length: int = 32, seed: int = 0, *,
                        clip_width: int = TEXT_DIM, t5_width: int = TEXT_DIM):
    """(clip_tokenizer, clip_text_model, t5_tokenizer, t5_encoder): 1-layer random encoders whose outputs are
    ``clip_width`` and ``t5_width`` wide (32 here; FLUX.1's real encoders give 768 and 4096)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tok = build_clip_tokenizer()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=clip_width, intermediate_size=2 * clip_width, num_hidden_layers=1,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=clip_width,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )
    t5_tok = build_t5_tokenizer(words, model_max_length=t5_max_length)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok), d_model=t5_width, d_kv=8, d_ff=2 * t5_width, num_layers=1, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
    )
    return clip_tok, clip.eval(), t5_tok, t5.eval()


def build_tiny_vae(sample_size: int, *, scaling_factor: float = 0.3611, shift_factor: float = 0.1159):
    """The tiny 16-channel ``AutoencoderKL`` (4 blocks of width 8, downsampling 8×) of the tiny FLUX, SD3 and
    Z-Image pipelines, with random weights from torch's global generator (seed it first); ``scaling_factor`` and
    ``shift_factor`` default to FLUX.1's (SD3.5 uses 1.5305 and 0.0609)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, sample_size=sample_size,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )


def build_tiny_flux(out_dir: str | os.PathLike, *, words: Iterable[str] = (), sample_size: int = 64,
                    seed: int = 0, transformer_kwargs: dict | None = None) -> Path:
    """Build a random tiny FLUX pipeline and ``save_pretrained`` it into ``out_dir``; return the folder.

    The image is ``sample_size`` pixels square; the VAE downsamples 8× to 16 latent channels, which pack into
    (sample_size/16)² tokens of 64 channels, as in FLUX.1. ``transformer_kwargs`` override the transformer's
    constructor arguments (e.g. FLUX.1's ``num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, axes_dims_rope=(16, 56, 56)`` for a real-size random transformer).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_tok, clip, t5_tok, t5 = build_text_encoders(words, seed=seed)
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        **{"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
           "num_attention_heads": 2, "joint_attention_dim": TEXT_DIM, "pooled_projection_dim": TEXT_DIM,
           "guidance_embeds": True, "axes_dims_rope": (4, 6, 6), **(transformer_kwargs or {})},
    )
    vae = build_tiny_vae(sample_size)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
        tokenizer_2=t5_tok, transformer=transformer,
    )
    out = Path(out_dir)
    pipe.save_pretrained(out)
    return out


def build_tiny_qwen3vl(tok, *, num_layers: int, seed: int):
    """(processor, encoder) of a toy Qwen3-VL text encoder around the tokenizer ``tok`` (its chat template is the
    processor's): a ``Qwen3VLProcessor`` and a random ``Qwen3VLForConditionalGeneration`` of width 16 (2 heads of 8,
    ``num_layers`` text layers, a 1-block vision tower; seeded with ``seed``), in eval mode."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=Qwen3VLVideoProcessor(),
                                 tokenizer=tok, chat_template=tok.chat_template)
    vision = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    torch.manual_seed(seed)
    encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": num_layers,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tok),
                     "max_position_embeddings": 512,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "deepstack_visual_indexes": []},
        vision_start_token_id=vision[0], vision_end_token_id=vision[1], image_token_id=vision[2],
    )).eval()
    return processor, encoder


def builder_main(build, what: str, doc: str, argv: list[str] | None = None, *, variants: Sequence[str] = ()) -> None:
    """The command line of a tiny-model builder: ``OUT_DIR [--prompts FILE] [--seed N]``, and ``[--variant V]``
    when ``variants`` are given (the first is the default); ``build(out_dir, words=..., seed=...)`` (with
    ``variant=...`` too when ``variants`` are given) writes the pipeline, logged as "tiny ``what`` pipeline"."""
    parser = OneLineParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--prompts", help="a prompt file whose words become single pieces of the tiny tokenizers")
    parser.add_argument("--seed", type=int, default=0)
    if variants:
        parser.add_argument("--variant", default=variants[0], choices=list(variants))
    args = parser.parse_args(argv)
    claim_for_command(parser, args.out_dir, "model", inputs=[args.prompts])  # flowgrpo's write rule
    words = Path(args.prompts).read_text().split() if args.prompts else ()
    logging.basicConfig(level=logging.INFO)
    chosen = {"variant": args.variant} if variants else {}
    logger.info("tiny %s pipeline saved to %s", what, build(args.out_dir, words=words, seed=args.seed, **chosen))


def main(argv: list[str] | None = None) -> None:
    builder_main(build_tiny_flux, "FLUX", __doc__, argv)


if __name__ == "__main__":
    main()
