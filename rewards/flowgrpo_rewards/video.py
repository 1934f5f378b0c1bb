"""Video rewards: videos (B, F, 3, H, W) float in [0, 1], F frames in time order (``flowgrpo.rewards.base``).

* :class:`VideoFrames` (``video_frames``): any point-wise image reward scored on chosen frames of each video and
  aggregated. The default, every frame averaged, is Flow-Factory's (its image rewards on Wan2.1/2.2 videos,
  ``PickScoreRewardModel._compute_video_scores``: "mean PickScore across all frames"); DanceGRPO's Wan2.1 recipe
  scores HPSv2 on the first frame only (``train_grpo_wan_2_1.py``, ``video_first_frame_to_pil``): ``frames:
  first``.
* :class:`TemporalConsistency` (``temporal_consistency``): how alike consecutive frames look to a frozen image
  encoder (DINO or CLIP features). ``mode: vbench`` (default) is VBench's subject / background consistency
  (Huang et al., "VBench", CVPR 2024, arXiv 2311.17982, Sec. 3.1, "Subject Consistency"): for frames 2..F the mean
  of ``(max(0, cos(f_{i−1}, f_i)) + max(0, cos(f_1, f_i))) / 2``, with DINO ViT-B/16 features for subjects and
  CLIP ViT-B/32 for the background; ``mode: consecutive`` is the plain mean of ``cos(f_i, f_{i+1})``. A static
  video scores 1 — reward it together with a quality or motion reward, never alone.
* :class:`ImageToVideoConsistency` (``i2v_consistency``): how alike the frames of an image-to-video sample look to
  its conditioning image (the prompt record's ``image``), under the same encoders. ``mode: vbench`` (default) is
  VBench-I2V's video-image subject consistency (Huang et al., VBench++, arXiv 2411.13503; the VBench repository's
  ``vbench2_beta_i2v/i2v_subject.py``, DINO ViT-B/16): ``0.5·max_i max(0, cos(f_img, f_i)) + 0.5·mean_{i≥2}
  max(0, cos(f_{i−1}, f_i))``; ``mode: mean`` is the plain average over frames of ``cos(f_img, f_i)``. A video
  that repeats the image scores 1: combine it with a motion or quality reward.

Frame choice (:func:`select_frames`): ``"all"``, ``"first"``, ``"middle"`` (index ⌊F/2⌋), ``"last"``, an int k
(k frames evenly spaced from the first to the last, ``numpy.linspace(0, F − 1, k)`` truncated to int: the frame
sampling of Pref-GRPO's UnifiedReward video judge) or a list of indices (negative ones count from the end).
"""

from __future__ import annotations

import logging

import torch

from flowgrpo.rewards.base import BaseReward, hub_weights, is_group_wise, modalities_of
from flowgrpo.rewards.registry import load_reward
from flowgrpo_rewards._clip_common import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImagePreprocess,
    check_positive_int,
    parse_dtype,
)

logger = logging.getLogger(__name__)

FRAME_CHOICES = ("all", "first", "middle", "last")
AGGREGATES = ("mean", "min", "max")
#: ImageNet's mean and std (DINO's and VBench's DINO transform).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def check_frames(frames) -> str | int | tuple[int, ...]:
    """``frames`` as :func:`select_frames` takes it; ``ValueError`` naming the allowed forms otherwise."""
    if isinstance(frames, str) and frames in FRAME_CHOICES:
        return frames
    if isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1:
        return frames
    if isinstance(frames, list | tuple) and frames and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in frames):
        return tuple(frames)
    raise ValueError(f"frames must be one of {list(FRAME_CHOICES)}, a frame count k >= 1 or a non-empty list of "
                     f"frame indices, got {frames!r}")


def select_frames(num_frames: int, frames) -> list[int]:
    """The frame indices ``frames`` picks from a video of ``num_frames`` (module docstring).

    Raises:
        ValueError: an index outside the video, or a count k above ``num_frames``.
    """
    frames = check_frames(frames)
    if frames == "all":
        return list(range(num_frames))
    if isinstance(frames, str):
        return [{"first": 0, "middle": num_frames // 2, "last": num_frames - 1}[frames]]
    if isinstance(frames, int):
        if frames > num_frames:
            raise ValueError(f"frames: {frames} evenly spaced frames asked of a video of {num_frames}")
        import numpy as np

        return [int(i) for i in np.linspace(0, num_frames - 1, frames, dtype=int)]  # Pref-GRPO's sampling
    out = [i + num_frames if i < 0 else i for i in frames]
    if any(not 0 <= i < num_frames for i in out):
        raise ValueError(f"frames {list(frames)} out of range for a video of {num_frames} frames")
    return out


class VideoFrames(BaseReward):
    """A point-wise image reward on chosen frames of each video, aggregated per video (module docstring).

    Args:
        base: the image reward: a registered name or ``module:attr``. base_kwargs: its keyword arguments.
        frames: which frames (:func:`select_frames`); default ``"all"`` (Flow-Factory).
        aggregate: ``"mean"`` (default, Flow-Factory), ``"min"`` or ``"max"`` over the chosen frames. A frame the
            base scores NaN (not applicable) makes the video's score NaN.

    Calling it: ``videos`` (B, F, 3, H, W) float in [0, 1] → (B,) float32. The chosen frames of all B videos are
    scored in one call of the base (B·k images; the base's own ``batch_size`` splits it), each with its video's
    prompt and metadata.

    Raises:
        ValueError: an unknown ``frames`` or ``aggregate``, or a group-wise or video-only ``base`` (at
            construction); frames outside a video (when scoring).
    """

    modalities = ("video",)

    def __init__(self, base: str, base_kwargs: dict | None = None, frames="all", aggregate: str = "mean") -> None:
        self.frames = check_frames(frames)
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")
        self.aggregate = aggregate
        self.base, self.base_origin = load_reward(base, **(base_kwargs or {}))
        if is_group_wise(self.base):
            raise ValueError(f"base reward {base!r} is group-wise; video_frames takes a point-wise image reward")
        if "image" not in modalities_of(self.base):
            raise ValueError(f"base reward {base!r} does not score images (its modalities: "
                             f"{modalities_of(self.base)}); it can be used on videos directly")
        self.name = f"{self.base.name}_frames"

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.base.setup(device)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU: the aggregate of the base's scores on the chosen frames of each video."""
        b, f = images.shape[:2]
        idx = select_frames(f, self.frames)
        flat = images[:, idx].reshape(b * len(idx), *images.shape[2:])  # (B·k, 3, H, W), video-major
        rep = [i for i in range(b) for _ in idx]
        scores = torch.as_tensor(self.base(flat, [prompts[i] for i in rep], [metadata[i] for i in rep]),
                                 dtype=torch.float32).cpu().view(b, len(idx))
        if self.aggregate == "mean":
            return scores.mean(1)
        out = scores.amin(1) if self.aggregate == "min" else scores.amax(1)
        return torch.where(torch.isnan(scores).any(1), torch.nan, out)


class TemporalConsistency(BaseReward):
    """Feature similarity of consecutive frames under a frozen image encoder (module docstring).

    Args:
        backbone: ``"dino"`` (a transformers ``ViTModel`` checkpoint; its final-norm class token, as DINO's own
            forward returns it) or ``"clip"`` (a ``CLIPVisionModelWithProjection``; its ``image_embeds``).
        checkpoint: hub id or folder; default ``facebook/dino-vitb16`` (VBench's subject consistency) or
            ``openai/clip-vit-base-patch32`` (its background consistency).
        mode: ``"vbench"`` (default) or ``"consecutive"``.
        image_size: the encoder's input side; frames are resized to it (``"dino"``: squashed, ImageNet mean/std;
            ``"clip"``: shortest side then centre crop, CLIP mean/std). Default 224.
        dtype, batch_size: the encoder's precision and frames per forward pass.

    Calling it: ``videos`` (B, F, 3, H, W) float in [0, 1], F >= 2 → (B,) float32 in [0, 1] (``vbench``) or
    [−1, 1] (``consecutive``). Prompts are not read.

    Raises:
        ValueError: bad settings (at construction); a video of one frame (when scoring).
    """

    name = "temporal_consistency"
    modalities = ("video",)
    DEFAULTS = {"dino": "facebook/dino-vitb16", "clip": "openai/clip-vit-base-patch32"}

    def __init__(self, backbone: str = "dino", checkpoint: str | None = None, mode: str = "vbench",
                 image_size: int = 224, dtype: str = "float32", batch_size: int = 32) -> None:
        if backbone not in self.DEFAULTS:
            raise ValueError(f"backbone must be one of {sorted(self.DEFAULTS)}, got {backbone!r}")
        if mode not in ("vbench", "consecutive"):
            raise ValueError(f"mode must be 'vbench' or 'consecutive', got {mode!r}")
        self.backbone, self.mode = backbone, mode
        self.checkpoint = checkpoint or self.DEFAULTS[backbone]
        self.image_size = check_positive_int(image_size, "image_size")
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.encoder = None

    def setup(self, device: torch.device) -> None:
        """Load the encoder onto ``device``."""
        from transformers import CLIPVisionModelWithProjection, ViTModel

        super().setup(device)
        with hub_weights(self.name, "checkpoint", self.checkpoint):
            if self.backbone == "dino":
                model = ViTModel.from_pretrained(self.checkpoint, add_pooling_layer=False)
            else:
                model = CLIPVisionModelWithProjection.from_pretrained(self.checkpoint)
        self.encoder = model.to(self.device, self.dtype).eval()
        if self.backbone == "dino":
            self.preprocess = ImagePreprocess(size=self.image_size, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                                              resize_mode="squash")
        else:
            self.preprocess = ImagePreprocess(size=self.image_size, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)

    def features(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, D) float32 L2-normalised features of ``frames`` (N, 3, H, W) in [0, 1]."""
        out = []
        for i in range(0, frames.shape[0], self.batch_size):
            pixels = self.preprocess(frames[i : i + self.batch_size].to(self.device)).to(self.dtype)
            with torch.no_grad():
                if self.backbone == "dino":
                    f = self.encoder(pixel_values=pixels).last_hidden_state[:, 0]
                else:
                    f = self.encoder(pixel_values=pixels).image_embeds
            out.append(torch.nn.functional.normalize(f.float(), dim=-1))
        return torch.cat(out)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU consistency of each video."""
        if self.encoder is None:
            raise RuntimeError("TemporalConsistency.setup(device) must be called before scoring")
        b, f = images.shape[:2]
        if f < 2:
            raise ValueError(f"{self.name}: needs videos of at least 2 frames, got {f}")
        feats = self.features(images.reshape(b * f, *images.shape[2:])).view(b, f, -1)  # (B, F, D)
        to_previous = (feats[:, 1:] * feats[:, :-1]).sum(-1)  # (B, F−1) cos(f_{i−1}, f_i)
        if self.mode == "consecutive":
            return to_previous.mean(1).cpu()
        to_first = (feats[:, 1:] * feats[:, :1]).sum(-1)  # cos(f_1, f_i)
        return ((to_previous.clamp(min=0) + to_first.clamp(min=0)) / 2).mean(1).cpu()


class ImageToVideoConsistency(TemporalConsistency):
    """Feature similarity of each video's frames to its conditioning image under a frozen image encoder (module
    docstring); the encoders, checkpoints and preprocessing of :class:`TemporalConsistency`, applied alike to the
    frames and to the image (read as 8-bit RGB, scaled to [0, 1]).

    Args:
        backbone, checkpoint, image_size, dtype, batch_size: as :class:`TemporalConsistency`.
        mode: ``"vbench"`` (default: VBench-I2V's subject consistency, DINO) or ``"mean"``.

    Calling it: ``videos`` (B, F, 3, H, W) float in [0, 1] → (B,) float32 in [0, 1] (``vbench``; F >= 2) or
    [−1, 1] (``mean``). Metadata: ``images`` (list of paths; the first is the conditioning image), as the prompt
    loader writes it from a record's ``image``; each image's features are computed once and cached (the G samples
    of a group share it). Prompts are not read.

    Raises:
        ValueError: bad settings (at construction); a record without ``images``, or a one-frame video in
            ``vbench`` mode (when scoring).
        OSError: an image that cannot be read.
    """

    name = "i2v_consistency"
    modalities = ("video",)

    def __init__(self, backbone: str = "dino", checkpoint: str | None = None, mode: str = "vbench",
                 image_size: int = 224, dtype: str = "float32", batch_size: int = 32) -> None:
        if mode not in ("vbench", "mean"):
            raise ValueError(f"mode must be 'vbench' or 'mean', got {mode!r}")
        super().__init__(backbone=backbone, checkpoint=checkpoint, image_size=image_size, dtype=dtype,
                         batch_size=batch_size)
        self.mode = mode
        self._image_features: dict[str, torch.Tensor] = {}

    def _image(self, path: str) -> torch.Tensor:
        if path not in self._image_features:
            import numpy as np
            from PIL import Image

            with Image.open(path) as img:
                rgb = np.asarray(img.convert("RGB"))
            pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).unsqueeze(0).float() / 255
            self._image_features[path] = self.features(pixels)[0]
        return self._image_features[path]

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 CPU consistency of each video with its conditioning image."""
        if self.encoder is None:
            raise RuntimeError("ImageToVideoConsistency.setup(device) must be called before scoring")
        for i, m in enumerate(metadata):
            if not m.get("images"):
                raise ValueError(f"{self.name} needs metadata 'images' (the conditioning image); record {i} has keys "
                                 f"{sorted(m)}")
        b, f = images.shape[:2]
        if self.mode == "vbench" and f < 2:
            raise ValueError(f"{self.name}: mode vbench needs videos of at least 2 frames, got {f}")
        source = torch.stack([self._image(m["images"][0]) for m in metadata])  # (B, D)
        feats = self.features(images.reshape(b * f, *images.shape[2:])).view(b, f, -1)  # (B, F, D)
        to_image = (feats * source.unsqueeze(1)).sum(-1)  # (B, F) cos(f_img, f_i)
        if self.mode == "mean":
            return to_image.mean(1).cpu()
        to_previous = (feats[:, 1:] * feats[:, :-1]).sum(-1).clamp(min=0)  # (B, F−1)
        return (0.5 * to_image.clamp(min=0).amax(1) + 0.5 * to_previous.mean(1)).cpu()
