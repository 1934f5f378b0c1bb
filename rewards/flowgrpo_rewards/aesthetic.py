"""LAION improved aesthetic predictor ("aesthetic score", C. Schuhmann, 2022).

Source: github.com/christophschuhmann/improved-aesthetic-predictor, ``simple_inference.py`` at commit
``fe88a163`` (the version Flow-GRPO's ``flow_grpo/aesthetic_scorer.py`` and DDPO cite). A linear MLP (five
``nn.Linear`` layers with dropout between the first four and *no* activations: the "linearMSE" checkpoint)
trained with MSE on SAC + LAION-Logos + AVA ratings, applied to L2-normalised CLIP ViT-L/14 image
embeddings::

    e = f_img / |f_img|                         # f_img: CLIP ViT-L/14 projected image embedding (768)
    aesthetic = W5 (W4 (W3 (W2 (W1 e + b1) + b2) + b3) + b4) + b5     # dims 768-1024-128-64-16-1

Scores lie roughly in 1 - 10 (most images 4 - 7). The checkpoint ``sac+logos+ava1-l14-linearMSE.pth`` is a
bare state dict with keys ``layers.{0,2,4,6,7}.{weight,bias}`` (indices 1, 3, 5 are the dropouts); the hub
copy ``trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth`` (TRL's DDPO example) is the same file
renamed. The CLIP model is transformers' ``openai/clip-vit-large-patch14`` (the openai ``clip`` package's
``ViT-L/14`` weights, as Flow-GRPO and DDPO load them) with its processor's preprocessing: shortest edge to
224 (bicubic), center crop 224, openai mean/std.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from flowgrpo.rewards.base import BaseReward
from flowgrpo_rewards._clip_common import (
    check_positive_int,
    check_resize_backend,
    in_chunks,
    load_hf_clip,
    log_loaded,
    n_parameters,
    parse_dtype,
    resolve_file,
)

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"
AESTHETIC_MLP_REPO = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_MLP_HUB_FILE = "aesthetic-model.pth"
AESTHETIC_MLP_FILE = "sac+logos+ava1-l14-linearMSE.pth"
#: Widths of the released MLP: CLIP ViT-L/14 embedding (768) -> 1024 -> 128 -> 64 -> 16 -> 1.
AESTHETIC_MLP_DIMS = (768, 1024, 128, 64, 16, 1)


def check_mlp_dims(dims) -> tuple[int, ...]:
    """Return ``dims`` as a tuple if it is six positive int widths ending in 1, else raise ``ValueError``."""
    dims = tuple(dims)
    if len(dims) != 6 or dims[-1] != 1 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ValueError(f"aesthetic MLP dims must be 6 positive int widths ending in 1, got {dims}")
    return dims


class AestheticMLP(nn.Module):
    """The predictor head of ``simple_inference.py``: five linear layers, dropout after the first three.

    Args:
        dims: six widths, input first (``AESTHETIC_MLP_DIMS`` for the released checkpoint).

    ``forward``: (B, dims[0]) L2-normalised embeddings -> (B,) scores.
    """

    def __init__(self, dims: tuple[int, ...] = AESTHETIC_MLP_DIMS) -> None:
        super().__init__()
        dims = check_mlp_dims(dims)
        dropouts = (0.2, 0.2, 0.1)  # as trained; inactive in eval mode
        layers: list[nn.Module] = []
        for i in range(5):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < 3:
                layers.append(nn.Dropout(dropouts[i]))
        self.layers = nn.Sequential(*layers)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.layers(embeddings).squeeze(-1)


def load_aesthetic_mlp(path: str, dims: tuple[int, ...] = AESTHETIC_MLP_DIMS) -> AestheticMLP:
    """Load ``sac+logos+ava1-l14-linearMSE.pth`` (a bare state dict) strictly into :class:`AestheticMLP`.

    Raises ``ValueError`` when the file's layer shapes do not match ``dims`` (naming both).
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    mlp = AestheticMLP(tuple(dims))
    expected = {k: tuple(v.shape) for k, v in mlp.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    if expected != found:
        raise ValueError(f"aesthetic MLP checkpoint {path} has layers {found}; dims={tuple(dims)} expects {expected}")
    mlp.load_state_dict(state, strict=True)
    return mlp.eval()


class AestheticReward(BaseReward):
    """LAION improved aesthetic predictor on L2-normalised CLIP ViT-L/14 image embeddings (prompt ignored).

    Args:
        clip_checkpoint: transformers ``CLIPModel`` folder or hub id (default ``openai/clip-vit-large-patch14``);
            also the source of the image-processor settings unless ``clip_processor`` is given.
        clip_processor: folder or hub id of the ``CLIPImageProcessor`` and tokenizer.
        mlp_checkpoint: the MLP state dict: a ``.pth`` path, a folder holding ``mlp_filename``, or a hub repo
            id (default ``trl-lib/ddpo-aesthetic-predictor``).
        mlp_filename: file name inside a folder or hub repo (default ``aesthetic-model.pth`` for the default
            repo, ``sac+logos+ava1-l14-linearMSE.pth`` otherwise).
        architecture: ``{"clip": CLIPConfig dict, "mlp_dims": six widths}``, either key optional; for tiny
            test models.
        dtype: dtype of the CLIP model (``"float32"`` default); the MLP always runs in float32.
        batch_size: images per forward pass.
        resize_backend: ``"torch"`` (default: antialiased resize of the float tensor on the device, within the
            bounds of ``docs/rewards.md`` of the reference) or ``"pil"`` (the reference's own 8-bit PIL resize,
            exact, on the CPU).

    Calling it: ``images`` (B, 3, H, W) float in [0, 1] -> (B,) float32 (prompts and metadata unused).

    Raises:
        ValueError: bad ``architecture`` keys or MLP dims, unknown ``dtype``, bad ``batch_size``.
        FileNotFoundError / OSError: a checkpoint cannot be found or downloaded (in :meth:`setup`).
        RuntimeError: the reward is called before :meth:`setup`.
    """

    name = "aesthetic"
    #: differentiable in the images with the torch resize (:meth:`score_differentiable`); not with the 8-bit PIL one
    differentiable = True
    #: where the predictor's scores of most images lie (module docstring: 4 - 7 of its 1 - 10 scale); None with
    #: ``architecture`` (a stand-in model). Read by ReFL's margin check
    typical_range = (4.0, 7.0)

    def __init__(
        self,
        clip_checkpoint: str = AESTHETIC_CLIP,
        clip_processor: str | None = None,
        mlp_checkpoint: str = AESTHETIC_MLP_REPO,
        mlp_filename: str | None = None,
        architecture: dict | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
        resize_backend: str = "torch",
    ) -> None:
        architecture = dict(architecture or {})
        unknown = set(architecture) - {"clip", "mlp_dims"}
        if unknown:
            raise ValueError(f"aesthetic architecture keys {sorted(unknown)} unknown; allowed: clip, mlp_dims")
        self.mlp_dims = check_mlp_dims(architecture.get("mlp_dims", AESTHETIC_MLP_DIMS))
        self.clip_architecture = architecture.get("clip")
        self.typical_range = None if architecture else type(self).typical_range
        self.clip_checkpoint = clip_checkpoint
        self.clip_processor = clip_processor or clip_checkpoint
        self.mlp_checkpoint = mlp_checkpoint
        if mlp_filename is None:
            mlp_filename = AESTHETIC_MLP_HUB_FILE if mlp_checkpoint == AESTHETIC_MLP_REPO else AESTHETIC_MLP_FILE
        self.mlp_filename = mlp_filename
        self.dtype = parse_dtype(dtype)
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.resize_backend = check_resize_backend(resize_backend)
        self.differentiable = self.resize_backend == "torch"
        self.clip = None
        self.mlp = None

    def setup(self, device: torch.device) -> None:
        """Load CLIP ViT-L/14 and the MLP head onto ``device``."""
        super().setup(device)
        path = resolve_file(self.mlp_checkpoint, self.mlp_filename, "aesthetic MLP checkpoint",
                            reward=self.name, key="mlp_checkpoint")
        self.mlp = load_aesthetic_mlp(path, self.mlp_dims).to(self.device).requires_grad_(False)
        self.clip = load_hf_clip(
            self.clip_checkpoint, self.clip_processor, self.clip_architecture, self.device, self.dtype,
            reward=self.name, keys=("clip_checkpoint", "clip_processor"),
        )
        self.clip.preprocess = replace(self.clip.preprocess, resize_backend=self.resize_backend)
        log_loaded(self.name, f"{self.clip_checkpoint} + {path}", n_parameters(self.clip.model))

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Aesthetic score of each image: (B,) float32 on the CPU."""
        if self.clip is None or self.mlp is None:
            raise RuntimeError("AestheticReward.setup(device) must be called before scoring")

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            embeddings = self.clip.image_features(pixels, normalize=True).float()  # (b, 768), unit norm
            return self.mlp(embeddings)

        return in_chunks(images, self.batch_size, chunk).cpu()

    def score_differentiable(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """:meth:`score` with the autograd graph back to ``images`` (CLIP and the MLP frozen; the torch resize):
        (B,) float32 on the reward's device."""
        if self.clip is None or self.mlp is None:
            raise RuntimeError("AestheticReward.setup(device) must be called before scoring")
        if not self.differentiable:
            raise ValueError("aesthetic: resize_backend='pil' rounds to 8 bits (no gradient); use 'torch'")

        def chunk(imgs: torch.Tensor, sl: slice) -> torch.Tensor:
            pixels = self.clip.preprocess(imgs.to(self.device)).to(self.dtype)
            return self.mlp(self.clip.image_features_differentiable(pixels, normalize=True).float())

        return in_chunks(images, self.batch_size, chunk)
