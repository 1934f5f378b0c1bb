"""Reference ImageReward scores from the original ``image-reward`` package, for flowgrpo's parity test.

ImageReward (Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
NeurIPS 2023, arXiv 2304.05977) ships as the PyPI package ``image-reward`` 1.5, which does not import under
transformers 5. This script computes, once, what that original package says about a small random checkpoint, so
that ``rewards/tests/test_image_reward.py`` can check flowgrpo's loader (:mod:`flowgrpo_rewards.image_reward`)
against it in CI without the old package.

It runs in two stages:

1. With any Python (``python rewards/scripts/image_reward_reference.py``) it builds a separate virtual
   environment (default ``/tmp/image_reward_ref_env``) holding the original package and the old libraries it
   works with (:data:`OLD_ENV_REQUIREMENTS`), then re-runs itself there with ``--in-env``.
2. Inside that environment it writes into ``--out`` (default ``rewards/tests/data/image_reward``):

   * ``tokenizer/vocab.txt``: a small WordPiece vocabulary (the 30,522-token ``bert-base-uncased`` one cannot be
     downloaded here). The original package adds ``[DEC]`` (as ``bos_token``) and ``[ENC]`` (as an additional
     special token) to it, exactly as it does to ``bert-base-uncased``.
   * ``med_config.json``: the official file's fields with tiny sizes (the official one is BLIP's
     ``med_config.json``: BERT-base, 12 layers, width 768, vocabulary 30,524 = 30,522 + the two added tokens).
   * ``ImageReward.pt``: the state dict of the original ``ImageReward`` module, saved with ``torch.save``, i.e.
     the official checkpoint format (keys ``blip.visual_encoder.*``, ``blip.text_encoder.*``,
     ``blip.vision_proj.*``, ``blip.text_proj.*``, ``mlp.layers.*``), with random weights.
   * ``img*.png``: deterministic test images, three at 224 x 224 and two of other sizes.
   * ``reference.json``: the token ids the original tokenizer produces, the raw head outputs and the normalised
     scores the original ``ImageReward.score(prompt, pil_image)`` returns for every (prompt, image) pair, and the
     versions of the libraries used.

The model is built by the original package's own classes and loaded back through its own ``ImageReward.load``.
Three things are patched, all of them sizes only, because the package hard-codes the full-size model:
``create_vit`` (it always builds ViT-L/16) returns the original ``VisionTransformer`` with the tiny sizes;
``MLP(768)`` becomes the original ``MLP`` with the tiny text width as input (its hidden sizes 1024, 128, 64, 16
stay as published); ``BertTokenizer.from_pretrained('bert-base-uncased')`` reads the local vocabulary. The
forward code that produces the scores is the package's own.

The images are 224 x 224 so that the original's PIL preprocessing (resize of the shorter side to 224, centre crop,
``ToTensor``, CLIP mean/std) is exact: the pixels reach the model as ``uint8 / 255`` in both implementations, and
the 1e-5 comparison is about the model alone. The two images of other sizes record the original PIL bicubic
resize, which flowgrpo replaces by a torch resize (see :func:`flowgrpo_rewards.image_reward.preprocess`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "rewards" / "tests" / "data" / "image_reward"
DEFAULT_VENV = Path("/tmp/image_reward_ref_env")

# The versions this reference was produced with (a resolvable set for Python 3.11). image-reward 1.5 needs
# transformers 4.x (it imports helpers removed in 5), timm 0.6.13 (its pin), fairscale, the undeclared ``clip``
# package (imported at the top of the package; PyPI ``openai-clip`` provides it) and ``pkg_resources``
# (setuptools < 70); its ``__init__`` also imports diffusers, datasets and accelerate through ``ReFL.py``.
OLD_ENV_REQUIREMENTS = [
    "torch==2.12.1",
    "torchvision==0.27.1",
    "image-reward==1.5",
    "transformers==4.36.2",
    "tokenizers==0.15.2",
    "timm==0.6.13",
    "fairscale==0.4.13",
    "openai-clip==1.0.1",
    "setuptools<70",
    "numpy==1.26.4",
    "pyarrow==15.0.2",
    "diffusers==0.25.1",
    "datasets==2.16.1",
    "huggingface-hub==0.20.3",
    "accelerate==0.26.1",
]

# Tiny architecture of the test checkpoint. Vision and text widths differ on purpose, so that a cross-attention
# key/value projection wired to the wrong width cannot load. Keys follow transformers' BlipVisionConfig names.
TINY_VISION_CONFIG = {
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "intermediate_size": 192,  # the original ViT's mlp_ratio 4
    "image_size": 224,
    "patch_size": 16,
}
TINY_TEXT_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
# The official med_config.json (BLIP's): BERT-base with cross-attention, vocabulary 30,522 + [DEC] + [ENC].
OFFICIAL_TEXT_SIZES = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "vocab_size": 30524,
}

PROMPTS = [
    "A red cat sitting on the table.",
    "an astronaut riding a green horse",
    "Café, dogs & photos!!",
    # longer than 35 tokens: checks truncation to max_length 35
    "a photo of a blue dog riding a red horse on the green table with an astronaut and a cat sitting in a "
    "cafe, photo of the dog and the horses",
]
SQUARE_IMAGES = ["img0_224x224.png", "img1_224x224.png", "img2_224x224.png"]
OTHER_IMAGES = ["img3_256x320.png", "img4_300x240.png"]  # H x W


def _vocabulary(pad_to: int = 0) -> list[str]:
    """A small WordPiece vocabulary in BERT's layout: specials, punctuation, words, single characters, ##pieces."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = (
        "a an the of on in with and photo cat dog red blue green sitting table cafe astronaut riding horse "
        "ride sit"
    ).split()
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "!", "?", "'", "-"]
    tokens += [w for w in words if w not in tokens]
    tokens += [c for c in letters if c not in tokens]
    tokens += ["##s", "##ing", "##ed", "##er"]
    tokens += ["##" + c for c in letters if "##" + c not in tokens]
    if pad_to:  # BERT-style filler entries, to reach bert-base-uncased's 30,522 for the full-size check
        tokens += [f"[unused{i}]" for i in range(pad_to - len(tokens))]
    assert len(tokens) == len(set(tokens))
    return tokens


def _med_config(vocab_size: int, full_size: bool = False) -> dict:
    """The official med_config.json fields (BLIP's BERT-base config), with tiny sizes unless ``full_size``."""
    if full_size:
        return {**_med_config(vocab_size), **OFFICIAL_TEXT_SIZES}
    return {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": TINY_TEXT_SIZES["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": TINY_TEXT_SIZES["intermediate_size"],
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": 40,
        "model_type": "bert",
        "num_attention_heads": TINY_TEXT_SIZES["num_attention_heads"],
        "num_hidden_layers": TINY_TEXT_SIZES["num_hidden_layers"],
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": vocab_size,
        "encoder_width": 768,  # as in the official file; BLIP overwrites it with the ViT width
        "add_cross_attention": True,
    }


def _images():
    """Deterministic smooth RGB test images (uint8), built from closed-form patterns in float64."""
    import numpy as np

    def pattern(h: int, w: int, k: int) -> np.ndarray:
        y, x = np.meshgrid(np.linspace(0.0, 1.0, h), np.linspace(0.0, 1.0, w), indexing="ij")
        chans = []
        for c in range(3):
            f = 1.0 + k + c
            v = 0.5 + 0.35 * np.sin(2 * np.pi * (f * x + 0.5 * (k + 1) * y) + c) + 0.15 * np.cos(3 * np.pi * y * f)
            chans.append(v)
        img = np.stack(chans, axis=-1)
        # a flat rectangle with sharp edges, where bicubic resizing overshoots
        y0, x0 = h // (3 + k), w // (4 + k)
        img[y0 : y0 + h // 4, x0 : x0 + w // 3, :] = [0.95, 0.1 * k, 0.2]
        return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)

    sizes = [(224, 224), (224, 224), (224, 224), (256, 320), (300, 240)]
    names = SQUARE_IMAGES + OTHER_IMAGES
    return {name: pattern(h, w, k) for k, (name, (h, w)) in enumerate(zip(names, sizes, strict=True))}


def _randomise(model) -> None:
    """Give every parameter a random value of a sensible scale, so that a wrongly mapped weight changes scores.

    Linear/conv weights ~ N(0, 1/fan_in) (keeps activations O(1) through the un-activated MLP head), embeddings
    N(0, 1), LayerNorm weights 1 + 0.2 N(0, 1), all biases and the ViT's class/position embeddings 0.2 N(0, 1).
    """
    import torch

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("bias") or name.endswith("cls_token") or name.endswith("pos_embed"):
                p.copy_(0.2 * noise)
            elif "LayerNorm" in name or "norm" in name.split(".")[-2]:
                p.copy_(1.0 + 0.2 * noise)
            elif "embeddings" in name:
                p.copy_(noise)
            else:
                fan_in = p[0].numel()
                p.copy_(noise / fan_in**0.5)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate(out: Path, full_size: bool = False) -> None:
    """Build the random checkpoint and write the original package's scores (runs inside the old environment).

    ``full_size``: the published architecture (ViT-L/16, BERT-base, the official med_config.json; a 1.9 GB
    checkpoint, for a one-off local check of the default configuration, not for committing) instead of the tiny.
    """
    import importlib.metadata as md

    import ImageReward as RM  # noqa: N814 - the original package's name
    import torch
    from PIL import Image

    ir_module = sys.modules["ImageReward.ImageReward"]
    from ImageReward.models.BLIP import blip as blip_module
    from ImageReward.models.BLIP import blip_pretrain as blip_pretrain_module
    from ImageReward.models.BLIP.vit import VisionTransformer

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    vocab = _vocabulary(pad_to=30522 if full_size else 0)
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    med_config_path = out / "med_config.json"
    med_config_path.write_text(json.dumps(_med_config(len(vocab) + 2, full_size), indent=2) + "\n")

    # --- size-only patches (see the module docstring) ---
    vc = TINY_VISION_CONFIG

    def tiny_create_vit(vit, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
        assert vit == "large" and image_size == vc["image_size"]
        encoder = VisionTransformer(
            img_size=image_size, patch_size=vc["patch_size"], embed_dim=vc["hidden_size"],
            depth=vc["num_hidden_layers"], num_heads=vc["num_attention_heads"],
            mlp_ratio=vc["intermediate_size"] / vc["hidden_size"], drop_path_rate=0.1,
        )
        return encoder, vc["hidden_size"]

    original_bert_tokenizer = blip_module.BertTokenizer

    class LocalBertTokenizer(original_bert_tokenizer):
        @classmethod
        def from_pretrained(cls, name, *args, **kwargs):
            assert name == "bert-base-uncased"
            return original_bert_tokenizer.from_pretrained(str(tok_dir), *args, **kwargs)

    original_mlp = ir_module.MLP
    blip_module.BertTokenizer = LocalBertTokenizer
    if not full_size:
        blip_pretrain_module.create_vit = tiny_create_vit
        ir_module.MLP = lambda input_size: original_mlp(TINY_TEXT_SIZES["hidden_size"])

    # --- random checkpoint in the official format ---
    torch.manual_seed(0)
    model = ir_module.ImageReward(med_config=str(med_config_path), device="cpu")
    _randomise(model)
    state_dict = model.state_dict()
    ckpt_path = out / "ImageReward.pt"
    torch.save(state_dict, ckpt_path)

    # --- load it back through the package's own loader and score through its public API ---
    loaded = RM.load(str(ckpt_path), device="cpu", med_config=str(med_config_path))
    for key, value in state_dict.items():
        assert torch.equal(loaded.state_dict()[key], value), key
    tokenizer = loaded.blip.tokenizer

    raw_outputs = []
    loaded.mlp.register_forward_hook(lambda module, args, output: raw_outputs.append(output.item()))

    images = _images()
    for name, array in images.items():
        Image.fromarray(array).save(out / name, optimize=True)

    def score_all(names):
        rows = []
        for p, prompt in enumerate(PROMPTS):
            for name in names:
                pil = Image.open(out / name)
                raw_outputs.clear()
                with torch.no_grad():
                    score = loaded.score(prompt, pil)
                rows.append({"prompt": p, "image": name, "score": score, "raw": raw_outputs[0]})
        return rows

    input_ids = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35).input_ids
    versions = {
        pkg: md.version(pkg)
        for pkg in ["image-reward", "torch", "torchvision", "transformers", "tokenizers", "timm", "pillow", "numpy"]
    }
    versions["python"] = sys.version.split()[0]
    reference = {
        "about": "Scores of the original image-reward package on a random tiny checkpoint; written by "
        "rewards/scripts/image_reward_reference.py. Do not edit by hand.",
        "versions": versions,
        "mean": loaded.mean,
        "std": loaded.std,
        "vision_config": {} if full_size else TINY_VISION_CONFIG,
        "tokenizer": {
            "dec_token_id": tokenizer.bos_token_id,
            "enc_token_id": tokenizer.enc_token_id,
            "vocab_size": len(tokenizer),
        },
        "checkpoint_sha256": _sha256(ckpt_path),
        "checkpoint_keys": sorted(state_dict),
        "prompts": PROMPTS,
        "input_ids": input_ids,
        "square": score_all(SQUARE_IMAGES),
        "other_sizes": score_all(OTHER_IMAGES),
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


def build_env(env_dir: Path) -> Path:
    """Create the old environment at ``env_dir`` (if absent) and return its python."""
    python = env_dir / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(env_dir)
        # The pins are exact on purpose; a constraints file that caps versions would fight them.
        env = dict(os.environ, PIP_CONSTRAINT="")
        subprocess.run([str(python), "-m", "pip", "install", "-q", *OLD_ENV_REQUIREMENTS], check=True, env=env)
    return python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the test data")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="where to build the old environment")
    parser.add_argument(
        "--full-size", action="store_true",
        help="the published ViT-L/BERT-base sizes (1.9 GB; a local check of the defaults, never committed)",
    )
    parser.add_argument("--in-env", action="store_true", help="internal: run inside the old environment")
    args = parser.parse_args(argv)
    if args.in_env:
        generate(args.out.resolve(), args.full_size)
        return
    python = build_env(args.venv)
    command = [str(python), str(Path(__file__).resolve()), "--in-env", "--out", str(args.out)]
    subprocess.run(command + (["--full-size"] if args.full_size else []), check=True)


if __name__ == "__main__":
    main()
