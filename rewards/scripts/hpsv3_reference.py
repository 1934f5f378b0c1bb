"""Reference HPSv3 scores from the official ``hpsv3`` package, for flowgrpo's parity test.

HPSv3 (Ma et al., "HPSv3: Towards Wide-Spectrum Human Preference Score", ICCV 2025, arXiv 2508.03789; code
github.com/MizzenAI/HPSv3, weights hub ``MizzenAI/HPSv3``) ships as the PyPI package ``hpsv3`` 1.0.0, which pins
``transformers==4.45.2`` (flowgrpo needs transformers >= 5 elsewhere) and pulls in trl, deepspeed and datasets. This
script computes, once, what that official package says about a small random checkpoint, so that
``rewards/tests/test_hpsv3.py`` can check flowgrpo's own loader (:mod:`flowgrpo_rewards.hpsv3`) against it without
the old package.

It runs in two stages:

1. With any Python (``python rewards/scripts/hpsv3_reference.py``) it builds a separate virtual environment
   (default ``/tmp/hpsv3_ref_env``) holding the official package and the old libraries it works with
   (:data:`OLD_ENV_REQUIREMENTS`; ``hpsv3`` itself without its dependencies, since deepspeed and the training-only
   ones are not needed to score), then re-runs itself there with ``--in-env``.
2. Inside that environment it writes into ``--out`` (default ``rewards/tests/data/hpsv3``):

   * ``base/``: the files of a base Qwen2-VL folder that scoring reads (the role ``Qwen/Qwen2-VL-7B-Instruct``
     plays for the released model): ``config.json`` with tiny sizes, a small byte-level BPE tokenizer with
     Qwen2-VL's special tokens, its ``preprocessor_config.json`` (the released values: 14-pixel patches, merge 2,
     min/max pixels 3136 / 12,845,056, CLIP mean/std) and Qwen2-VL-Instruct's chat template. The base model's own
     weights, which the package loads before it overwrites every one of them with the checkpoint, are written to a
     temporary folder only.
   * ``HPSv3.safetensors``: the state dict of the package's ``Qwen2VLRewardModelBT`` with random weights, built by
     the package's own ``create_model_and_processor`` from its released ``HPSv3_7B.yaml`` settings (ranknet head,
     2 outputs, the ``<|Reward|>`` token), i.e. the official checkpoint format (keys ``visual.*``, ``model.*``,
     ``lm_head.*``, ``rm_head.*``).
   * ``img*.png``: deterministic test images, two at 448 x 448 (the size the package resizes every image to:
     256 x 28 x 28 pixels) and two of other sizes.
   * ``reference.json``: the token ids, and the (mu, sigma) the package's ``HPSv3RewardInferencer.reward`` returns for
     each (prompt, image) pair, and the versions of the libraries used.

Nothing of the package is patched: the inferencer is given a config file that is the released ``HPSv3_7B.yaml``
with ``model_name_or_path`` pointing at the tiny base folder and float32 instead of bfloat16 (so that the
comparison is about the formula, not bfloat16 rounding).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "rewards" / "tests" / "data" / "hpsv3"
DEFAULT_VENV = Path("/tmp/hpsv3_ref_env")

# A resolvable set for Python 3.11 (torch 2.14.1 + torchvision 0.29.1 install from local wheels here). hpsv3 1.0.0
# pins transformers 4.45.2; its inference imports trl (RewardTrainer, whose import needs rich), peft, fire,
# omegaconf, pandas, matplotlib, tensorboard and datasets (pyarrow < 17 for numpy 1.x).
OLD_ENV_REQUIREMENTS = [
    "torch==2.14.1", "torchvision==0.29.1", "transformers==4.45.2", "tokenizers==0.20.3", "huggingface-hub==0.25.2",
    "accelerate==0.34.2", "peft==0.13.2", "trl==0.11.4", "datasets==3.0.1", "pyarrow==16.1.0", "numpy<2", "fire",
    "omegaconf", "pandas", "matplotlib", "tensorboard", "rich", "safetensors", "pillow", "requests",
]
PACKAGE = "hpsv3==1.0.0"

#: Qwen2-VL's special tokens, in the released tokenizer's order (``<|endoftext|>`` is the padding token).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
#: Qwen2's pre-tokenizer split pattern (its tokenizer.json).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
#: Qwen2-VL-Instruct's chat template (its chat_template.json).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Tiny sizes. Text width 32 (2 heads of 16, M-RoPE sections summing to 8), vision width 24 (another width, so that
# a merger wired to the wrong one cannot load). vocab_size above the tokenizer's length, as in the released config
# (152,064 rows for 151,657 tokens), so the package's resize_token_embeddings shrinks it as it does the real one.
TINY_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
             "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "hidden_act": "silu"}
TINY_VISION = {"depth": 2, "embed_dim": 24, "hidden_size": 32, "hidden_act": "quick_gelu", "mlp_ratio": 2,
               "num_heads": 2, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
               "temporal_patch_size": 2}
#: The released Qwen2-VL image processor settings (preprocessor_config.json of Qwen2-VL-7B-Instruct).
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}

PROMPTS = [
    "a red cat sitting on the table",
    "An astronaut riding a green horse, oil painting",
    "Café, dogs & photos!!",
]
SQUARE_IMAGES = ["img0_448x448.png", "img1_448x448.png"]
OTHER_IMAGES = ["img2_512x512.png", "img3_300x500.png"]  # H x W


def _images():
    """Deterministic smooth RGB test images (uint8) with a sharp-edged rectangle, from closed-form patterns."""
    import numpy as np

    def pattern(h: int, w: int, k: int) -> np.ndarray:
        y, x = np.meshgrid(np.linspace(0.0, 1.0, h), np.linspace(0.0, 1.0, w), indexing="ij")
        chans = [0.5 + 0.35 * np.sin(2 * np.pi * ((1 + k + c) * x + 0.5 * (k + 1) * y) + c)
                 + 0.15 * np.cos(3 * np.pi * y * (1 + k + c)) for c in range(3)]
        img = np.stack(chans, axis=-1)
        y0, x0 = h // (3 + k), w // (4 + k)
        img[y0 : y0 + h // 4, x0 : x0 + w // 3, :] = [0.95, 0.1 * k, 0.2]
        return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)

    sizes = [(448, 448), (448, 448), (512, 512), (300, 500)]
    names = SQUARE_IMAGES + OTHER_IMAGES
    return {name: pattern(h, w, k) for k, (name, (h, w)) in enumerate(zip(names, sizes, strict=True))}


def _tokenizer():
    """A byte-level BPE ``Qwen2TokenizerFast`` trained on HPSv3's instruction text and the prompts, with Qwen2-VL's
    special tokens (so the chat template's text has the structure, though not the token count, of the real one)."""
    from hpsv3.dataset.data_collator_qwen import INSTRUCTION, prompt_with_special_token
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    texts = [INSTRUCTION, prompt_with_special_token, "You are a helpful assistant.", "system user assistant",
             *PROMPTS]
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()  # Qwen2's tokenizer.json pipeline: NFC, its split regex, byte level
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return Qwen2TokenizerFast(tokenizer_object=bpe, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[1:],
                              model_max_length=32768)


def _base_folder(folder: Path) -> None:
    """Write the tiny base Qwen2-VL folder (random weights included: the package's ``from_pretrained`` needs them)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor

    tok = _tokenizer()
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                     "<|endoftext|>", "<|im_end|>"])
    config = Qwen2VLConfig(**TINY_TEXT, vocab_size=len(tok) + 7, vision_config=TINY_VISION,
                           vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                           video_token_id=ids[3], bos_token_id=ids[4], eos_token_id=ids[5], pad_token_id=ids[4],
                           torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**PREPROCESSOR), tokenizer=tok,
                                 chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)


def _config_file(path: Path, base: Path) -> None:
    """The released ``HPSv3_7B.yaml`` with the tiny base folder and float32 (nothing else changed)."""
    import yaml
    from hpsv3.inference import _MODEL_CONFIG_PATH

    cfg = yaml.safe_load((Path(_MODEL_CONFIG_PATH) / "HPSv3_7B.yaml").read_text())
    cfg.update({"model_name_or_path": str(base), "torch_dtype": "float32", "bf16": False, "deepspeed": None,
                "disable_flash_attn2": True})
    path.write_text(yaml.safe_dump(cfg))


def _randomise(model) -> None:
    """Random values of a sensible scale for every parameter, so that a wrongly mapped weight changes the scores:
    weights N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + 0.2 N(0, 1), biases 0.2 N(0, 1)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p[0].numel() ** 0.5)


def generate(out: Path) -> None:
    """Build the random checkpoint and write the package's scores (runs inside the old environment)."""
    import importlib.metadata as md

    import safetensors.torch
    import torch
    from hpsv3 import HPSv3RewardInferencer
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import DataConfig, ModelConfig, PEFTLoraConfig, TrainingConfig, parse_args_with_yaml
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        _base_folder(base)
        config_path = Path(tmp) / "HPSv3_tiny.yaml"
        _config_file(config_path, base)

        # --- random checkpoint in the official format, built by the package itself ---
        (_, training_args, model_config, peft_config), _ = parse_args_with_yaml(
            (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(config_path), is_train=False)
        model, _, _ = create_model_and_processor(model_config, peft_config, training_args)
        _randomise(model)
        state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
        ckpt = out / "HPSv3.safetensors"
        safetensors.torch.save_file(state_dict, str(ckpt))

        # --- score through the package's public API ---
        inferencer = HPSv3RewardInferencer(config_path=str(config_path), checkpoint_path=str(ckpt), device="cpu")
        images = _images()
        for name, array in images.items():
            Image.fromarray(array).save(out / name, optimize=True)

        def score(names: list[str], prompts: list[int]) -> list[dict]:
            with torch.no_grad():
                logits = inferencer.reward([str(out / n) for n in names], [PROMPTS[p] for p in prompts])
            batch = inferencer.prepare_batch([str(out / n) for n in names], [PROMPTS[p] for p in prompts])
            return [{"prompt": p, "image": n, "mu": float(row[0]), "sigma": float(row[1]),
                     "input_ids": [int(i) for i, m in zip(ids, mask, strict=True) if m]}
                    for n, p, row, ids, mask in zip(names, prompts, logits, batch["input_ids"].tolist(),
                                                   batch["attention_mask"].tolist(), strict=True)]

        # one batch of every (prompt, square image) pair (padded to its longest prompt), then each other size alone
        pairs = [(n, p) for p in range(len(PROMPTS)) for n in SQUARE_IMAGES]
        square = score([n for n, _ in pairs], [p for _, p in pairs])
        other = [row for n in OTHER_IMAGES for p in range(len(PROMPTS)) for row in score([n], [p])]
        special = inferencer.processor.tokenizer.convert_tokens_to_ids("<|Reward|>")

        for f in base.iterdir():  # the base folder minus its weights, which scoring never reads
            if f.suffix not in (".safetensors",) and f.name != "generation_config.json":
                (out / "base").mkdir(exist_ok=True)
                shutil.copy(f, out / "base" / f.name)

    versions = {pkg: md.version(pkg) for pkg in ["hpsv3", "torch", "transformers", "tokenizers", "pillow", "numpy"]}
    versions["python"] = sys.version.split()[0]
    reference = {
        "about": "HPSv3 (mu, sigma) of the official hpsv3 package on a random tiny checkpoint; written by "
                 "rewards/scripts/hpsv3_reference.py. Do not edit by hand.",
        "versions": versions,
        "checkpoint_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest(),
        "checkpoint_keys": sorted(state_dict),
        "reward_token_id": special,
        "prompts": PROMPTS,
        "square": square,
        "other_sizes": other,
    }
    (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")


def build_env(env_dir: Path) -> Path:
    """Create the old environment at ``env_dir`` (if absent) and return its python."""
    python = env_dir / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(env_dir)
        env = dict(os.environ, PIP_CONSTRAINT="")
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, *OLD_ENV_REQUIREMENTS], check=True, env=env)
        subprocess.run([*pip, "--no-deps", PACKAGE], check=True, env=env)
    return python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the test data")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="where to build the old environment")
    parser.add_argument("--in-env", action="store_true", help="internal: run inside the old environment")
    args = parser.parse_args(argv)
    if args.in_env:
        generate(args.out.resolve())
        return
    python = build_env(args.venv)
    subprocess.run([str(python), str(Path(__file__).resolve()), "--in-env", "--out", str(args.out)], check=True)


if __name__ == "__main__":
    main()
