"""Image similarity to the source image: the consistency half of an editing reward.

An edited image should keep what the instruction does not change. Flow-GRPO's FLUX.1 Kontext and Qwen-Image-Edit
counting tasks (``config/grpo.py`` ``counting_flux_kontext``: ``{"image_similarity": 0.5, "geneval": 0.5}``;
``counting_qwenimage_edit``: 0.2 / 0.8) reward the cosine of the CLIP image embeddings of the edited image and
its source (``flow_grpo/clip_scorer.py`` ``image_similarity``: ``openai/clip-vit-large-patch14``, L2-normalised
``get_image_features``, the diagonal of their product), composed with a text reward that checks the edit was
made. Here the two are separate rewards composed by weight in the config::

    rewards: [{name: image_similarity, weight: 0.5}, {name: geneval, weight: 0.5}]

The source image is the first of the prompt record's ``images`` (the paths the prompt loader resolved); its
features are computed once per source and cached, since the G samples of a group share it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards._clip_common import (
    check_positive_int,
    in_chunks,
    load_hf_clip,
    log_loaded,
    n_parameters,
    parse_dtype,
)

_FLOW_GRPO_CLIP = "openai/clip-vit-large-patch14"


class ImageSimilarityReward(BaseReward):
    """Cosine of the CLIP image embeddings of each image and its source image: (B,) float32 in [−1, 1].

    Preprocessing is Flow-GRPO's ``clip_scorer.py`` (bilinear antialiased resize to 224, center crop, openai
    mean/std on float tensors), applied alike to the generated image and the source (the source is read as an
    8-bit RGB image and scaled to [0, 1]).

    Args:
        checkpoint: a transformers ``CLIPModel`` hub id or folder (default Flow-GRPO's ViT-L/14).
        processor: its image-processor source (default: ``checkpoint``).
        architecture: a ``CLIPConfig`` dict replacing the checkpoint's (tiny test models).
        dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        batch_size: images per forward pass.
    Metadata: ``images`` (list of paths; the first is the source), as the prompt loader writes it.
    Raises:
        ValueError: a record without ``images``; bad ``dtype`` or ``batch_size``.
        OSError: the checkpoint or a source image cannot be read.
        RuntimeError: called before :meth:`setup`.
    """

    name = "image_similarity"

    def __init__(self, checkpoint: str = _FLOW_GRPO_CLIP, processor: str | None = None,
                 architecture: dict | None = None, dtype: str = "float32", batch_size: int = 32) -> None:
        self.checkpoint = checkpoint
        self.processor = processor or checkpoint
        self.architecture = architecture
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.clip = None
        self._source_features: dict[str, torch.Tensor] = {}

    def setup(self, device: torch.device) -> None:
        """Load the CLIP model and its preprocessing (made bilinear, as Flow-GRPO's) onto ``device``."""
        super().setup(device)
        clip = load_hf_clip(self.checkpoint, self.processor, self.architecture, self.device, self.dtype)
        clip.preprocess = replace(clip.preprocess, interpolation="bilinear")
        self.clip = clip
        log_loaded(self.name, self.checkpoint, n_parameters(clip.model))

    def _features(self, images: torch.Tensor) -> torch.Tensor:
        pixels = self.clip.preprocess(images.to(self.device)).to(self.dtype)
        f = self.clip.image_features(pixels).float()
        return f / f.norm(dim=-1, keepdim=True)

    def _source(self, path: str) -> torch.Tensor:
        if path not in self._source_features:
            import numpy as np
            from PIL import Image

            with Image.open(path) as img:
                rgb = np.asarray(img.convert("RGB"))
            pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1).unsqueeze(0).float() / 255
            self._source_features[path] = self._features(pixels)[0]
        return self._source_features[path]

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(B,) float32 on the CPU: cosine of each image's CLIP features with its source's."""
        if self.clip is None:
            raise RuntimeError("ImageSimilarityReward.setup(device) must be called before scoring")
        for i, m in enumerate(metadata):
            if not m.get("images"):
                raise ValueError(f"image_similarity needs metadata 'images' (the source image); record {i} has "
                                 f"keys {sorted(m)}")
        sources = torch.stack([self._source(m["images"][0]) for m in metadata])  # (B, D)

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            return (self._features(imgs) * sources[sl]).sum(dim=-1)

        with torch.no_grad():
            return in_chunks(images, self.batch_size, chunk).float().cpu()
