"""The "rollout" of the objectives that train on a dataset's images (``sft``, ``dpo_offline``): no sampling; each
requested sample is a dataset image, encoded to its clean latent x₀ by the model's VAE.

The loop draws the epoch's records from the dataset file (``data.train_prompts``: :mod:`flowgrpo.data.image_sets`)
as it draws prompts, G samples a record; the objective names which image of a record sample j is (its ``target``;
the ``chosen`` one for j = 0 and the ``rejected`` one for j = 1). The images are handed to the background scorer
like a rollout's, so the run logs the rewards of the data it trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from flowgrpo.data.image_sets import load_image, record_image
from flowgrpo.records import FinalSamples
from flowgrpo.sampling.rollout import RolloutRequest, encode_rows

__all__ = ["dataset_rollout"]


@torch.no_grad()
def dataset_rollout(adapter, request: RolloutRequest, *, folder: Path, image_key: Callable[[int], str],
                    sigmas: torch.Tensor) -> FinalSamples:
    """The requested samples' dataset images and their latents.

    Args:
        adapter: the model adapter; it must have ``encode_images`` ((B, 3, H, W) in [0, 1] → clean latents: FLUX.1
            and SD3 adapters).
        request: the samples (``metadata`` holds each record's image paths) and the micro-batch size.
        folder: the folder the records' relative paths start from (:func:`~flowgrpo.data.image_sets.dataset_folder`).
        image_key: sample index j within the group → the metadata key of its image.
        sigmas: (T+1,) float32 host grid recorded for the update's σ draws.

    Returns:
        :class:`~flowgrpo.records.FinalSamples` with ``x0`` the encoded images (on the adapter's device, or the host
        with ``request.latents_on_cpu``), ``initial_noise`` zeros (nothing was sampled), ``images`` the loaded
        images (host).

    Raises:
        ValueError: an adapter without ``encode_images``, a record without the key, a missing image or one of
            another size (:func:`~flowgrpo.data.image_sets.load_image`).
    """
    if not hasattr(adapter, "encode_images"):
        raise ValueError(f"{type(adapter).__name__} cannot encode images (no encode_images): the dataset objectives "
                         "train FLUX.1 and SD3 models")
    r = request
    embeds = encode_rows(adapter, list(r.prompts), list(r.metadata))
    finals, images = [], []
    for start in range(0, len(r.prompts), r.batch_size):
        sl = slice(start, start + r.batch_size)
        keys = [image_key(int(j)) for j in r.sample_index[sl].tolist()]
        imgs = torch.stack([load_image(record_image(m, k, folder), adapter.height, adapter.width)
                            for m, k in zip(r.metadata[sl], keys, strict=True)])
        x0 = adapter.encode_images(imgs).float()
        finals.append(x0.cpu() if r.latents_on_cpu else x0)
        images.append(imgs)
        if r.on_images is not None:
            r.on_images(imgs, list(r.prompts[sl]), list(r.metadata[sl]))
    x0 = torch.cat(finals)
    return FinalSamples(
        x0=x0, initial_noise=torch.zeros_like(x0), sigmas=sigmas.float().cpu(), group_ids=r.prompt_ids.clone(),
        sample_index=r.sample_index.clone(), embeds=embeds, images=torch.cat(images), prompts=list(r.prompts),
        metadata=list(r.metadata), guidance_scale=r.settings.guidance_scale,
    )
