"""The released model families' size tables, for the memory plan (:mod:`flowgrpo.memory_plan.estimate`): what the
plan's arithmetic multiplies, and where each figure comes from.

Every released model is built on the meta device from its diffusers configuration (transformers, VAEs) or from
its text encoder's architecture (T5-XXL, UMT5-XXL, CLIP-L, OpenCLIP bigG; for LTX-2 and HunyuanVideo-1.5 also
Gemma 3 12B, Qwen2.5-VL-7B's language model, ByT5-small and SigLIP so400m); the other decoder LLMs that serve as
text encoders (Qwen2.5-VL-7B, Mistral-Small-3.1-24B, Qwen3-4B) and the reward models that are not CLIPs enter by
their published parameter counts. LoRA adapters are added to the meta transformer with the config's rank and targets,
so their size is counted (:func:`sizes`).

Owns: the meta-device builders, the published counts, :class:`Family` and :class:`BlockKind` (one row per
released model, :data:`FAMILIES`), the config id → family map (:data:`PRETRAINED`), the reward models
(:data:`REWARD_MODELS`), the parameter counts (:class:`Sizes`, :func:`sizes`, :func:`parameter_count`), and the
activation coefficients (:data:`COEFFICIENTS`) with the code that counts them from the saved tensors of the real
block classes (:func:`saved_bytes`, :func:`count_saved_bytes`, :func:`derive_coefficients`, :func:`lora_kinds`;
``tests/test_plan.py`` recounts them). Nothing here knows a config, a GPU count or a layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------------------------
# The released models, built on the meta device
# ---------------------------------------------------------------------------------------------------------------

def _flux1(**over):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**{"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                                     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                                     "pooled_projection_dim": 768, "guidance_embeds": True,
                                     "axes_dims_rope": (16, 56, 56), **over})


def _sd35_medium(**over):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**{"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
                                    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                                    "caption_projection_dim": 1536, "pooled_projection_dim": 2048,
                                    "out_channels": 16, "pos_embed_max_size": 384,
                                    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm", **over})


def _qwen_image(**over):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(**{"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                                          "attention_head_dim": 128, "num_attention_heads": 24,
                                          "joint_attention_dim": 3584, "guidance_embeds": False,
                                          "axes_dims_rope": (16, 56, 56), **over})


#: Wan transformers: Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B and each expert of Wan2.2-T2V-A14B (= Wan2.1-14B's body),
#: their diffusers transformer configs
WAN = {"wan21_1.3b": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30, "in_channels": 16,
                      "out_channels": 16},
       "wan22_5b": {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
                    "out_channels": 48},
       "wan_14b": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 16,
                   "out_channels": 16}}


def _wan(size: str, **over):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**{"patch_size": (1, 2, 2), "attention_head_dim": 128, "text_dim": 4096,
                                    "freq_dim": 256, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                                    "eps": 1e-6, "rope_max_seq_len": 1024, **WAN[size], **over})


def _ltx2(**over):
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(**over)  # its defaults are LTX-2's (18.9 B: "19B"; diffusers 0.42.1)


def _ltx2_vaes():
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    # the video VAE, the audio VAE and the vocoder the pipeline holds (their class defaults: LTX-2's)
    return torch.nn.ModuleList([AutoencoderKLLTX2Video(), AutoencoderKLLTX2Audio(), LTX2Vocoder()])


def _ltx2_connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors()  # its defaults are LTX-2's (Gemma 3's 49 stacked hidden states of 3840)


def _gemma3_12b():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    # google/gemma-3-12b-it (LTX-2's text_encoder, vision tower included), its config.json
    return Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=Gemma3TextConfig(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208),
        vision_config=SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                         num_attention_heads=16, image_size=896, patch_size=14),
        mm_tokens_per_image=256))


def _hunyuan_video15(**over):
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(**over)  # its defaults are HunyuanVideo-1.5's (8.3 B)


def _hunyuan_vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15()  # its defaults are HunyuanVideo-1.5's (32 channels, 16x, 4x temporal)


def _qwen25_vl_7b_text():
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    # Qwen2.5-VL-7B-Instruct's language model (HunyuanVideo-1.5's text_encoder: the text model alone), its config
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                                    num_attention_heads=28, num_key_value_heads=4,
                                                    vocab_size=152064))


def _byt5_small():
    from transformers import T5Config, T5EncoderModel

    # google/byt5-small's encoder (HunyuanVideo-1.5's glyph encoder, text_encoder_2; width 1472 = text_embed_2_dim)
    return T5EncoderModel(T5Config(d_model=1472, d_ff=3584, num_layers=12, num_heads=6, d_kv=64, vocab_size=384,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def _siglip_so400m():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    # google/siglip-so400m-patch14-384's vision tower (HunyuanVideo-1.5 I2V's image_encoder: 729 tokens of 1152)
    return SiglipVisionModel(SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                                num_attention_heads=16, image_size=384, patch_size=14))


def _clip_vit_h14_vision():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    # open-clip xlm-roberta-large-vit-huge-14's vision tower: Wan2.1 I2V's image encoder (257 tokens of 1280)
    return CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                            num_attention_heads=16, image_size=224, patch_size=14))


def _flux2_dev(**over):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**over)  # its constructor's defaults are FLUX.2 [dev]'s (8 + 48 blocks, 48 heads)


#: FLUX.2 [klein] transformers: the FLUX.2 blocks at another depth and width, Qwen3's 3 stacked hidden states as
#: the text context, no guidance embedding. From VincentGourbin/flux-2-swift-mlx
#: Sources/Flux2Core/Configuration/Flux2Config.swift (commit 15dbdd5; no diffusers config.json was at hand): 9B
#: 8 double + 24 single blocks, 32 heads of 128, context 3 x 4096 (Qwen3-8B); 4B 5 + 20, 24 heads, 3 x 2560
#: (Qwen3-4B). Built here they count 9.08 B and 3.88 B parameters, the releases' "9B" and "4B".
KLEIN = {"9b": {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "joint_attention_dim": 12288},
         "4b": {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "joint_attention_dim": 7680}}


def _flux2_klein(size: str, **over):
    return _flux2_dev(**{**KLEIN[size], "attention_head_dim": 128, "guidance_embeds": False, **over})


def _flux3(**over):
    from diffusers import Flux3Transformer2DModel

    # its constructor's defaults (diffusers 0.42.1): 5 per-mode blocks for each of the image, reference-image and
    # text modes, 28 joint single blocks, 24 heads of 128, Qwen3-VL context 8 x 2560 (no public config.json found)
    return Flux3Transformer2DModel(**over)


def _qwen_image21(**over):
    from diffusers import QwenImage21Transformer2DModel

    # its constructor's defaults (diffusers 0.42.1): 32 single-stream blocks, 32 heads of 128, Qwen3-VL context 4096
    return QwenImage21Transformer2DModel(**over)


def _zimage(**over):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel(**{"axes_lens": [1536, 512, 512], **over})  # the defaults are Z-Image's


def _kl_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                         up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                         layers_per_block=2, latent_channels=16, use_quant_conv=False,
                         use_post_quant_conv=False)  # FLUX.1's and SD3.5's vae/config.json: no quant convs


def _qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage()  # its defaults are Qwen-Image's VAE (base_dim 96, z_dim 16)


def _qwen21_vae():
    from diffusers import AutoencoderKLQwenImage21

    return AutoencoderKLQwenImage21()  # its defaults are Qwen-Image 2.1's VAE (z_dim 64, 16x, RGBA)


def _wan21_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan()  # its defaults are Wan2.1's VAE (base_dim 96, z_dim 16)


def _wan22_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
                            out_channels=12, patch_size=2, scale_factor_spatial=16,
                            latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def _flux2_vae():
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2()  # its defaults are FLUX.2's VAE (32 latent channels)


def _t5_xxl():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, vocab_size=32128,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def _umt5_xxl():
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
                                       vocab_size=256384, feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def _clip(hidden: int, layers: int, heads: int, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, projection_dim=hidden)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def _open_clip(name: str):
    import logging

    import open_clip

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # open_clip reports every step of building a model on the root logger
    try:
        return open_clip.create_model(name, pretrained=None, device="meta")
    finally:
        root.setLevel(level)


#: published parameter counts (model cards) of the decoder LLMs used as text encoders and of non-CLIP rewards
QWEN25_VL_7B = 8.29e9  # Qwen2.5-VL-7B-Instruct: Qwen-Image's text encoder
QWEN2_VL_7B = 8.29e9  # Qwen2-VL-7B-Instruct: HPSv3's body
MISTRAL_SMALL_31 = 24.0e9  # Mistral-Small-3.1-24B: FLUX.2 [dev]'s text encoder
QWEN3_4B = 4.02e9  # Qwen3-4B: Z-Image's and FLUX.2 [klein] 4B's text encoder
QWEN3_8B = 8.19e9  # Qwen3-8B (its model card: 8.2 B): FLUX.2 [klein] 9B's text encoder
QWEN3_VL_4B = 4.44e9  # Qwen3-VL-4B-Instruct: FLUX.3's text encoder (hidden 2560: its 8 stacked layers, 20480)
QWEN3_VL_8B = 8.77e9  # Qwen3-VL-8B-Instruct: Qwen-Image 2.1's text encoder (hidden 4096, its context width)


@dataclass(frozen=True)
class BlockKind:
    """One kind of transformer block: how many the model has and the bytes autograd keeps per row of one call,
    ``(image · s_img + text · s_txt) · h`` (s_img, s_txt: image and text tokens, h: the model's width)."""

    name: str
    count: int
    image: float
    text: float


@dataclass(frozen=True)
class Family:
    """A released model: its transformer, text encoders and VAE (builders run on the meta device), its width, how
    many tokens an image (or video) and a prompt make, its latent size, its block kinds and its guidance.

    ``tokens(height, width, frames)`` → image tokens of one sample; ``latent(height, width, frames)`` → latent
    elements of one sample; ``text_tokens(max_sequence_length)`` → text tokens; ``true_cfg``: the velocity runs
    an unconditional branch too when the guidance scale is above 1; ``experts``: transformers of the release (2:
    Wan2.2 A14B, one trained, one frozen); ``decode_width``: channels of the VAE decoder's full-resolution stage;
    ``decode_frames``: frames one decode step holds (Wan's VAEs decode a latent frame at a time; Wan2.2's
    decoder ends at half resolution with 256 channels before its 2×2 unpatchify, so 64 per full-resolution
    pixel); ``joint_text``: the text joins every block's attention as a stream (HunyuanVideo-1.5) rather than
    by cross-attention (Wan, LTX-2); ``guided_rows``: the rows one sample's guided velocity runs with gradient
    whatever the scale (LTX-2's fixed stack: the CFG pair, STG and modality isolation), 0 for the rule of
    ``true_cfg``."""

    name: str
    transformer: Callable
    encoders: tuple[Callable | float, ...]
    vae: Callable
    width: int
    tokens: Callable[[int, int, int], int]
    latent: Callable[[int, int, int], int]
    text_tokens: Callable[[int], int]
    kinds: tuple[BlockKind, ...]
    true_cfg: bool = False
    experts: int = 1
    decode_width: int = 128
    decode_frames: int = 1
    video: bool = False
    narrow: str = ""  # the key of COEFFICIENTS and of the narrow model its blocks are counted on
    joint_text: bool = False  # a video family whose text is a token stream of every block (an MMDiT), not keys
    guided_rows: int = 0  # rows of one sample's velocity whatever the guidance scale (LTX-2: 4); 0: true_cfg's rule


def _image_tokens(h: int, w: int, f: int) -> int:
    return (h // 16) * (w // 16)


def _image_latent(channels: int):
    return lambda h, w, f: channels * (h // 8) * (w // 8)


def _wan_frames(f: int) -> int:
    return (f - 1) // 4 + 1


def _ltx2_frames(f: int) -> int:
    return (f - 1) // 8 + 1


#: ``decode_frames`` of a VAE that decodes the whole video in one call (LTX-2, HunyuanVideo-1.5 without tiling)
ALL_FRAMES = 1 << 30


def _hunyuan_kinds() -> tuple[BlockKind, ...]:
    c = COEFFICIENTS["hunyuan_video15"]
    return (BlockKind("patch_embed", 1, *c["patch_embed"]), BlockKind("refiner", 1, *c["refiner"]),
            BlockKind("block", 54, *c["block"]))


#: Counted bytes per (row, token, width) that autograd keeps for one block, bf16, per block kind: ``image`` per
#: image token, ``text`` per text token. Counted by :func:`count_saved_bytes` on the real block classes at a
#: narrow width (2 heads of the real head width; the MLP at the real ratio; ``tests/test_plan.py`` recounts them);
#: the per-token terms scale with the width at a fixed head width, so they hold at the released width.
COEFFICIENTS: dict[str, dict[str, tuple[float, float]]] = {
    "flux": {"double": (56.2, 56.1), "single": (50.1, 50.1)},
    "flux2": {"double": (64.1, 64.1), "single": (62.1, 62.1)},
    "sd3": {"dual": (86.5, 58.3), "joint": (58.3, 58.3), "last": (58.3, 32.2)},  # 64-wide heads: more per h
    "qwenimage": {"block": (56.2, 56.1)},
    # Wan: text enters by cross-attention only (its keys and values); float32 norms (kept so in the release)
    "wan21_1.3b": {"block": (91.6, 12.0)},
    "wan22_5b": {"block": (86.9, 12.0)},
    "wan_14b": {"block": (79.0, 12.0)},
    "zimage": {"noise_refiner": (91.5, 0.0), "context_refiner": (0.0, 83.5), "block": (89.5, 89.5)},
    # FLUX.3: per-mode blocks see their own mode's tokens (the reference-image blocks none in text to image)
    "flux3": {"image_mode": (68.11, 0.0), "cond_mode": (0.0, 0.0), "text_mode": (0.0, 68.11), "single": (58.11, 58.11)},
    "qwenimage21": {"block": (73.12, 80.12)},  # block-causal: the text prefix is attended in its own pass
    # LTX-2: video ‖ audio blocks, text by cross-attention (two streams); the audio's fixed 16 tokens folded in the
    # video term (LTX2_NARROW_AUDIO)
    "ltx2": {"block": (111.22, 18.03)},
    # HunyuanVideo-1.5 (an MMDiT: text is a stream of every block), counted with its all-True (S, S) attention
    # masks dropped (_without_full_masks): the CPU's masked attention is the math kernel, which keeps S x S
    # weights no GPU kernel keeps. What a GPU run keeps for the mask itself (a bool (S, S) per block, or the
    # float bias a masked memory-efficient kernel makes of it) cannot be counted on the CPU and is not in these
    # terms: read the HunyuanVideo-1.5 activations as a lower bound. The refiner sees the Qwen text only (its
    # image term is the derivation's remainder, within the 3 % check)
    "hunyuan_video15": {"patch_embed": (0.51, 0.0), "refiner": (-0.98, 42.31), "block": (56.16, 56.12)},
}

FAMILIES: dict[str, Family] = {}


def _register() -> None:
    """Fill :data:`FAMILIES` (key → :class:`Family`, in this order) and set each family's ``narrow`` key."""
    c = COEFFICIENTS
    FAMILIES.update({**_families_flux1_sd3_qwenimage(c), **_families_wan(c), **_families_flux2_flux3_zimage(c),
                     **_families_ltx2_hunyuan(c)})
    narrow = {"kontext": "flux", "qwenimage_edit_plus": "qwenimage",
              **{f"flux2_klein_{k}": "flux2" for k in ("9b", "9b_distilled", "4b", "4b_distilled")},
              "wan22_a14b": "wan_14b",
              "wan21_i2v_14b": "wan_14b", "wan22_i2v_a14b": "wan_14b", "flux3_distilled": "flux3",
              "hunyuan_video15_i2v": "hunyuan_video15"}
    for key, fam in FAMILIES.items():
        FAMILIES[key] = dataclasses.replace(fam, narrow=narrow.get(key, key))


def _families_flux1_sd3_qwenimage(c: dict) -> dict:
    """The plan families of FLUX.1, FLUX.1 Kontext, SD3.5 Medium, Qwen-Image and Qwen-Image-Edit-2509: key →
    :class:`Family` (``c``: :data:`COEFFICIENTS`)."""
    flux_kinds = (BlockKind("double", 19, *c["flux"]["double"]), BlockKind("single", 38, *c["flux"]["single"]))
    clip_t5 = (lambda: _clip(768, 12, 12, False), _t5_xxl)
    return {
        "flux": Family("FLUX.1-dev", _flux1, clip_t5, _kl_vae, 3072, _image_tokens, _image_latent(16),
                       lambda msl: msl, flux_kinds),
        "kontext": Family("FLUX.1-Kontext-dev", _flux1, clip_t5, _kl_vae, 3072,
                          lambda h, w, f: 2 * _image_tokens(h, w, f), _image_latent(16), lambda msl: msl,
                          flux_kinds),
        "sd3": Family("SD3.5-Medium", _sd35_medium,
                      (lambda: _clip(768, 12, 12, True), lambda: _clip(1280, 32, 20, True), _t5_xxl), _kl_vae, 1536,
                      _image_tokens, _image_latent(16), lambda msl: 77 + msl,
                      (BlockKind("dual", 13, *c["sd3"]["dual"]), BlockKind("joint", 10, *c["sd3"]["joint"]),
                       BlockKind("last", 1, *c["sd3"]["last"])), true_cfg=True),
        "qwenimage": Family("Qwen-Image", _qwen_image, (QWEN25_VL_7B,), _qwen_vae, 3072, _image_tokens,
                            _image_latent(16), lambda msl: msl, (BlockKind("block", 60, *c["qwenimage"]["block"]),),
                            true_cfg=True, decode_width=96),
        # the edit model: a 1024² source (the VAE area of QwenImageEditPlusPipeline) joins the output's tokens
        "qwenimage_edit_plus": Family("Qwen-Image-Edit-2509", _qwen_image, (QWEN25_VL_7B,), _qwen_vae, 3072,
                                      lambda h, w, f: _image_tokens(h, w, f) + 4096, _image_latent(16),
                                      lambda msl: msl, (BlockKind("block", 60, *c["qwenimage"]["block"]),),
                                      true_cfg=True, decode_width=96),
    }


def _families_wan(c: dict) -> dict:
    """The plan families of Wan2.1/2.2 text- and image-to-video: key → :class:`Family` (``c``:
    :data:`COEFFICIENTS`)."""
    return {
        "wan21_1.3b": Family("Wan2.1-T2V-1.3B", lambda: _wan("wan21_1.3b"), (_umt5_xxl,), _wan21_vae, 1536,
                             lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                             lambda h, w, f: 16 * _wan_frames(f) * (h // 8) * (w // 8), lambda msl: msl,
                             (BlockKind("block", 30, *c["wan21_1.3b"]["block"]),), true_cfg=True, decode_width=96,
                             decode_frames=4, video=True),
        "wan22_5b": Family("Wan2.2-TI2V-5B", lambda: _wan("wan22_5b"), (_umt5_xxl,), _wan22_vae, 3072,
                           lambda h, w, f: _wan_frames(f) * (h // 32) * (w // 32),
                           lambda h, w, f: 48 * _wan_frames(f) * (h // 16) * (w // 16), lambda msl: msl,
                           (BlockKind("block", 30, *c["wan22_5b"]["block"]),), true_cfg=True, decode_width=64,
                           decode_frames=4, video=True),
        "wan22_a14b": Family("Wan2.2-T2V-A14B", lambda: _wan("wan_14b"), (_umt5_xxl,), _wan21_vae, 5120,
                             lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                             lambda h, w, f: 16 * _wan_frames(f) * (h // 8) * (w // 8), lambda msl: msl,
                             (BlockKind("block", 40, *c["wan_14b"]["block"]),), true_cfg=True, experts=2,
                             decode_width=96, decode_frames=4, video=True),
        # image-to-video: the 14B body with 36 input channels (latents, mask, image latents); the image is not part
        # of the sampled latents. Wan2.1 I2V adds CLIP image tokens to the cross-attention keys (257) and image
        # key/value projections in every block (counted in the parameters; their activations are counted as 257
        # more text tokens of the T2V block, an approximation within the plan's ±20 %)
        "wan21_i2v_14b": Family("Wan2.1-I2V-14B-480P",
                                lambda: _wan("wan_14b", in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
                                (_umt5_xxl, _clip_vit_h14_vision), _wan21_vae, 5120,
                                lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                                lambda h, w, f: 16 * _wan_frames(f) * (h // 8) * (w // 8), lambda msl: msl + 257,
                                (BlockKind("block", 40, *c["wan_14b"]["block"]),), true_cfg=True, decode_width=96,
                                decode_frames=4, video=True),
        "wan22_i2v_a14b": Family("Wan2.2-I2V-A14B", lambda: _wan("wan_14b", in_channels=36), (_umt5_xxl,),
                                 _wan21_vae, 5120, lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                                 lambda h, w, f: 16 * _wan_frames(f) * (h // 8) * (w // 8), lambda msl: msl,
                                 (BlockKind("block", 40, *c["wan_14b"]["block"]),), true_cfg=True, experts=2,
                                 decode_width=96, decode_frames=4, video=True),
    }


def _families_flux2_flux3_zimage(c: dict) -> dict:
    """The plan families of FLUX.2 (dev and [klein]), FLUX.3, Qwen-Image 2.1 and Z-Image: key → :class:`Family` (``c``:
    :data:`COEFFICIENTS`)."""
    return {
        "flux2": Family("FLUX.2-dev", _flux2_dev, (MISTRAL_SMALL_31,), _flux2_vae, 6144, _image_tokens,
                        _image_latent(32), lambda msl: msl,
                        (BlockKind("double", 8, *c["flux2"]["double"]), BlockKind("single", 48,
                                                                                   *c["flux2"]["single"]))),
        # FLUX.2 [klein]: the base models run true CFG with the empty negative prompt (Flux2KleinPipeline), the
        # step-distilled ones no guidance (is_distilled)
        **{f"flux2_klein_{size}{'' if base else '_distilled'}": Family(
            f"FLUX.2-klein-{'base-' if base else ''}{size.upper()}", lambda size=size, **o: _flux2_klein(size, **o),
            (QWEN3_8B if size == "9b" else QWEN3_4B,), _flux2_vae, 128 * KLEIN[size]["num_attention_heads"],
            _image_tokens, _image_latent(32), lambda msl: msl,
            (BlockKind("double", KLEIN[size]["num_layers"], *c["flux2"]["double"]),
             BlockKind("single", KLEIN[size]["num_single_layers"], *c["flux2"]["single"])), true_cfg=base)
           for size in ("9b", "4b") for base in (True, False)},
        "flux3": Family("FLUX.3", _flux3, (QWEN3_VL_4B,), _flux2_vae, 3072, _image_tokens, _image_latent(32),
                        lambda msl: msl, tuple(BlockKind(k, n, *c["flux3"][k]) for k, n in
                                               (("image_mode", 5), ("cond_mode", 5), ("text_mode", 5), ("single", 28))),
                        true_cfg=True),
        "flux3_distilled": Family("FLUX.3 distilled", lambda **o: _flux3(flow_map=True, **o), (QWEN3_VL_4B,),
                                  _flux2_vae, 3072, _image_tokens, _image_latent(32), lambda msl: msl,
                                  tuple(BlockKind(k, n, *c["flux3"][k]) for k, n in
                                        (("image_mode", 5), ("cond_mode", 5), ("text_mode", 5), ("single", 28)))),
        "qwenimage21": Family("Qwen-Image-2.1", _qwen_image21, (QWEN3_VL_8B,), _qwen21_vae, 4096, _image_tokens,
                              lambda h, w, f: 64 * (h // 16) * (w // 16), lambda msl: msl,
                              (BlockKind("block", 32, *c["qwenimage21"]["block"]),), true_cfg=True, decode_width=144),
        "zimage": Family("Z-Image", _zimage, (QWEN3_4B,), _kl_vae, 3840, _image_tokens, _image_latent(16),
                         lambda msl: msl, (BlockKind("noise_refiner", 2, *c["zimage"]["noise_refiner"]),
                                           BlockKind("context_refiner", 2, *c["zimage"]["context_refiner"]),
                                           BlockKind("block", 30, *c["zimage"]["block"])), true_cfg=True),
    }


def _families_ltx2_hunyuan(c: dict) -> dict:
    """The plan families of LTX-2 and HunyuanVideo-1.5 (text- and image-to-video): key → :class:`Family` (``c``:
    :data:`COEFFICIENTS`)."""
    return {
        # LTX-2 (Lightricks/LTX-2, 19 B): the transformer, VAEs and connectors are their diffusers classes'
        # defaults (the release's), Gemma 3 12B its config. Tokens: the video's F'·(H/32)·(W/32) (the audio's
        # ~1 a frame at half width are folded into the coefficient); text 1024 connector tokens by cross-attention.
        # The sampled state is video ‖ audio latents (128 per video token, 8 x 16 per audio latent frame,
        # F/24·25 frames); image-to-video's lacks frame 0's tokens, 1/F' less, which the row does not subtract
        # (one row for both: the folder is the same). The guidance stack runs 4 rows a sample (CFG pair, STG,
        # modality isolation), each with gradient in training. The VAE decodes every frame at once (no
        # framewise decoding by default): its last stage is 256 channels at H/4 before the 4x4 unpatchify, 16 a
        # full-resolution pixel.
        "ltx2": Family("LTX-2", _ltx2, (_gemma3_12b, _ltx2_connectors), _ltx2_vaes, 4096,
                       lambda h, w, f: _ltx2_frames(f) * (h // 32) * (w // 32),
                       lambda h, w, f: 128 * _ltx2_frames(f) * (h // 32) * (w // 32) + 128 * round(f / 24 * 25),
                       lambda msl: msl, (BlockKind("block", 48, *c["ltx2"]["block"]),), true_cfg=True,
                       decode_width=16, decode_frames=ALL_FRAMES, video=True, guided_rows=4),
        # HunyuanVideo-1.5 (8.3 B): transformer and VAE their classes' defaults (the release's); Qwen2.5-VL-7B's
        # language model and ByT5-small (glyphs) their configs, SigLIP so400m for image-to-video. Tokens:
        # F'·(H/16)·(W/16) (patch 1 on the 16x VAE); text 1000 Qwen + 256 ByT5 + 729 image tokens (zeros,
        # masked, in text-to-video), joined to every block's attention. Activations: a lower bound (COEFFICIENTS).
        # The VAE decodes every frame at once (tiling off), its last stage 128 channels at full resolution.
        "hunyuan_video15": Family("HunyuanVideo-1.5", _hunyuan_video15, (_qwen25_vl_7b_text, _byt5_small),
                                  _hunyuan_vae, 2048, lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                                  lambda h, w, f: 32 * _wan_frames(f) * (h // 16) * (w // 16),
                                  lambda msl: 1000 + 256 + 729, _hunyuan_kinds(), true_cfg=True,
                                  decode_width=128, decode_frames=ALL_FRAMES, video=True, joint_text=True),
        "hunyuan_video15_i2v": Family("HunyuanVideo-1.5 I2V", _hunyuan_video15,
                                      (_qwen25_vl_7b_text, _byt5_small, _siglip_so400m), _hunyuan_vae, 2048,
                                      lambda h, w, f: _wan_frames(f) * (h // 16) * (w // 16),
                                      lambda h, w, f: 32 * _wan_frames(f) * (h // 16) * (w // 16),
                                      lambda msl: 1000 + 256 + 729, _hunyuan_kinds(), true_cfg=True,
                                      decode_width=128, decode_frames=ALL_FRAMES, video=True, joint_text=True),
    }


#: a config's model.pretrained → family; configs of other models (the embedded digits and tiny models) are
#: refused by :func:`plan_config`
PRETRAINED = {"black-forest-labs/FLUX.1-dev": "flux", "black-forest-labs/FLUX.1-Kontext-dev": "kontext",
              "stabilityai/stable-diffusion-3.5-medium": "sd3", "Qwen/Qwen-Image": "qwenimage",
              "Qwen/Qwen-Image-Edit-2509": "qwenimage_edit_plus",
              "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": "wan21_1.3b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers": "wan22_5b",
              "Wan-AI/Wan2.2-T2V-A14B-Diffusers": "wan22_a14b", "black-forest-labs/FLUX.2-dev": "flux2",
              "black-forest-labs/FLUX.2-klein-base-9B": "flux2_klein_9b",
              "black-forest-labs/FLUX.2-klein-9B": "flux2_klein_9b_distilled",
              "black-forest-labs/FLUX.2-klein-base-4B": "flux2_klein_4b",
              "black-forest-labs/FLUX.2-klein-4B": "flux2_klein_4b_distilled",
              "Tongyi-MAI/Z-Image": "zimage", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": "wan21_i2v_14b",
              "Wan-AI/Wan2.2-I2V-A14B-Diffusers": "wan22_i2v_a14b", "Qwen/Qwen-Image-2.1": "qwenimage21",
              # FLUX.3: no public hub id was found (2026-12-02); the configs name these, see configs/flux3.yaml
              "black-forest-labs/FLUX.3": "flux3", "black-forest-labs/FLUX.3-distilled": "flux3_distilled",
              # one folder for LTX-2's text- and image-to-video pipelines (one row: see FAMILIES["ltx2"])
              "Lightricks/LTX-2": "ltx2",
              # the diffusers conversions of HunyuanVideo-1.5 (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-
              # {480p,720p}_{t2v,i2v}; 720p_t2v is the one a model card names, the others follow its pattern)
              **{f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{r}_{t}":
                 "hunyuan_video15" + ("_i2v" if t == "i2v" else "") for r in ("480p", "720p") for t in ("t2v", "i2v")}}

#: reward name → builder (meta device) or published parameter count, and its default bytes per parameter
REWARD_MODELS: dict[str, tuple[Callable | float, int]] = {
    "hpsv2": (lambda: _open_clip("ViT-H-14"), 4),
    "pickscore": (lambda: _open_clip("ViT-H-14"), 4),  # a CLIPModel of the ViT-H-14 architecture
    "clip_score": (lambda: _open_clip("ViT-H-14"), 4),  # its largest variant (DFN5B ViT-H-14)
    "image_similarity": (lambda: _open_clip("ViT-L-14"), 4),  # openai/clip-vit-large-patch14
    "aesthetic": (lambda: _open_clip("ViT-L-14"), 4),  # CLIP ViT-L/14 and a small MLP head
    # GenEval: Mask2Former Swin-S (69 M, its model card) and the colour classifier's ViT-L-14
    "geneval": (lambda: 69e6 + parameter_count(lambda: _open_clip("ViT-L-14-quickgelu")), 4),
    "image_reward": (447e6, 4),  # ImageReward: BLIP ViT-L + BERT-base (its paper)
    "hpsv3": (QWEN2_VL_7B, 2),
    "unifiedreward": (QWEN25_VL_7B, 2),
}


_COUNTS: dict = {}


def parameter_count(build) -> int:
    """Parameters of a builder's meta-device model (cached per builder), or a published count as given."""
    if isinstance(build, float | int):
        return int(build)
    if build in _COUNTS:
        return _COUNTS[build]
    with torch.device("meta"):
        out = build()
    _COUNTS[build] = int(out) if isinstance(out, float | int) else sum(p.numel() for p in out.parameters())
    return _COUNTS[build]


#: the blocks of a transformer class that declares none (``_no_split_modules`` empty): its adapter's ``shard_blocks``
OWN_BLOCKS = {"LTX2VideoTransformer3DModel": ("LTX2VideoTransformerBlock",)}


def _shard_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards in ``model`` (:func:`flowgrpo.parallel.shard_blocks`, with :data:`OWN_BLOCKS`)."""
    from flowgrpo.parallel import shard_blocks

    return shard_blocks(model, OWN_BLOCKS.get(type(model).__name__))


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a family (and of a LoRA on it): one transformer (one expert), its largest block, its
    blocks, the LoRA, the text encoders, the VAE."""

    transformer: int
    largest_block: int
    blocks: int
    lora: int
    encoders: int
    vae: int


_SIZES: dict = {}


def sizes(family: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> Sizes:
    """The family's parameter counts, from meta-device models (cached); ``lora`` for the given rank and targets
    (0 without)."""
    key = (family, lora_rank, tuple(lora_targets))
    if key in _SIZES:
        return _SIZES[key]
    fam = FAMILIES[family]
    with torch.device("meta"):
        tr = fam.transformer()
        blocks = _shard_blocks(tr)
        n = sum(p.numel() for p in tr.parameters())
        largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
        lora = 0
        if lora_rank:
            from peft import LoraConfig

            tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(lora_targets)))
            lora = sum(p.numel() for name, p in tr.named_parameters() if "lora_" in name)
    out = Sizes(n, largest, len(blocks), lora, sum(parameter_count(e) for e in fam.encoders), parameter_count(fam.vae))
    _SIZES[key] = out
    return out


def attention_heads(family: str) -> int | None:
    """The attention heads of the family's transformer (its config's ``num_attention_heads``, from the
    meta-device build :func:`sizes` caches), which Ulysses context parallelism splits; None when it gives none."""
    if family not in _HEADS:
        with torch.device("meta"):
            _HEADS[family] = getattr(FAMILIES[family].transformer().config, "num_attention_heads", None)
    return _HEADS[family]


_HEADS: dict = {}


# ---------------------------------------------------------------------------------------------------------------
# Counting what autograd saves (the source of COEFFICIENTS)
# ---------------------------------------------------------------------------------------------------------------

def saved_bytes(model: torch.nn.Module, blocks: list[torch.nn.Module], call: Callable) -> list[int]:
    """Bytes of the tensors autograd saves for the backward inside each of ``blocks`` while ``call()`` runs
    ``model``'s forward: every saved tensor's storage counted once (a storage saved by several operations, or by
    a later block, belongs to the first block that saved it), the model's parameters left out (they are weights,
    not activations). Returns one figure per block, in ``blocks``' order."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per = [0] * len(blocks)
    current: list[int | None] = [None]
    index = {id(b): i for i, b in enumerate(blocks)}

    def enter(module, args):
        current[0] = index[id(module)]

    def leave(module, args, out):
        current[0] = None

    hooks = [b.register_forward_pre_hook(enter) for b in blocks] + [b.register_forward_hook(leave) for b in blocks]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if current[0] is not None and key not in params and key not in seen:
            seen.add(key)
            per[current[0]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call()
    finally:
        for h in hooks:
            h.remove()
    return per


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in bfloat16 except the modules its class keeps in float32 (as ``from_pretrained(torch_dtype=
    torch.bfloat16)`` loads it)."""
    from diffusers.utils import logging as diffusers_logging

    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its advice to load with torch_dtype: the float32 modules are kept below
    try:
        model.to(torch.bfloat16)
    finally:
        diffusers_logging.set_verbosity(level)
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in keep):
            module.float()
    return model


def _narrow(family: str, image_tokens: int, text_tokens: int, heads: int):
    """A narrow model of ``family``'s transformer class (``heads`` heads of the real head width, the real MLP
    ratio, few blocks, bf16) and a call of its forward on ``image_tokens`` + ``text_tokens`` tokens of one row;
    returns (model, call, kind of each block in ``shard_blocks`` order or None: by its attribute name, width).

    Raises:
        ValueError: ``image_tokens`` not a square, or a family without a narrow model.
    """
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"image_tokens={image_tokens} must be a square (a square latent)")
    build = _NARROW.get("wan" if family in WAN else family)
    if build is None:
        raise ValueError(f"no narrow model for family {family!r}")
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return build(family, side, image_tokens, text_tokens, heads, rnd)


def _narrow_flux(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of FLUX.1: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_flux1(num_layers=2, num_single_layers=2, num_attention_heads=heads, joint_attention_dim=64,
                     pooled_projection_dim=32))
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 64), encoder_hidden_states=rnd(1, text_tokens, 64),
                        pooled_projections=rnd(1, 32), timestep=torch.ones(1), guidance=torch.ones(1),
                        img_ids=torch.zeros(image_tokens, 3), txt_ids=torch.zeros(text_tokens, 3)), \
        ["double", "double", "single", "single"], 128 * heads


def _narrow_flux2(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of FLUX.2 [dev]: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_flux2_dev(num_layers=2, num_single_layers=2, num_attention_heads=heads, joint_attention_dim=64,
                         in_channels=32))
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 32), encoder_hidden_states=rnd(1, text_tokens, 64),
                        timestep=torch.ones(1), guidance=torch.ones(1), img_ids=torch.zeros(1, image_tokens, 4),
                        txt_ids=torch.zeros(1, text_tokens, 4)), ["double", "double", "single", "single"], \
        128 * heads


def _narrow_sd3(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of SD3.5 Medium: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_sd35_medium(num_layers=4, num_attention_heads=heads, joint_attention_dim=64,
                           caption_projection_dim=64 * heads, pooled_projection_dim=32, sample_size=2 * side,
                           pos_embed_max_size=2 * side, dual_attention_layers=(0, 1)))
    return m, lambda: m(hidden_states=rnd(1, 16, 2 * side, 2 * side), encoder_hidden_states=rnd(1, text_tokens, 64),
                        pooled_projections=rnd(1, 32), timestep=torch.ones(1)), ["dual", "dual", "joint", "last"], \
        64 * heads


def _narrow_qwenimage(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of Qwen-Image: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_qwen_image(num_layers=2, num_attention_heads=heads, joint_attention_dim=64))
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 64), encoder_hidden_states=rnd(1, text_tokens, 64),
                        encoder_hidden_states_mask=torch.ones(1, text_tokens, dtype=torch.long),
                        timestep=torch.ones(1), img_shapes=[[(1, side, side)]]), ["block", "block"], 128 * heads


def _narrow_wan(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of Wan (``family``: a :data:`WAN` key): ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    ratio = WAN[family]["ffn_dim"] / (128 * WAN[family]["num_attention_heads"])
    m = _bf16(_wan(family, num_layers=2, num_attention_heads=heads, ffn_dim=round(ratio * 128 * heads),
                   text_dim=64, in_channels=16, out_channels=16))
    return m, lambda: m(hidden_states=rnd(1, 16, 1, 2 * side, 2 * side), timestep=torch.ones(1),
                        encoder_hidden_states=rnd(1, text_tokens, 64)), ["block", "block"], 128 * heads


def _narrow_flux3(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of FLUX.3: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_flux3(num_layers=1, num_single_layers=2, num_attention_heads=heads, joint_attention_dim=64,
                     in_channels=32, cond_in_channels=32))
    names = {id(mod): n for n, mod in m.named_modules()}
    kind = {"mode_blocks.image": "image_mode", "mode_blocks.image_cond": "cond_mode",
            "txt_mode_blocks": "text_mode", "single_transformer_blocks": "single"}
    from flowgrpo.parallel import shard_blocks

    kinds = [kind[names[id(b)].rsplit(".", 1)[0]] for b in shard_blocks(m)]
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 32), encoder_hidden_states=rnd(1, text_tokens, 64),
                        timestep=torch.ones(1), img_ids=torch.zeros(image_tokens, 4),
                        txt_ids=torch.zeros(text_tokens, 4)), kinds, 128 * heads


def _narrow_qwenimage21(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of Qwen-Image 2.1: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_qwen_image21(num_layers=2, num_attention_heads=heads, context_in_dim=64, in_channels=64,
                            out_channels=64))
    pad = torch.zeros(1, text_tokens + image_tokens // 4, dtype=torch.bool)
    pad[:, text_tokens:] = True
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 64), encoder_hidden_states=rnd(1, text_tokens, 64),
                        timestep=torch.ones(1), img_shapes=[[(1, side, side)]], img_mask=pad), \
        ["block", "block"], 128 * heads


def _narrow_zimage(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of Z-Image: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_zimage(n_layers=2, n_refiner_layers=1, dim=128 * heads, n_heads=heads, n_kv_heads=heads,
                      cap_feat_dim=64))
    for name, p in m.named_parameters():  # its padding tokens are torch.empty in its constructor
        if "pad_token" in name:
            p.data.normal_()
    return m, lambda: m([rnd(16, 1, 2 * side, 2 * side)], torch.ones(1), [rnd(text_tokens, 64)]), None, 128 * heads


def _narrow_ltx2(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of LTX-2: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    # video tokens: one latent frame of side x side; the audio stream a fixed LTX2_NARROW_AUDIO tokens (at half
    # the video's width); text by cross-attention only, unmasked (a padding mask is a (B, 1, L) bias)
    m = _bf16(_ltx2(num_layers=2, num_attention_heads=heads, audio_num_attention_heads=heads,
                    cross_attention_dim=128 * heads, audio_cross_attention_dim=64 * heads, caption_channels=64))
    a = LTX2_NARROW_AUDIO
    return m, lambda: m(hidden_states=rnd(1, image_tokens, 128), audio_hidden_states=rnd(1, a, 128),
                        encoder_hidden_states=rnd(1, text_tokens, 64),
                        audio_encoder_hidden_states=rnd(1, text_tokens, 64), timestep=torch.ones(1),
                        sigma=torch.ones(1), num_frames=1, height=side, width=side, audio_num_frames=a,
                        use_cross_timestep=True, return_dict=False), ["block", "block"], 128 * heads


def _narrow_hunyuan_video15(family: str, side: int, image_tokens: int, text_tokens: int, heads: int, rnd: Callable):
    """:func:`_narrow` of HunyuanVideo-1.5: ``side`` = √image_tokens, ``rnd(*shape)`` a bf16 draw."""
    m = _bf16(_hunyuan_video15(num_layers=2, num_refiner_layers=2, num_attention_heads=heads,
                               text_embed_dim=64, text_embed_2_dim=32, image_embed_dim=32))
    n2, n3 = text_tokens // 4, text_tokens // 4  # glyph and image tokens: shares of the counted text tokens
    n1 = text_tokens - n2 - n3
    return m, _without_full_masks(lambda: m(
        hidden_states=rnd(1, 65, 1, side, side), timestep=torch.ones(1, dtype=torch.bfloat16),
        encoder_hidden_states=rnd(1, n1, 64),
        encoder_attention_mask=torch.ones(1, n1), encoder_hidden_states_2=rnd(1, n2, 32),
        encoder_attention_mask_2=torch.ones(1, n2), image_embeds=rnd(1, n3, 32), return_dict=False)), \
        ["patch_embed", "refiner", "block", "block"], 128 * heads


#: family (Wan's: "wan") → its :func:`_narrow` builder
_NARROW = {"flux": _narrow_flux, "flux2": _narrow_flux2, "sd3": _narrow_sd3, "qwenimage": _narrow_qwenimage,
           "wan": _narrow_wan, "flux3": _narrow_flux3, "qwenimage21": _narrow_qwenimage21, "zimage": _narrow_zimage,
           "ltx2": _narrow_ltx2, "hunyuan_video15": _narrow_hunyuan_video15}


#: audio tokens of the narrow LTX-2 model (the released 121 frames at 24 fps have 126, beside 6144 video tokens
#: at 512 x 768: their bytes, at half the video's width, are folded into the video term at this fixed count)
LTX2_NARROW_AUDIO = 16


def _without_full_masks(call: Callable) -> Callable:
    """``call`` with every attention mask that masks nothing dropped before ``dispatch_attention_fn`` (the same
    attention): HunyuanVideo-1.5's blocks always pass an (S, S) boolean mask, which sends the CPU count through the
    math attention that keeps the S x S weights; a GPU kernel does not keep those (module docstring of the row)."""

    def run():
        import diffusers.models.transformers.transformer_hunyuan_video15 as mod

        dispatch = mod.dispatch_attention_fn

        def unmasked(*args, attn_mask=None, **kwargs):
            if attn_mask is not None and bool(attn_mask.all()):
                attn_mask = None
            return dispatch(*args, attn_mask=attn_mask, **kwargs)

        mod.dispatch_attention_fn = unmasked
        try:
            return call()
        finally:
            mod.dispatch_attention_fn = dispatch

    return run


def count_saved_bytes(family: str, image_tokens: int, text_tokens: int, heads: int = 2,
                      lora_targets: tuple[str, ...] = ()) -> tuple[dict[str, int], int]:
    """Bytes autograd saves for one block of each kind of ``family`` (a key of :data:`COEFFICIENTS`) on one row of
    ``image_tokens`` + ``text_tokens`` tokens, counted by :func:`saved_bytes` on a narrow bf16 model of the real
    class (:func:`_narrow`) with every parameter trainable, or, with ``lora_targets``, the base frozen and a
    rank-1 float32 LoRA on those modules (as training sets it up: peft's adapter in float32 over the bf16 base);
    the last block of each kind is reported (the first block also saves what all blocks share, e.g. the rotary
    tables). Returns ({kind: bytes}, the width h)."""
    model, call, kinds, width = _narrow(family, image_tokens, text_tokens, heads)
    if lora_targets:
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=1, lora_alpha=1, target_modules=list(lora_targets)))
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    blocks = _shard_blocks(model)
    if kinds is None:  # Z-Image: its image and text refiners, then the joint layers, named by their attribute
        names = {id(m): n.split(".")[0] for n, m in model.named_modules()}
        kinds = [{"layers": "block"}.get(names[id(b)], names[id(b)]) for b in blocks]
    counted = saved_bytes(model, blocks, call)
    return dict(zip(kinds, counted, strict=True)), width


def derive_coefficients(family: str, image_tokens: int = 1024, text_tokens: int = 256, heads: int = 2,
                        lora_targets: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """The (image, text) coefficients of each block kind of ``family`` (full fine-tuning, or a LoRA on
    ``lora_targets``): counts at ``text_tokens`` and twice as many give the text term, the rest is the image term
    (``bytes = (image·s_img + text·s_txt)·h``)."""
    one, h = count_saved_bytes(family, image_tokens, text_tokens, heads, lora_targets)
    two, _ = count_saved_bytes(family, image_tokens, 2 * text_tokens, heads, lora_targets)
    out = {}
    for kind in one:
        text = (two[kind] - one[kind]) / (text_tokens * h)
        out[kind] = (round((one[kind] - text * text_tokens * h) / (image_tokens * h), 2), round(text, 2))
    return out


_LORA_KINDS: dict = {}


def lora_kinds(family: str, rank: int, targets: tuple[str, ...]) -> tuple[BlockKind, ...]:
    """``family``'s block kinds with the coefficients of a LoRA of ``rank`` on ``targets``, counted on the narrow
    model (:func:`derive_coefficients`, cached): the rank-1 count plus each adapted linear's (s × rank) float32
    intermediate, 4·rank/h per token and adapted linear of the block (counted on the image and the text term)."""
    key = (family, rank, tuple(targets))
    if key not in _LORA_KINDS:
        fam = FAMILIES[family]
        counted = derive_coefficients(fam.narrow, lora_targets=tuple(targets))
        from peft import LoraConfig

        with torch.device("meta"):  # how many linears of one block of each kind the targets adapt
            tr = fam.transformer()
            tr.add_adapter(LoraConfig(r=1, lora_alpha=1, target_modules=list(targets)))
            blocks = _shard_blocks(tr)
        adapted = max(sum(1 for n, _ in b.named_modules() if n.endswith("lora_A")) for b in blocks)
        extra = 4 * (rank - 1) * adapted / fam.width  # the most any block adapts, for every kind (an upper bound)
        _LORA_KINDS[key] = tuple(BlockKind(k.name, k.count, counted[k.name][0] + extra, counted[k.name][1] + extra)
                                 for k in fam.kinds)
    return _LORA_KINDS[key]


_register()
