"""DMD2's optional GAN term (``objective: {name: dmd2, gan: {gen_weight: W, real_images: SET}}``; off by default, as
the release's default and its SD1.5 first-stage script): a classifier head on the fake score's features that tells
real images from the student's, trained with the fake score, and the generator's non-saturating loss against it.
Release tianweiy/DMD2 at commit 8d8fa55; the line numbers below are that commit's.

**Features** (``compute_cls_logits``, ``main/sd_guidance.py`` lines 145–165): the release runs the fake UNet in
``classify_mode`` (``main/sd_unet_forward.py`` lines 249–251: the forward stops after the mid block) and feeds the
bottleneck, ``rep[-1]``, in float32 to the head. The diffusers transformers have no bottleneck; here the head reads
the image tokens (B, L, C) of one block of the fake score (``gan.feature_block``, by default the middle one of the
adapter's :meth:`~flowgrpo.models.base.AdapterBase.feature_blocks`), in float32, and the forward stops there
(:func:`block_features`). The input is noised as the release's GAN scripts do (``--diffusion_gan
--diffusion_gan_max_timestep 1000``: lines 147–151, t ~ U{0 … max − 1}, fresh ε), here ``x_σ = (1 − σ)·x + σ·ε`` with
σ = (t + 1)/T_train and the fake score given σ; ``gan.noise_steps`` 0 is the release without ``--diffusion_gan``
(line 153: timestep 0, the clean image; here σ = 0). The fake score runs without guidance (as all its forwards).

**Head** (``cls_pred_branch``, lines 107–135: strided 4×4 convolutions with GroupNorm(32) and SiLU down to 1×1,
then a 1×1 convolution to one logit): :class:`ClassifierHead`, Linear on every token + GroupNorm (over a group's
channels and all tokens) + SiLU, the mean over tokens (the spatial reduction to 1×1), Linear + GroupNorm + SiLU,
Linear to one logit. A token sequence has
no common 2-D grid across the adapters (FLUX's packed 2×2 patches, SD3's patches), hence tokens and a mean instead
of strided convolutions. Float32 weights (the release's ``rep.float()``), PyTorch's default initialisation (the
release's), seeded by ``train.seed``.

**Losses** (softplus forms): the generator's ``softplus(−D(G))`` on its output G with gradient (line 323,
``compute_generator_clean_cls_loss``), weighted by ``gan.gen_weight`` and added to its DM loss (``train_sd.py``
lines 369–372); the fake score's side ``softplus(D(sg G)) + softplus(−D(real))`` (line 391,
``compute_guidance_clean_cls_loss``, on detached images), weighted by ``gan.guidance_weight`` and added to its
denoising loss (``train_sd.py`` lines 398–401) in the same optimizer step, which trains the head *and* the fake
score's blocks up to the feature block (the release's guidance optimizer holds the fake UNet and the head, lines
197–199, and the classification loss runs through the UNet's encoder). During the generator's loss the fake score
and the head take no gradient (``sd_unified_model.py`` lines 304–310, ``requires_grad_(False)``); the gradient
reaches G through them. Each row is one generated sample and one real image (the release's real batch has the
generator's batch size, ``train_sd.py`` lines 132–135), so the mean over rows is the release's sum of two means.

**Real images** (``real_train_dict``, ``train_sd.py`` lines 102–135, 349–350: VAE latents of LAION images with
their captions, one batch an iteration): ``gan.real_images`` names an image set as ``data.train_prompts`` names
one for ``sft`` (:mod:`flowgrpo.data.image_sets`: records with a ``prompt`` and a ``target`` image); each fake step
draws its rows' real records uniformly with replacement from a generator of (seed, epoch, pass, the micro-batch)
(the release cycles a shuffled loader: a deliberate difference, the same draws on any number of processes and after
a resume without a loader position), encodes their images with the model's VAE and their prompts with its text
encoders, and the classifier sees each real image with its own prompt (``real_train_dict['text_embedding']``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from pydantic import Field

from flowgrpo.strategies.settings import Section

__all__ = ["GanConfig", "ClassifierHead", "GanDraw", "RealImages", "block_features", "classifier_loss",
           "draw_gan_sigmas", "frozen", "generator_gan_loss", "make_head"]


class GanConfig(Section):
    """``objective.gan``: DMD2's GAN term (module docstring); off while ``gen_weight`` is 0."""

    gen_weight: float = Field(0.0, ge=0, description="DMD2 GAN: weight of the generator's GAN loss softplus(-D(G)) "
                              "added to its DM loss (the release's gen_cls_loss_weight: SDXL 5e-3, SD1.5 1e-3); 0 "
                              "(default, the release's default): no GAN term, no classifier head")
    guidance_weight: float = Field(1e-2, gt=0, description="DMD2 GAN: weight of the classifier's loss "
                                   "softplus(D(fake)) + softplus(-D(real)) added to the fake score's (the release's "
                                   "guidance_cls_loss_weight, 1e-2 in its GAN scripts); read with gen_weight > 0")
    real_images: str | None = Field(None, description="DMD2 GAN: the real images the classifier tells from the "
                                    "student's: an image set (an embedded name such as digits_real, or a JSONL file "
                                    "of {prompt, target} records, as data.train_prompts names one for sft); needed "
                                    "with gen_weight > 0")
    feature_block: int | None = Field(None, ge=0, description="DMD2 GAN: the fake score's block whose image tokens "
                                      "the classifier head reads, counted in forward order (FLUX: the double-stream "
                                      "blocks, then the single ones); default the middle one (count // 2, the "
                                      "release's UNet bottleneck)")
    noise_steps: int = Field(1000, ge=0, description="DMD2 GAN: the classifier's inputs noised at t ~ U{0 .. "
                             "noise_steps - 1}, sigma = (t + 1)/num_train_timesteps (the release's "
                             "diffusion_gan_max_timestep, 1000 in its GAN scripts); 0: clean images at sigma 0")

    @property
    def on(self) -> bool:
        """Whether the GAN term runs (``gen_weight`` > 0)."""
        return self.gen_weight > 0


def generator_gan_loss(logits: torch.Tensor) -> torch.Tensor:
    """(n,) float32 ``softplus(−D(G))``, the generator's non-saturating loss (``sd_guidance.py`` line 323) of the
    classifier's logits (n,) on its outputs (gradient through the logits)."""
    return torch.nn.functional.softplus(-logits.float())


def classifier_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """(n,) float32 ``softplus(D(fake)) + softplus(−D(real))`` of row i's real and generated images' logits (n,)
    (``sd_guidance.py`` line 391: real labelled 1, generated 0)."""
    f = torch.nn.functional.softplus
    return f(fake_logits.float()) + f(-real_logits.float())


def draw_gan_sigmas(gen: torch.Generator, n: int, noise_steps: int, num_train_timesteps: int) -> torch.Tensor:
    """(n,) float32 σ = (t + 1)/T_train for t uniform on 0 … ``noise_steps`` − 1 from ``gen`` (the release's
    ``randint(0, diffusion_gan_max_timestep)``, line 148); zeros for ``noise_steps`` 0 (clean images)."""
    if noise_steps == 0:
        return torch.zeros(n)
    t = torch.randint(0, noise_steps, (n,), generator=gen)
    return (t.double() + 1).div(num_train_timesteps).float()


class ClassifierHead(torch.nn.Module):
    """One logit per sample from a block's image tokens (module docstring): (B, L, C) → (B,), in the head's dtype
    (float32). The token stage is a 1×1 convolution over the tokens (Linear on each) with GroupNorm over each group's
    channels and all tokens (as the release's over channels and pixels), SiLU; the mean over tokens; then Linear,
    GroupNorm, SiLU, Linear to one logit. GroupNorm has 32 groups (the release's) where the width has at least 4
    channels a group, else fewer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        groups = math.gcd(32, max(width // 4, 1))
        self.tokens = torch.nn.Linear(width, width)
        self.tokens_norm = torch.nn.GroupNorm(groups, width)
        self.pooled = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GroupNorm(groups, width),
                                          torch.nn.SiLU(), torch.nn.Linear(width, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        per_token = self.tokens(features).transpose(1, 2)  # (B, C, L): channels first, as GroupNorm reads them
        per_token = torch.nn.functional.silu(self.tokens_norm(per_token))
        return self.pooled(per_token.mean(dim=2)).squeeze(1)


def make_head(width: int, seed: int, device) -> ClassifierHead:
    """A :class:`ClassifierHead` of ``width`` channels, float32 on ``device``, initialised from ``seed`` (the same
    on every process) without touching the global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ClassifierHead(width)
    return head.to(device)


class _Reached(Exception):
    """Raised by the feature hook to end the forward at the feature block (the release's ``classify_mode``)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        super().__init__("feature block reached")
        self.tokens = tokens


def block_features(adapter, forward, block: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, embeds, *,
                   grad: bool) -> torch.Tensor:
    """(n, L, C) float32 image tokens of ``block`` (a block of the module ``forward`` runs) when the adapter's
    velocity runs ``forward`` at (x, σ) without guidance; the forward stops after that block. Gradient flows to
    ``x`` and to the trainable weights before the block only when ``grad``."""
    from flowgrpo.algo.objectives.teacher_copies import module_velocity

    def stop(_module, _inputs, output):
        raise _Reached(adapter.block_image_tokens(output))

    handle = block.register_forward_hook(stop)
    try:
        module_velocity(adapter, forward, x, sigma, embeds, 1.0, grad=grad)
    except _Reached as reached:
        return reached.tokens.float()
    finally:
        handle.remove()
    raise RuntimeError("objective.gan: the feature block did not run in the fake score's forward")


@contextlib.contextmanager
def frozen(*modules: torch.nn.Module):
    """The modules' trainable parameters set ``requires_grad=False`` inside (no gradient reaches them; it still
    flows through them to their inputs), restored after (the release's ``requires_grad_(False)`` of its guidance
    model around the generator's loss, ``sd_unified_model.py`` lines 304–310)."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


@dataclass(frozen=True)
class GanDraw:
    """The GAN term's draws of a micro-batch (host): the generated images' σ (n,) and ε (n, …); for a fake-score
    step also the real records' indices (n,) and their σ and ε."""

    sigma: torch.Tensor
    noise: torch.Tensor
    real_index: torch.Tensor | None = None
    real_sigma: torch.Tensor | None = None
    real_noise: torch.Tensor | None = None


class RealImages:
    """The image set ``gan.real_images`` names (:mod:`flowgrpo.data.image_sets`, read once): its records' prompts,
    metadata and image folder."""

    def __init__(self, name: str) -> None:
        from flowgrpo.data.image_sets import dataset_folder
        from flowgrpo.data.prompts import load_prompts

        records = load_prompts(name)
        self.prompts, self.metadata, self.folder = records.prompts, records.metadata, dataset_folder(name)

    def __len__(self) -> int:
        return len(self.prompts)

    @torch.no_grad()
    def batch(self, adapter, index: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(latents (n, …) float32 on the device, their prompts' embeddings) of records ``index`` (n,): the images
        encoded by the model's VAE (``encode_images``), the prompts by its text encoders."""
        from flowgrpo.data.image_sets import TARGET_KEY, load_image, record_image
        from flowgrpo.sampling.rollout import encode_rows

        rows = [int(i) for i in index.tolist()]
        meta = [self.metadata[i] for i in rows]
        images = torch.stack([load_image(record_image(m, TARGET_KEY, self.folder), adapter.height, adapter.width)
                              for m in meta])
        latents = adapter.encode_images(images).float().to(adapter.device)
        with adapter.encoding():
            embeds = encode_rows(adapter, [self.prompts[i] for i in rows], meta)
        return latents, embeds
