"""Tiny random stand-ins of the reward models, saved in each model's official checkpoint format.

They have the real architecture family (CLIP ViT + text transformer, the aesthetic MLP) and the real
49,408-token CLIP BPE vocabulary (from the vocabulary file that the open-clip-torch wheel ships), but a few
layers of width 32, so they build in about a second and run on a CPU. Their scores mean nothing; they exist
so that tests and benchmarks drive the real loading code offline:

* :func:`save_tiny_hps_checkpoint` - an open_clip ``CLIP`` state dict under ``state_dict`` (the layout of
  ``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt``); load with ``architecture=TINY_OPEN_CLIP``.
* :func:`save_tiny_open_clip_dir` - an open_clip hub folder (``open_clip_config.json`` +
  ``open_clip_pytorch_model.bin``), the layout of ``apple/DFN5B-CLIP-ViT-H-14-378``.
* :func:`save_tiny_hf_clip` - a transformers ``CLIPModel`` folder (``config.json`` + ``model.safetensors``,
  like ``yuvalkirstain/PickScore_v1`` and ``openai/clip-vit-large-patch14``) and a processor folder
  (tokenizer + ``preprocessor_config.json``, like ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``).
* :func:`save_tiny_aesthetic_mlp` - a bare state dict with the keys of ``sac+logos+ava1-l14-linearMSE.pth``.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import math
from pathlib import Path

import torch

#: open_clip model config of the tiny ViT-H-14 stand-in (same family: ViT image tower, causal text tower).
TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}

#: The released CLIP models' learned temperature: exp(logit_scale) = 100.
RELEASED_LOGIT_SCALE = math.log(100.0)


def tiny_hf_clip_config(image_size: int = 32, hidden_act: str = "gelu", projection_dim: int = 16) -> dict:
    """A ``transformers.CLIPConfig`` dict of a 2-layer, width-32 CLIP with the real CLIP vocabulary.

    ``hidden_act``: ``"gelu"`` as in the laion ViT-H-14 / PickScore models, ``"quick_gelu"`` as in openai's.
    """
    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    return {
        "text_config": {
            **common,
            "vocab_size": 49408,
            "max_position_embeddings": 77,
            "hidden_act": hidden_act,
            "bos_token_id": 49406,
            "eos_token_id": 49407,
            "pad_token_id": 1,
            "projection_dim": projection_dim,
        },
        "vision_config": {
            **common,
            "image_size": image_size,
            "patch_size": 8,
            "hidden_act": hidden_act,
            "projection_dim": projection_dim,
        },
        "projection_dim": projection_dim,
        "logit_scale_init_value": RELEASED_LOGIT_SCALE,
    }


@functools.lru_cache(maxsize=1)
def clip_bpe_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The CLIP BPE vocabulary (49,408 tokens) and merges, rebuilt from open_clip's bundled
    ``bpe_simple_vocab_16e6.txt.gz`` the way the openai tokenizer builds them (openai/CLIP
    ``clip/simple_tokenizer.py``): 256 byte symbols, the same with ``</w>``, 48,894 merges, 2 specials."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    with gzip.open(default_bpe(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")[1 : 49152 - 256 - 2 + 1]
    merges = [tuple(line.split()) for line in lines]
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def save_tiny_hf_clip(
    model_dir: str | Path,
    processor_dir: str | Path | None = None,
    *,
    seed: int = 0,
    config: dict | None = None,
    image_size: int = 32,
    resample: int = 3,
) -> None:
    """Save a random tiny transformers ``CLIPModel`` folder and (optionally) a CLIP processor folder.

    Args:
        model_dir: receives ``config.json`` and ``model.safetensors`` (``save_pretrained``).
        processor_dir: receives the tokenizer (real CLIP vocabulary, 77 tokens) and a ``CLIPImageProcessor``
            config (shortest edge ``image_size``, crop ``image_size``, openai mean/std, ``resample``).
        seed: torch seed of the random weights.
        config: a ``CLIPConfig`` dict (default :func:`tiny_hf_clip_config`).
    """
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(**(config or tiny_hf_clip_config(image_size=image_size)))).eval()
    model.save_pretrained(str(model_dir))
    if processor_dir is not None:
        vocab, merges = clip_bpe_vocab()
        tokenizer = CLIPTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=77)
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            resample=resample,
        )
        CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(processor_dir))


def _random_open_clip(architecture: dict, seed: int) -> torch.nn.Module:
    from open_clip.model import CLIP

    torch.manual_seed(seed)
    cfg = copy.deepcopy(architecture)
    return CLIP(**cfg).eval()


def save_tiny_hps_checkpoint(path: str | Path, *, seed: int = 0, architecture: dict | None = None) -> None:
    """Save a random open_clip ``CLIP`` as ``{"state_dict": ...}`` (the HPSv2 ``*_compressed.pt`` layout).

    ``architecture``: open_clip model config (default :data:`TINY_OPEN_CLIP`); pass the same dict as the
    reward's ``architecture`` to load it.
    """
    model = _random_open_clip(architecture or TINY_OPEN_CLIP, seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict()}, str(path))


def save_tiny_open_clip_dir(
    folder: str | Path,
    *,
    seed: int = 0,
    architecture: dict | None = None,
    preprocess_cfg: dict | None = None,
) -> None:
    """Save a random open_clip model as a hub folder: ``open_clip_config.json`` (``model_cfg`` +
    ``preprocess_cfg``) and ``open_clip_pytorch_model.bin`` (a bare state dict), DFN5B's layout.

    ``preprocess_cfg`` defaults to DFN5B's: openai mean/std, bicubic, ``resize_mode="squash"``.
    """
    architecture = copy.deepcopy(architecture or {**TINY_OPEN_CLIP, "quick_gelu": True})
    model = _random_open_clip(architecture, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    from flowgrpo_rewards._clip_common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    preprocess = preprocess_cfg or {
        "mean": list(OPENAI_CLIP_MEAN),
        "std": list(OPENAI_CLIP_STD),
        "interpolation": "bicubic",
        "resize_mode": "squash",
    }
    (folder / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": architecture, "preprocess_cfg": preprocess}, indent=2)
    )
    torch.save(model.state_dict(), str(folder / "open_clip_pytorch_model.bin"))


def save_tiny_aesthetic_mlp(path: str | Path, *, dims: tuple[int, ...] = (16, 32, 16, 8, 4, 1), seed: int = 0) -> None:
    """Save a random aesthetic MLP state dict (keys ``layers.{0,2,4,6,7}.*``); ``dims[0]`` must equal the
    CLIP projection size (16 for :func:`tiny_hf_clip_config`)."""
    from flowgrpo_rewards.aesthetic import AestheticMLP

    torch.manual_seed(seed)
    mlp = AestheticMLP(tuple(dims))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(mlp.state_dict(), str(path))
