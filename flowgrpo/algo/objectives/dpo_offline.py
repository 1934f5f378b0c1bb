"""Diffusion-DPO for flow models, offline: the pairs of a preference dataset (the setting of Diffusion-DPO itself,
arXiv 2311.12908, trained there on Pick-a-Pic v2).

The loss, its σ and noise draws, the reference and β are :mod:`.dpo`'s. The dataset is the preference layout of
:mod:`flowgrpo.data.image_sets` (one JSONL line a pair: ``prompt``, ``chosen``, ``rejected`` image paths), named by
``data.train_prompts``; the loop draws ``train.prompts_per_epoch`` pairs an epoch as it draws prompts, with
``train.group_size`` = 2: sample 0 of a group is the pair's chosen image, sample 1 its rejected one, encoded by the
model's VAE (:func:`~flowgrpo.sampling.dataset_rollout.dataset_rollout`). The rewards score the dataset images
(logged; the pairs do not depend on them).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from flowgrpo.algo.objectives.base import OBJECTIVES
from flowgrpo.algo.objectives.dpo import DPO, DPOBaseConfig
from flowgrpo.algo.objectives.forward import DATASET_INSTEAD, DATASET_UNREAD
from flowgrpo.data.image_sets import PAIR_KEYS, dataset_folder
from flowgrpo.records import FinalSamples
from flowgrpo.sampling.dataset_rollout import dataset_rollout

__all__ = ["DPOOffline", "DPOOfflineConfig", "dataset_pairs"]


def dataset_pairs(sample_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, is_pair) of groups of 2 adjacent samples: sample 0 of each group chosen, sample 1
    rejected; every group a pair. Raises ``ValueError`` unless ``sample_index`` is 0, 1, 0, 1, …"""
    b = sample_index.shape[0]
    if b % 2 or not torch.equal(sample_index.cpu(), torch.arange(2).repeat(b // 2)):
        raise ValueError(f"offline DPO needs groups of 2 samples (chosen, rejected), got sample indices "
                         f"{sample_index.tolist()[:8]} …")
    rows = torch.arange(0, b, 2)
    return rows, rows + 1, torch.ones(b // 2, dtype=torch.bool)


class DPOOfflineConfig(DPOBaseConfig):
    """``objective: {name: dpo_offline, ...}``: Diffusion-DPO on the pairs of the preference dataset
    ``data.train_prompts`` names; ``train.group_size`` must be 2 (a pair)."""

    name: Literal["dpo_offline"] = "dpo_offline"
    trains_on: ClassVar[str] = "the dataset's pairs of images"
    instead: ClassVar[dict[tuple[str, str], str]] = {**DATASET_INSTEAD, **DPOBaseConfig.instead}
    unread: ClassVar[dict[str, str]] = {**DPOBaseConfig.unread, **DATASET_UNREAD,
                                        "adv_clip_max": "no advantage enters its loss: the dataset's pairs do"}

    def problems(self, config) -> list[str]:
        """:class:`DPOBaseConfig`'s problems, and groups of 2 (the chosen and the rejected image)."""
        out = super().problems(config)
        if config.train.group_size != 2:
            out.append(f"objective dpo_offline trains a pair a group: train.group_size must be 2, got "
                       f"{config.train.group_size}")
        return out


@OBJECTIVES.register("dpo_offline")
class DPOOffline(DPO):
    """Offline Diffusion-DPO (module docstring): :class:`~flowgrpo.algo.objectives.dpo.DPO` with the dataset's
    images for a rollout and the dataset's pairs for the plan."""
    #: why rollout workers (runtime.engine: ray) cannot serve it
    rollout_workers_refusal = "it trains on a preference dataset and samples no rollout"

    Config = DPOOfflineConfig
    trains_on_advantages = False  # the dataset's images (or pairs) are the signal, whatever the rewards

    def image_key(self, j: int) -> str:
        """Sample 0 of a group is the chosen image, sample 1 the rejected one."""
        return PAIR_KEYS[j]

    def rollout(self, adapter, request) -> FinalSamples:
        """The epoch's pairs' images encoded (:func:`~flowgrpo.sampling.dataset_rollout.dataset_rollout`)."""
        return dataset_rollout(adapter, request, folder=dataset_folder(self.cfg.data.train_prompts),
                               image_key=self.image_key, sigmas=adapter.sigmas(request.settings.num_steps))

    def training_units(self, local: int) -> tuple[int, str]:
        """A process's ``local`` samples are ``local`` / 2 dataset pairs (:func:`dataset_pairs`)."""
        return local // 2, "dataset pairs"

    def pairs(self, samples: FinalSamples, advantages: torch.Tensor, valid: torch.Tensor):
        """The dataset's pairs (:func:`dataset_pairs`), whatever the rewards."""
        return dataset_pairs(samples.sample_index)
