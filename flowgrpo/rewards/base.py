"""The Reward protocol: what every reward plugin implements.

A reward scores a batch of decoded images against their prompts::

    scores = reward(images, prompts, metadata)   # (B,) float32

* ``images``: (B, 3, H, W) float32 in [0, 1], on any device (a reward moves them where it needs them).
* ``prompts``: list of B strings.
* ``metadata``: list of B dicts, the extra fields of the prompt file's JSONL lines (``{}`` for plain text
  prompts). A reward that needs a field raises ``ValueError`` naming the field when it is absent: bad input is
  an error, not a NaN.
* returns (B,) float32 on the CPU. ``NaN`` means "not applicable to this sample" (see
  :mod:`flowgrpo.rewards.compose`).

Plugins are classes (or factories) registered in the ``flowgrpo.rewards`` entry-point group; they are constructed
with the keyword arguments of the config's ``rewards[i].kwargs`` and must not load weights in ``__init__``:
heavy state is loaded in :meth:`Reward.setup`, which the trainer calls once with the device to use.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Reward(Protocol):
    """A reward plugin. ``name`` is a short identifier used in metric names (``reward/<name>/mean``)."""

    name: str

    def setup(self, device: torch.device) -> None:
        """Load weights onto ``device``. Called once before the first scoring; cheap rewards do nothing."""

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        """Score ``images`` (B, 3, H, W) float in [0, 1]; return (B,) float32 on the CPU."""


class BaseReward:
    """Optional convenience base: a no-op :meth:`setup` and input validation shared by the built-ins."""

    name: str = "reward"

    def setup(self, device: torch.device) -> None:  # noqa: D401 - protocol method
        self.device = torch.device(device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        check_reward_inputs(images, prompts, metadata)
        return self.score(images, prompts, metadata)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        raise NotImplementedError


def check_reward_inputs(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
    """Raise ``ValueError`` unless ``images`` is (B, 3, H, W) and ``prompts``/``metadata`` have length B."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"reward images must be a (B, 3, H, W) tensor in [0, 1], got {shape}")
    if len(prompts) != images.shape[0] or len(metadata) != images.shape[0]:
        raise ValueError(
            f"reward got {images.shape[0]} images but {len(prompts)} prompts and {len(metadata)} metadata dicts"
        )
