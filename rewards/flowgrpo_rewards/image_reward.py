"""ImageReward: a BLIP-based human-preference reward, loaded into maintained transformers modules.

ImageReward (Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
NeurIPS 2023, arXiv 2304.05977; code and weights: github.com/THUDM/ImageReward, hub ``THUDM/ImageReward``)
scores an (image, prompt) pair by

1. encoding the image with a BLIP ViT-L/16 at 224 x 224 (the output of its final LayerNorm, all 197 tokens);
2. encoding the prompt with BLIP's BERT-base text encoder, which cross-attends to those image tokens in every
   layer (BLIP's image-grounded text encoder); the prompt is tokenised by ``bert-base-uncased`` with the two
   tokens BLIP adds (``[DEC]`` as ``bos_token``, ``[ENC]`` as an additional special token), padded and truncated
   to 35 tokens;
3. mapping the text encoder's ``[CLS]`` state through a head of five linear layers, 768 → 1024 → 128 → 64 → 16 → 1,
   with no activation between them (the ReLUs are commented out in the original, so the head is affine), to a raw
   score ``r``;
4. normalising: ``score = (r − 0.16717362830052426) / 1.0333394966054072`` (the constants of the original
   ``ImageReward.score``).

The PyPI package ``image-reward`` 1.5 does not import under transformers 5, so this module loads the official
``ImageReward.pt`` (a ``torch.save`` of the original module's state dict) and ``med_config.json`` into
transformers' ``BlipVisionModel`` and ``BlipTextModel`` (``transformers.models.blip``, the ports of BLIP's
``vit.py`` and ``med.py``) by renaming keys (:func:`convert_state_dict`). Parity with the
original package, to 1e-5, is tested against scores it produced on a random checkpoint in the official format
(``rewards/scripts/image_reward_reference.py``).

Preprocessing differs from the original in one documented way (:func:`preprocess`): images arrive as float
tensors, so the resize to 224 is a torch antialiased bicubic resize of the float image instead of PIL's bicubic
resize of an 8-bit image. At 224 x 224 input both are the identity and the scores agree to float rounding.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flowgrpo.rewards.base import BaseReward, hub_weights
from flowgrpo_rewards._clip_common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImagePreprocess, check_resize_backend

logger = logging.getLogger(__name__)

#: Normalisation of the raw head output, from the original ``ImageReward.score`` (THUDM/ImageReward).
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
#: CLIP's per-channel mean and std, which ImageReward's preprocessing uses.
CLIP_MEAN = OPENAI_CLIP_MEAN
CLIP_STD = OPENAI_CLIP_STD
#: Prompts are padded and truncated to this many tokens, [CLS] and [SEP] included.
MAX_PROMPT_TOKENS = 35

DEFAULT_HUB_ID = "THUDM/ImageReward"
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"

#: BLIP's ViT-L/16 at 224 as ImageReward builds it (``create_vit('large', 224)``), in BlipVisionConfig names.
DEFAULT_VISION_CONFIG = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "image_size": 224,
    "patch_size": 16,
}
# Fixed by BLIP's VisionTransformer: LayerNorm eps 1e-6, exact GELU, qkv with bias.
_VISION_FIXED = {"layer_norm_eps": 1e-6, "hidden_act": "gelu"}
# Head: Sequential(Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear); linears at these indices.
_HEAD_LINEAR_INDICES = (0, 2, 4, 6, 7)
# Keys of the official checkpoint that the score does not use (BLIP's contrastive projections, a buffer).
_UNUSED_KEY_PREFIXES = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")

_MISSING_TRANSFORMERS = (
    "the image_reward reward needs transformers >= 4.50 (BLIP modules and BertTokenizer): "
    "pip install 'transformers>=4.50'"
)


def _transformers():
    try:
        import transformers
        from transformers.models.blip.modeling_blip_text import BlipTextModel
    except ImportError as err:  # pragma: no cover - transformers is a core dependency of flowgrpo
        raise ImportError(_MISSING_TRANSFORMERS) from err
    return transformers, BlipTextModel


# ----------------------------------------------------------------------------------------------------------------
# Preprocessing
# ----------------------------------------------------------------------------------------------------------------


def preprocess(images: torch.Tensor, size: int = 224, resize_backend: str = "torch") -> torch.Tensor:
    """ImageReward's image preprocessing, in torch: shorter side to ``size``, centre crop, CLIP normalisation.

    The original (``ImageReward._transform``) applies to a PIL image ``Resize(size, BICUBIC)`` (shorter side to
    ``size``, longer side ``int(size * long / short)``), ``CenterCrop(size)`` (top-left offset
    ``int(round((h - size) / 2))``), ``ToTensor`` and ``Normalize(CLIP mean, CLIP std)``. Here the resize is
    :func:`torch.nn.functional.interpolate` in bicubic mode with ``antialias=True`` (torch's port of PIL's
    resampling filter, cubic coefficient −0.5) on the float image, followed by a clamp to [0, 1] (PIL saturates
    its 8-bit output). What remains different from PIL: PIL resamples 8-bit pixels and rounds its output to 8 bits.
    An image already ``size`` pixels on its shorter side is not resampled, exactly as in the original.
    ``resize_backend="pil"`` runs the original's own 8-bit PIL resize instead (exact; CPU, not differentiable).

    Args:
        images: (B, 3, H, W) float tensor in [0, 1].
        size: output side, the ViT's input size (224 for ImageReward).
        resize_backend: ``"torch"`` or ``"pil"`` (see :class:`~flowgrpo_rewards._clip_common.ImagePreprocess`).

    Returns:
        (B, 3, size, size) float32 tensor, normalised with CLIP's mean and std, on ``images``' device.
    """
    # torchvision's Resize + CenterCrop: shortest edge, rounded crop offset; 8-bit PIL resize: clamp afterwards
    return ImagePreprocess(size=size, mean=CLIP_MEAN, std=CLIP_STD, crop_offset="round",
                           resize_backend=resize_backend)(images)


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageRewardOutput:
    """Scores of a batch of (image, prompt) pairs.

    Attributes:
        raw: (B,) float32, the head's output ``r``.
        score: (B,) float32, the published normalised score ``(r − IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD``.
    """

    raw: torch.Tensor
    score: torch.Tensor


class ImageRewardModel(nn.Module):
    """ImageReward's network in transformers' BLIP modules: ViT, image-grounded BERT text encoder, linear head.

    Args:
        vision_config: a :class:`transformers.BlipVisionConfig` (BLIP ViT; ViT-L/16 at 224 for ImageReward).
        text_config: a :class:`transformers.BlipTextConfig` with ``is_decoder=True`` (which is what builds the
            cross-attention layers in transformers' port) and ``encoder_hidden_size`` equal to the ViT width.
        head_sizes: widths of the head's linear layers, input first (``(768, 1024, 128, 64, 16, 1)``).
    """

    def __init__(self, vision_config, text_config, head_sizes: tuple[int, ...]):
        super().__init__()
        transformers, BlipTextModel = _transformers()
        if text_config.encoder_hidden_size != vision_config.hidden_size:
            raise ValueError(
                f"text_config.encoder_hidden_size ({text_config.encoder_hidden_size}) must equal the ViT width "
                f"({vision_config.hidden_size})"
            )
        if head_sizes[0] != text_config.hidden_size or head_sizes[-1] != 1:
            raise ValueError(f"head_sizes must go from the text width {text_config.hidden_size} to 1, got {head_sizes}")
        self.vision_model = transformers.BlipVisionModel(vision_config)
        self.text_encoder = BlipTextModel(text_config, add_pooling_layer=False)
        self.head = nn.ModuleList(nn.Linear(a, b) for a, b in zip(head_sizes[:-1], head_sizes[1:], strict=True))

    @property
    def image_size(self) -> int:
        return int(self.vision_model.config.image_size)

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> ImageRewardOutput:
        """Score preprocessed images against tokenised prompts (differentiable).

        Args:
            pixel_values: (B, 3, S, S) float, output of :func:`preprocess` (S = the ViT's image size).
            input_ids: (B, L) int64 token ids, L ≤ the text encoder's position count (35 for ImageReward).
            attention_mask: (B, L) int64, 1 for tokens, 0 for padding.

        Returns:
            :class:`ImageRewardOutput` with (B,) float32 ``raw`` and ``score``.
        """
        dtype = self.vision_model.embeddings.patch_embedding.weight.dtype
        image_embeds = self.vision_model(pixel_values=pixel_values.to(dtype)).last_hidden_state  # (B, 1+N, Dv)
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_atts,
            is_decoder=False,  # bidirectional self-attention: BLIP's image-grounded text *encoder*
        ).last_hidden_state  # (B, L, Dt)
        x = text[:, 0, :].float()  # [CLS]; the original also moves to float32 before its head
        for linear in self.head:
            x = linear(x)  # no activation: the original's ReLUs are commented out
        raw = x[:, 0]
        return ImageRewardOutput(raw=raw, score=(raw - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD)


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def _vision_key(key: str) -> str | None:
    """Map one ``blip.visual_encoder.*`` key of BLIP's ViT to BlipVisionModel's name (None if unknown)."""
    rest = key[len("blip.visual_encoder.") :]
    fixed = {
        "cls_token": "embeddings.class_embedding",
        "pos_embed": "embeddings.position_embedding",
        "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
        "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
        "norm.weight": "post_layernorm.weight",
        "norm.bias": "post_layernorm.bias",
    }
    if rest in fixed:
        return "vision_model." + fixed[rest]
    parts = rest.split(".")  # blocks.{i}.{module}.{param} or blocks.{i}.{module}.{sub}.{param}
    if parts[0] != "blocks" or len(parts) < 4:
        return None
    module = {
        "norm1": "layer_norm1",
        "norm2": "layer_norm2",
        "attn.qkv": "self_attn.qkv",
        "attn.proj": "self_attn.projection",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }.get(".".join(parts[2:-1]))
    if module is None:
        return None
    return f"vision_model.encoder.layers.{parts[1]}.{module}.{parts[-1]}"


def convert_state_dict(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename the keys of an official ``ImageReward.pt`` state dict to :class:`ImageRewardModel`'s.

    ``blip.visual_encoder.*`` (BLIP's timm-style ViT) → ``vision_model.*`` (BlipVisionModel: ``cls_token`` →
    ``embeddings.class_embedding``, ``blocks.i.attn.proj`` → ``encoder.layers.i.self_attn.projection``, final
    ``norm`` → ``post_layernorm`` …); ``blip.text_encoder.*`` (BLIP's ``med.py`` BERT) → ``text_encoder.*``
    (same names in transformers' port); ``mlp.layers.{0,2,4,6,7}.*`` → ``head.{0..4}.*``.

    Returns:
        (converted state dict, keys that were left out: the unused ``vision_proj``/``text_proj``, the
        ``position_ids`` buffer and anything unrecognised).
    """
    head_index = {str(i): str(j) for j, i in enumerate(_HEAD_LINEAR_INDICES)}
    converted: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for key, value in state_dict.items():
        new = None
        if key.startswith(_UNUSED_KEY_PREFIXES):
            new = None
        elif key.startswith("blip.visual_encoder."):
            new = _vision_key(key)
        elif key.startswith("blip.text_encoder."):
            new = "text_encoder." + key[len("blip.text_encoder.") :]
        elif key.startswith("mlp.layers."):
            index, _, param = key[len("mlp.layers.") :].partition(".")
            new = f"head.{head_index[index]}.{param}" if index in head_index else None
        if new is None:
            dropped.append(key)
        else:
            converted[new] = value
    return converted, dropped


def _resolve_files(model: str, checkpoint_file: str, med_config_file: str) -> tuple[Path, Path]:
    """Local paths of ``ImageReward.pt`` and ``med_config.json`` for a hub id, a folder or a ``.pt`` file."""
    path = Path(model).expanduser()
    if path.is_dir():
        ckpt, med = path / checkpoint_file, path / med_config_file
    elif path.is_file():
        ckpt, med = path, path.parent / med_config_file
    elif model.startswith(("/", "./", "../", "~")) or model.endswith(".pt") or model.count("/") != 1:
        raise FileNotFoundError(
            f"ImageReward model {model!r} is neither an existing folder or .pt file nor a hub id 'owner/name'"
        )
    else:
        from huggingface_hub import hf_hub_download

        ckpt = Path(hf_hub_download(repo_id=model, filename=checkpoint_file))
        med = Path(hf_hub_download(repo_id=model, filename=med_config_file))
    for file in (ckpt, med):
        if not file.is_file():
            raise FileNotFoundError(f"ImageReward file {str(file)!r} not found (model={model!r})")
    return ckpt, med


def _vision_config(overrides: dict | None):
    transformers, _ = _transformers()
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(DEFAULT_VISION_CONFIG))
    if unknown:
        raise ValueError(f"unknown vision_config keys {unknown}; allowed: {sorted(DEFAULT_VISION_CONFIG)}")
    values = {**DEFAULT_VISION_CONFIG, **overrides}
    if "intermediate_size" not in overrides and "hidden_size" in overrides:
        values["intermediate_size"] = 4 * values["hidden_size"]  # BLIP's ViT: mlp_ratio 4
    return transformers.BlipVisionConfig(**values, **_VISION_FIXED)


def _text_config(med_config: dict, vision_width: int, path: Path):
    """BlipTextConfig from BLIP's ``med_config.json`` (a BertConfig with ``add_cross_attention``)."""
    transformers, _ = _transformers()
    if not med_config.get("add_cross_attention", False):
        raise ValueError(f"{path}: ImageReward's text encoder needs 'add_cross_attention': true")
    if med_config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{path}: only absolute position embeddings are supported")
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
    missing = [k for k in required if k not in med_config]
    if missing:
        raise ValueError(f"{path}: missing fields {missing}")
    # BLIP_Pretrain overwrites the file's encoder_width with the ViT's width, so it is ignored here.
    return transformers.BlipTextConfig(
        vocab_size=med_config["vocab_size"],
        hidden_size=med_config["hidden_size"],
        encoder_hidden_size=vision_width,
        intermediate_size=med_config["intermediate_size"],
        num_hidden_layers=med_config["num_hidden_layers"],
        num_attention_heads=med_config["num_attention_heads"],
        max_position_embeddings=med_config.get("max_position_embeddings", 512),
        hidden_act=med_config.get("hidden_act", "gelu"),
        layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
        pad_token_id=med_config.get("pad_token_id", 0),
        bos_token_id=None,  # generation-only ids, unused by the encoder
        eos_token_id=None,
        sep_token_id=None,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,  # builds the cross-attention layers; forward runs with is_decoder=False
    )


def load_image_reward(
    model: str = DEFAULT_HUB_ID,
    vision_config: dict | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    checkpoint_file: str = CHECKPOINT_FILE,
    med_config_file: str = MED_CONFIG_FILE,
) -> ImageRewardModel:
    """Load an official-format ImageReward checkpoint into :class:`ImageRewardModel`.

    Args:
        model: a hub id (``"THUDM/ImageReward"``, downloaded with ``huggingface_hub``), a local folder holding
            ``checkpoint_file`` and ``med_config_file``, or the path of a ``.pt`` file with ``med_config_file``
            beside it.
        vision_config: overrides of :data:`DEFAULT_VISION_CONFIG` (ViT-L/16 at 224, the only ViT ImageReward
            builds); for tiny test checkpoints. Keys: ``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``intermediate_size`` (default 4 × ``hidden_size``), ``image_size``,
            ``patch_size``.
        device: where the model goes.
        dtype: dtype of the ViT and text encoder (the head always runs in float32, as in the original).

    Returns:
        The model in eval mode.

    Raises:
        FileNotFoundError: ``model`` is not a folder, file or hub id, or a file is missing.
        ValueError: an unknown ``vision_config`` key, a ``med_config.json`` this architecture cannot take, or a
            checkpoint whose tensors do not fit the architecture (missing keys, wrong shapes).
    """
    ckpt_path, med_path = _resolve_files(model, checkpoint_file, med_config_file)
    vcfg = _vision_config(vision_config)
    tcfg = _text_config(json.loads(med_path.read_text()), vcfg.hidden_size, med_path)

    state_dict = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    converted, dropped = convert_state_dict(state_dict)
    if dropped:
        logger.info("image_reward: %d checkpoint tensors not used by the score: %s", len(dropped), dropped[:8])
    head_sizes = _head_sizes(converted, ckpt_path)

    with torch.device("meta"):  # no random init of ~450 M parameters that are overwritten next
        net = ImageRewardModel(vcfg, tcfg, head_sizes)
    expected = net.state_dict()
    _check_fits(converted, expected, ckpt_path)
    net.load_state_dict({k: converted[k].float() for k in expected}, strict=True, assign=True)
    # the one non-persistent buffer is not in the checkpoint: rebuild it off the meta device
    emb = net.text_encoder.embeddings
    emb.position_ids = torch.arange(tcfg.max_position_embeddings).expand((1, -1))
    net.vision_model.to(dtype)
    net.text_encoder.to(dtype)
    return net.to(device).eval()


def _head_sizes(converted: dict, ckpt_path) -> tuple[int, ...]:
    """The widths of the score head of the converted checkpoint ``converted``: its input, then each linear
    layer's output.

    Raises:
        ValueError: not the head's linear layers (not an ImageReward checkpoint).
    """
    head_keys = sorted(k for k in converted if k.startswith("head.") and k.endswith(".weight"))
    if len(head_keys) != len(_HEAD_LINEAR_INDICES):
        raise ValueError(
            f"{ckpt_path}: expected the head mlp.layers.{{{','.join(map(str, _HEAD_LINEAR_INDICES))}}}.weight, "
            f"found {len(head_keys)} of them; is this an ImageReward checkpoint?"
        )
    return (converted["head.0.weight"].shape[1], *(converted[k].shape[0] for k in head_keys))


def _check_fits(converted: dict, expected: dict, ckpt_path) -> None:
    """Check that the converted checkpoint's tensors are exactly the model's (``expected``: its state dict), shape
    for shape.

    Raises:
        ValueError: missing tensors, shapes that differ, or tensors the architecture does not have (the first 5).
    """
    missing = sorted(set(expected) - set(converted))
    if missing:
        raise ValueError(f"{ckpt_path}: {len(missing)} tensors missing for this architecture, e.g. {missing[:5]}")
    wrong = [
        f"{k}: checkpoint {tuple(converted[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if converted[k].shape != v.shape
    ]
    if wrong:
        raise ValueError(f"{ckpt_path}: tensors do not fit the architecture (check vision_config): {wrong[:5]}")
    unexpected = sorted(set(converted) - set(expected))
    if unexpected:
        raise ValueError(f"{ckpt_path}: tensors this architecture does not have: {unexpected[:5]}")


def load_tokenizer(name_or_path: str = "bert-base-uncased"):
    """BERT tokenizer as BLIP builds it (``init_tokenizer``): ``[DEC]`` as ``bos_token``, ``[ENC]`` added.

    Args:
        name_or_path: hub id or folder with ``vocab.txt`` (``bert-base-uncased`` for the official model).

    Returns:
        A transformers ``BertTokenizer``; ``len(tokenizer)`` is the vocabulary size of ``med_config.json``.
    """
    transformers, _ = _transformers()
    tokenizer = transformers.BertTokenizer.from_pretrained(name_or_path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# The reward plugin
# ----------------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ImageReward(BaseReward):
    """The ``image_reward`` reward: ImageReward's normalised human-preference score of each (image, prompt).

    Score ``(r − 0.16717362830052426) / 1.0333394966054072`` with ``r`` the ImageReward head's output (Xu et al.,
    NeurIPS 2023; see the module docstring for the architecture). No metadata is used.

    Args:
        model: hub id, folder or ``.pt`` path (see :func:`load_image_reward`); default ``THUDM/ImageReward``.
        tokenizer: hub id or folder of the BERT tokenizer; default ``bert-base-uncased``.
        vision_config: ViT size overrides for tiny test checkpoints (see :func:`load_image_reward`).
        dtype: ``"float32"`` (default, as published), ``"bfloat16"`` or ``"float16"`` for the encoders.
        batch_size: pairs per forward pass.
        resize_backend: ``"torch"`` (default: antialiased resize of the float tensor on the device, within the
            bounds of ``docs/rewards.md`` of the original) or ``"pil"`` (the original's own 8-bit PIL resize,
            exact, on the CPU).

    Raises:
        ValueError: an unknown ``dtype``, ``batch_size`` < 1; in :meth:`setup`, as :func:`load_image_reward`, or a
            tokenizer whose size does not match the checkpoint's vocabulary; at scoring, images outside [0, 1] or
            not finite.
        FileNotFoundError: in :meth:`setup`, a checkpoint or config that cannot be found.
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "image_reward"

    def __init__(
        self,
        model: str = DEFAULT_HUB_ID,
        tokenizer: str = "bert-base-uncased",
        vision_config: dict | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
        resize_backend: str = "torch",
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"image_reward dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"image_reward batch_size must be >= 1, got {batch_size}")
        self.model_name = os.fspath(model)
        self.tokenizer_name = os.fspath(tokenizer)
        self.vision_config = dict(vision_config) if vision_config else None
        self.dtype = _DTYPES[dtype]
        self.batch_size = batch_size
        self.resize_backend = check_resize_backend(resize_backend)
        self.model: ImageRewardModel | None = None
        self.tokenizer = None

    def setup(self, device: torch.device) -> None:
        """Load the tokenizer and the checkpoint onto ``device``; raises as :func:`load_image_reward` does."""
        super().setup(device)
        with hub_weights(self.name, "tokenizer", self.tokenizer_name):
            self.tokenizer = load_tokenizer(self.tokenizer_name)
        with hub_weights(self.name, "model", self.model_name, [CHECKPOINT_FILE, MED_CONFIG_FILE]):
            self.model = load_image_reward(self.model_name, self.vision_config, self.device, self.dtype)
        vocab = self.model.text_encoder.config.vocab_size
        if len(self.tokenizer) != vocab:
            raise ValueError(
                f"tokenizer {self.tokenizer_name!r} has {len(self.tokenizer)} tokens with [DEC] and [ENC] added, "
                f"but the checkpoint's vocabulary has {vocab}"
            )

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 35) int64 ``input_ids`` and ``attention_mask``, padded and truncated as the original does."""
        enc = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        )
        return enc["input_ids"], enc["attention_mask"]

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Score (B, 3, H, W) float images in [0, 1] against their prompts; returns (B,) float32 on the CPU."""
        if self.model is None:
            raise RuntimeError("ImageReward.setup(device) must be called before scoring")
        if not torch.isfinite(images).all() or images.min() < 0.0 or images.max() > 1.0:
            raise ValueError(
                f"image_reward images must be finite and in [0, 1], got range "
                f"[{images.min().item():.4g}, {images.max().item():.4g}]"
            )
        input_ids, attention_mask = self.tokenize(prompts)
        out = []
        for start in range(0, images.shape[0], self.batch_size):
            stop = start + self.batch_size
            pixels = preprocess(images[start:stop].to(self.device), self.model.image_size, self.resize_backend)
            ids, mask = input_ids[start:stop].to(self.device), attention_mask[start:stop].to(self.device)
            result = self.model(pixels, ids, mask)
            out.append(result.score.float().cpu())
        return torch.cat(out)
