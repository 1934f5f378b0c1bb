"""Shared pieces of the CLIP-family rewards (HPSv2, PickScore, CLIP score, aesthetic).

* :func:`resolve_file` and :func:`open_clip_model_name` turn "a hub id or a local path" into something the
  official loaders accept.
* :class:`ImagePreprocess` is the published CLIP preprocessing (resize, center-crop or pad, normalise) written
  with torch ops, so it runs on a whole (B, 3, H, W) batch on any device and never leaves the tensor world.
* :func:`load_hf_clip` and :func:`load_open_clip` load the two checkpoint formats in use (transformers'
  ``CLIPModel`` folders, open_clip models and state dicts), each with an optional architecture override so
  tests can build tiny random models of the same family.

Preprocessing and the reference implementations
-----------------------------------------------
Two kinds of reference pipeline exist, and :class:`ImagePreprocess` reproduces each one's arithmetic:

* **8-bit PIL pipelines** (transformers' ``CLIPImageProcessor``: PickScore, openai CLIP score, aesthetic;
  open_clip's ``image_transform``: DFN5B): the generated image is saved as an 8-bit PIL image and resized
  with PIL's bicubic filter, which clamps to [0, 255]. Here the resize is
  ``torch.nn.functional.interpolate(..., antialias=True)`` on the float tensor, whose bicubic kernel
  (a = -0.5, support widened when downsampling) is PIL's, then a clamp to [0, 1] (``clamp_after_resize``).
  PIL resizes in two separable passes through an 8-bit intermediate; this path keeps floats, so the two
  differ after a resize: measured about 1/255 on smooth images, up to 20/255 on sharp edges (black/white
  blocks) and 22/255 on pixel noise (256 -> 224); ``docs/rewards.md`` gives the effect on each reward's score.
  ``resize_backend="pil"`` runs PIL's own resize on the 8-bit image instead and is exact.
  Images already at the model's size are not resampled at all, so there the paths agree up to the 8-bit
  quantisation the reference applies (exactly, for images on the 8-bit grid).
* **float-tensor pipelines** (HPSv2's ``preprocess_val``: ``ToTensor`` of the 8-bit image first, then a
  bicubic resize of the float tensor; Flow-GRPO's CLIP score: torchvision ``Resize`` on the float tensor): the
  resize is the same torch call and nothing is clamped (``clamp_after_resize=False``), so bicubic overshoot
  below 0 and above 1 is kept as the reference keeps it; these agree to float rounding (HPSv2: for images on
  the 8-bit grid).

Center crops: transformers' ``center_crop`` takes the floor offset ``(H - h) // 2``; torchvision's
``CenterCrop`` (openai ``clip``, open_clip's ``shortest`` mode, Flow-GRPO's CLIP score) takes
``int(round((H - h) / 2))`` with Python's round-half-to-even, which is one pixel further only when the margin
``H - h`` is 3 mod 4 (``(H - h) / 2`` = k + 0.5 with k odd): 1216x832 and 1344x704 resized to a 224 short edge
have margins 103 and 203. ``crop_offset`` picks the rule. Square images resized to a square input are never
cropped.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowgrpo.images import to_uint8
from flowgrpo.rewards.base import hub_weights, is_local_path

logger = logging.getLogger(__name__)

#: Mean and std of the openai CLIP training data (openai/CLIP ``clip/clip.py``; also open_clip's defaults).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

RESIZE_MODES = ("shortest", "longest", "squash")
INTERPOLATIONS = ("bicubic", "bilinear")
CROP_OFFSETS = ("floor", "round")
RESIZE_BACKENDS = ("torch", "pil")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` (or a ``torch.dtype``) to a torch dtype; ``ValueError`` else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_resize_backend(value: Any) -> str:
    """Return ``value`` if it is one of :data:`RESIZE_BACKENDS` (``"torch"``, ``"pil"``), else raise ``ValueError``."""
    if value not in RESIZE_BACKENDS:
        raise ValueError(f"resize_backend must be one of {list(RESIZE_BACKENDS)}, got {value!r}")
    return value


def check_positive_int(value: Any, name: str) -> int:
    """Return ``value`` if it is an int >= 1, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------------
# Checkpoint locations
# ----------------------------------------------------------------------------------------------------------


def resolve_file(spec: str, filename: str, what: str, *, reward: str = "reward", key: str = "checkpoint") -> str:
    """Find one checkpoint file given a local file, a local folder or a Hugging Face hub repo id.

    Args:
        spec: a path to the file itself, a folder holding ``filename``, or a hub repo id (``org/name``) from
            which ``filename`` is downloaded with ``huggingface_hub.hf_hub_download`` (cached).
        filename: the file's name inside a folder or hub repo.
        what: words for error messages (``"HPSv2 checkpoint"``).
        reward, key: the reward's name and the keyword argument that takes ``spec``, for the
            :class:`~flowgrpo.rewards.base.MissingWeightsError` message.

    Returns:
        The local path of the file.

    Raises:
        FileNotFoundError: ``spec`` is a local path that does not exist, or a folder without ``filename``.
        MissingWeightsError: the hub download failed (offline, unknown repo); one line with the ``hf download``
            command and the config key that takes the local path.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{what}: expected a local path or a hub repo id, got {spec!r}")
    path = Path(spec).expanduser()
    if path.is_file():
        return str(path)
    if path.is_dir():
        candidate = path / filename
        if candidate.is_file():
            return str(candidate)
        present = sorted(p.name for p in path.iterdir())[:20]
        raise FileNotFoundError(f"{what}: folder {path} has no file {filename!r} (it holds {present})")
    if is_local_path(spec):
        raise FileNotFoundError(f"{what}: no file or folder at {spec!r}")
    from huggingface_hub import hf_hub_download

    with hub_weights(reward, key, spec, [filename]):
        try:
            return hf_hub_download(repo_id=spec, filename=filename)
        except OSError:
            raise
        except Exception as err:  # e.g. an invalid repo id (ValueError): also "cannot get it from the hub"
            raise OSError(f"{what}: {err}") from err


def open_clip_model_name(spec: str) -> str:
    """Turn a hub id or a local folder into open_clip's ``hf-hub:ID`` / ``local-dir:PATH`` model name."""
    if spec.startswith(("hf-hub:", "local-dir:")):
        return spec
    path = Path(spec).expanduser()
    if path.is_dir():
        return f"local-dir:{path}"
    if is_local_path(spec):
        raise FileNotFoundError(f"open_clip model folder {spec!r} does not exist")
    return f"hf-hub:{spec}"


# ----------------------------------------------------------------------------------------------------------
# Preprocessing with torch ops
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImagePreprocess:
    """The CLIP image preprocessing of a model's official release, applied to float tensors.

    Attributes:
        size: (h, w) of the model input.
        mean, std: per-channel normalisation, applied as ``(x - mean) / std`` to pixels in [0, 1].
        resize_mode: how the image reaches ``size``:

            * ``"shortest"``: resize so the shortest edge is ``shortest_edge`` (the long edge becomes
              ``int(shortest_edge * long / short)``), then center-crop ``size``. transformers'
              ``CLIPImageProcessor``, openai ``clip``, open_clip's default.
            * ``"longest"``: resize so the image fits in ``size`` keeping its aspect ratio (each edge becomes
              ``round(edge * min(h / H, w / W))``, HPSv2's ``ResizeMaxSize`` rounding), then pad the rest with
              ``fill``, centered. HPSv2's ``preprocess_val``. (open_clip's own ``resize_mode="longest"``
              computes ``round(edge / max(H / h, W / w))``, which differs on .5 ties such as 768 x 420.)
            * ``"squash"``: resize to exactly ``size``, ignoring the aspect ratio. DFN5B's open_clip config.
        interpolation: ``"bicubic"`` or ``"bilinear"``; always antialiased.
        shortest_edge: target of the shortest edge in ``"shortest"`` mode (defaults to ``min(size)``).
        fill: pad value in [0, 1] pixel space (before normalisation) for ``"longest"`` mode.
        crop_offset: ``"floor"`` (transformers' ``center_crop``: ``(H - h) // 2``) or ``"round"``
            (torchvision's ``CenterCrop``: ``int(round((H - h) / 2))``, half to even).
        clamp_after_resize: clamp the resized image to [0, 1], as a reference that resizes 8-bit PIL images
            does; ``False`` for references that resize the float tensor (HPSv2, Flow-GRPO's CLIP score) and
            keep the bicubic overshoot.
        resize_backend: ``"torch"`` (default: antialiased ``interpolate`` on the float tensor, on the images'
            device, differentiable) or ``"pil"``: the 8-bit PIL path of the PIL-based references, exactly:
            quantise with :func:`flowgrpo.images.to_uint8`, resize each image with PIL's filter, back to
            floats (k / 255), then crop or pad and normalise. CPU-bound and not differentiable.
    """

    size: tuple[int, int]
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD
    resize_mode: str = "shortest"
    interpolation: str = "bicubic"
    shortest_edge: int | None = None
    fill: float = 0.0
    crop_offset: str = "floor"
    clamp_after_resize: bool = True
    resize_backend: str = "torch"

    def __post_init__(self) -> None:
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(int(s) for s in self.size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"preprocess size must be an int or (h, w) of positive ints, got {self.size!r}")
        object.__setattr__(self, "size", size)
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode {self.resize_mode!r} is not one of {RESIZE_MODES}")
        if self.resize_backend not in RESIZE_BACKENDS:
            raise ValueError(f"resize_backend {self.resize_backend!r} is not one of {RESIZE_BACKENDS}")
        if self.crop_offset not in CROP_OFFSETS:
            raise ValueError(f"crop_offset {self.crop_offset!r} is not one of {CROP_OFFSETS}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation {self.interpolation!r} is not one of {INTERPOLATIONS}")
        for name in ("mean", "std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3:
                raise ValueError(f"preprocess {name} needs 3 values (RGB), got {value}")
            object.__setattr__(self, name, value)
        if min(self.std) <= 0:
            raise ValueError(f"preprocess std must be positive, got {self.std}")

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """Size (h, w) after the resize step, before crop or pad, for an input of ``height`` x ``width``."""
        target_h, target_w = self.size
        if self.resize_mode == "squash":
            return target_h, target_w
        if self.resize_mode == "longest":
            # HPSv2's ResizeMaxSize: scale = size / max(H, W), each edge round(edge * scale); min() of the two
            # correctly rounded quotients is that scale exactly for a square target
            scale = min(target_h / height, target_w / width)
            return round(height * scale), round(width * scale)
        edge = self.shortest_edge or min(self.size)
        if height <= width:
            return edge, int(edge * width / height)
        return int(edge * height / width), edge

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Preprocess ``images`` (B, 3, H, W) float in [0, 1] into (B, 3, h, w) float32 model input on the
        images' device. The torch backend keeps the autograd graph (no 8-bit quantisation, no PIL)."""
        x = images.float()
        height, width = x.shape[-2:]
        new_h, new_w = self.resized_size(height, width)
        if self.resize_backend == "pil":
            x = pil_resize(x, (new_h, new_w), self.interpolation)
        elif (new_h, new_w) != (height, width):
            x = F.interpolate(x, size=(new_h, new_w), mode=self.interpolation, antialias=True, align_corners=False)
            if self.clamp_after_resize:  # bicubic overshoots; PIL clamps to the 8-bit range, a float tensor not
                x = x.clamp(0.0, 1.0)
        x = center_crop_or_pad(x, self.size, self.fill, self.crop_offset)
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        return (x - mean) / std


def pil_resize(images: torch.Tensor, size: tuple[int, int], interpolation: str = "bicubic") -> torch.Tensor:
    """The 8-bit PIL resize of the PIL-based reference processors: (B, 3, H, W) float in [0, 1] -> (B, 3, h, w)
    float32 multiples of 1/255 on the same device. Quantised with :func:`flowgrpo.images.to_uint8` (as an image
    saved and reopened), resized with ``PIL.Image.resize`` (bicubic or bilinear; no resize when the size is
    already ``size``, as PIL returns a copy then)."""
    from PIL import Image

    resample = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}[interpolation]
    out = []
    for array in to_uint8(images):  # (H, W, 3) uint8 each
        image = Image.fromarray(array)
        if image.size != (size[1], size[0]):
            image = image.resize((size[1], size[0]), resample=resample)
        out.append(np.asarray(image))
    return (torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float() / 255.0).to(images.device)


def center_crop_or_pad(
    x: torch.Tensor, size: tuple[int, int], fill: float = 0.0, offset: str = "floor"
) -> torch.Tensor:
    """Pad ``x`` (..., H, W) with ``fill`` up to ``size``, centered (extra pixel right/bottom), then crop the
    center ``size``. Padding as open_clip's ``center_crop_or_pad`` / HPSv2's ``ResizeMaxSize`` / torchvision's
    ``CenterCrop``. Crop offsets: ``offset="floor"`` takes ``(H - h) // 2`` (transformers' ``center_crop``),
    ``offset="round"`` takes ``int(round((H - h) / 2))``, half to even (torchvision's ``CenterCrop``)."""
    target_h, target_w = size
    height, width = x.shape[-2:]
    pad_h, pad_w = max(target_h - height, 0), max(target_w - width, 0)
    if pad_h or pad_w:
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)
        height, width = x.shape[-2:]
    if offset == "round":
        top, left = int(round((height - target_h) / 2.0)), int(round((width - target_w) / 2.0))
    else:
        top, left = (height - target_h) // 2, (width - target_w) // 2
    return x[..., top : top + target_h, left : left + target_w]


# ----------------------------------------------------------------------------------------------------------
# Batching helpers
# ----------------------------------------------------------------------------------------------------------


def encode_unique(prompts: Sequence[str], encode: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
    """Encode each distinct prompt once (a group repeats its prompt G times) and return (B, D) in order."""
    unique: dict[str, int] = {}
    index = [unique.setdefault(p, len(unique)) for p in prompts]
    features = encode(list(unique))  # (U, D)
    return features[torch.as_tensor(index, device=features.device)]


def in_chunks(images: torch.Tensor, batch_size: int, fn: Callable[[torch.Tensor, slice], torch.Tensor]) -> torch.Tensor:
    """Call ``fn(images[sl], sl)`` on consecutive slices of at most ``batch_size`` and concatenate (dim 0)."""
    outputs = []
    for start in range(0, images.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        outputs.append(fn(images[sl], sl))
    return torch.cat(outputs)


# ----------------------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------------------


_PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling values used by CLIP processors


def hf_image_preprocess(processor_spec: str) -> ImagePreprocess:
    """Read the preprocessing of a transformers ``CLIPImageProcessor`` (``preprocessor_config.json``).

    ``processor_spec`` is a hub repo id or a local folder. Raises ``ValueError`` for a processor whose
    settings this module does not implement (no center crop, a resample other than bicubic or bilinear).
    """
    from transformers import CLIPImageProcessor

    cfg = CLIPImageProcessor.from_pretrained(processor_spec).to_dict()
    resample = cfg.get("resample", 3)
    resample = getattr(resample, "value", resample)
    if resample not in _PIL_RESAMPLE:
        raise ValueError(f"{processor_spec}: resample={resample!r} is not bicubic (3) or bilinear (2)")
    if not (cfg.get("do_resize", True) and cfg.get("do_center_crop", True) and cfg.get("do_normalize", True)):
        raise ValueError(f"{processor_spec}: only resize + center crop + normalise processors are supported")
    size = cfg.get("size") or {}
    crop = cfg.get("crop_size") or {}
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    if isinstance(size, int):
        size = {"shortest_edge": size}
    if "shortest_edge" not in size:
        raise ValueError(f"{processor_spec}: expected size={{'shortest_edge': N}}, got {size!r}")
    return ImagePreprocess(
        size=(int(crop["height"]), int(crop["width"])),
        mean=tuple(cfg.get("image_mean") or OPENAI_CLIP_MEAN),
        std=tuple(cfg.get("image_std") or OPENAI_CLIP_STD),
        resize_mode="shortest",
        interpolation=_PIL_RESAMPLE[resample],
        shortest_edge=int(size["shortest_edge"]),
    )


@dataclass
class HFClip:
    """A transformers ``CLIPModel`` with its tokenizer and preprocessing; features are L2-normalised."""

    model: Any
    tokenizer: Any
    preprocess: ImagePreprocess
    max_length: int

    @torch.no_grad()
    def image_features(self, pixels: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """(b, 3, h, w) preprocessed pixels -> (b, D) projected image embeddings (L2-normalised by default)."""
        return self.image_features_differentiable(pixels, normalize)

    def image_features_differentiable(self, pixels: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """:meth:`image_features` with the autograd graph back to ``pixels`` (the weights stay frozen)."""
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        features = self.model.visual_projection(pooled)
        return F.normalize(features, dim=-1) if normalize else features

    @torch.no_grad()
    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """U prompts -> (U, D) L2-normalised projected text embeddings (truncated to ``max_length`` tokens)."""
        device = self.model.text_projection.weight.device
        tokens = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(device)
        pooled = self.model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return F.normalize(self.model.text_projection(pooled.pooler_output), dim=-1)

    def logit_scale(self) -> torch.Tensor:
        """exp(logit_scale), the learned temperature (100 in the released openai and PickScore models)."""
        return self.model.logit_scale.detach().exp().float()


def load_hf_clip(
    model_spec: str,
    processor_spec: str,
    architecture: dict | None,
    device: torch.device,
    dtype: torch.dtype,
    reward: str = "reward",
    keys: tuple[str, str] = ("checkpoint", "processor"),
) -> HFClip:
    """Load a transformers ``CLIPModel`` folder (hub id or local path) and the tokenizer + image processor
    of ``processor_spec``.

    Args:
        architecture: a ``transformers.CLIPConfig`` dict that replaces the checkpoint's ``config.json``
            (``None``: use the checkpoint's own). The weights must fit it.
        reward, keys: the reward's name and its keyword arguments for ``model_spec`` and ``processor_spec``
            (named by the error when a hub download fails).

    Raises:
        RuntimeError: a weight of the architecture is missing from the checkpoint or has another shape.
        MissingWeightsError: a hub id that cannot be downloaded (offline, unknown repo).
        OSError: a local checkpoint or processor folder that is incomplete.
    """
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    kwargs = {}
    if architecture is not None:
        kwargs["config"] = CLIPConfig(**architecture)
    with hub_weights(reward, keys[0], model_spec):
        model, info = CLIPModel.from_pretrained(model_spec, output_loading_info=True, **kwargs)
    # transformers re-initialises missing or mis-shaped weights at random with only a report; a reward model
    # with random layers would silently score garbage, so those are errors here. Unexpected keys (such as the
    # position_ids buffers of older checkpoints) are harmless.
    bad = {key: list(info.get(key) or []) for key in ("missing_keys", "mismatched_keys")}
    if any(bad.values()):
        raise RuntimeError(
            f"CLIP checkpoint {model_spec} does not fit its architecture: missing {bad['missing_keys'][:5]}, "
            f"size mismatch {bad['mismatched_keys'][:5]}"
        )
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    with hub_weights(reward, keys[1], processor_spec):
        tokenizer = AutoTokenizer.from_pretrained(processor_spec)
        preprocess = hf_image_preprocess(processor_spec)
    max_length = int(model.config.text_config.max_position_embeddings)
    return HFClip(model=model, tokenizer=tokenizer, preprocess=preprocess, max_length=max_length)


@dataclass
class OpenClip:
    """An open_clip model with its tokenizer and preprocessing; features are L2-normalised."""

    model: Any
    tokenizer: Any
    preprocess: ImagePreprocess

    @torch.no_grad()
    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(b, 3, h, w) preprocessed pixels -> (b, D) L2-normalised image features."""
        return self.image_features_differentiable(pixels)

    def image_features_differentiable(self, pixels: torch.Tensor) -> torch.Tensor:
        """:meth:`image_features` with the autograd graph back to ``pixels`` (the weights stay frozen)."""
        return self.model.encode_image(pixels, normalize=True)

    @torch.no_grad()
    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """U prompts -> (U, D) L2-normalised text features."""
        device = self.model.logit_scale.device
        return self.model.encode_text(self.tokenizer(prompts).to(device), normalize=True)


def load_open_clip(
    model_name: str,
    pretrained: str | None,
    architecture: dict | None,
    device: torch.device,
    dtype: torch.dtype,
    preprocess_overrides: dict | None = None,
    reward: str = "reward",
    key: str = "checkpoint",
) -> OpenClip:
    """Build an open_clip model with ``open_clip.create_model`` and its official checkpoint loading.

    Args:
        model_name: a built-in architecture (``"ViT-H-14"``) or ``hf-hub:ID`` / ``local-dir:PATH`` (an
            ``open_clip_config.json`` plus weights).
        pretrained: a checkpoint file for a built-in architecture (``{"state_dict": ...}`` or a bare state
            dict), loaded strictly; ``None`` for the ``hf-hub:`` / ``local-dir:`` forms.
        architecture: open_clip model-config keys (``embed_dim``, ``vision_cfg``, ``text_cfg``,
            ``quick_gelu`` ...) that replace those of ``model_name``'s config.
        preprocess_overrides: ``ImagePreprocess`` fields that replace the model's preprocess config.
        reward, key: the reward's name and the keyword argument that takes ``model_name``, for the
            :class:`~flowgrpo.rewards.base.MissingWeightsError` of an ``hf-hub:`` model that cannot be downloaded.
    """
    import open_clip

    from_hub = model_name.startswith("hf-hub:")
    with hub_weights(reward, key, model_name.removeprefix("hf-hub:")) if from_hub else contextlib.nullcontext():
        model = open_clip.create_model(
            model_name,
            pretrained=pretrained,
            precision="fp32",
            device="cpu",
            require_pretrained=True,
            **(architecture or {}),
        )
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    tokenizer = open_clip.get_tokenizer(model_name, context_length=model.context_length)
    cfg = dict(open_clip.get_model_preprocess_cfg(model))
    fields = {
        "size": cfg.get("size", model.visual.image_size),
        "mean": tuple(cfg.get("mean") or OPENAI_CLIP_MEAN),
        "std": tuple(cfg.get("std") or OPENAI_CLIP_STD),
        "resize_mode": cfg.get("resize_mode", "shortest"),
        "interpolation": "bilinear" if cfg.get("interpolation") == "bilinear" else "bicubic",
        "fill": float(cfg.get("fill_color", 0)) / 255.0,
        "crop_offset": "round",  # open_clip's image_transform crops with torchvision's CenterCrop
    }
    fields.update(preprocess_overrides or {})
    return OpenClip(model=model, tokenizer=tokenizer, preprocess=ImagePreprocess(**fields))


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of (B, D) and (B, D) -> (B,), in float32 (the inputs are already normalised)."""
    return (a.float() * b.float()).sum(dim=-1)


def log_loaded(name: str, source: str, n_params: int) -> None:
    """One log line per loaded reward model."""
    logger.info("reward %s: loaded %s (%.1f M parameters)", name, source, n_params / 1e6)


def n_parameters(module: torch.nn.Module) -> int:
    """Number of parameters of ``module``."""
    return sum(math.prod(p.shape) for p in module.parameters())
