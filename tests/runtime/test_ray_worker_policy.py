"""What a rollout worker builds (``flowgrpo.runtime.ray_workers.build_policy``): the policy the trainer samples
with, and nothing the update alone needs: full fine-tuning with a KL to the reference keeps a frozen whole copy of
the transformer in the trainer (``adapter.frozen_reference``), never on a worker (``flowgrpo plan`` counts none)."""

from __future__ import annotations

import torch

from flowgrpo.config import load_config
from flowgrpo.runtime.ray_workers import build_policy
from tests.runtime.test_ray_identity import REPO


def test_a_worker_builds_no_frozen_reference():
    config = load_config(REPO / "configs" / "tiny_jpeg.yaml", ["objective.kl_beta=0.01", "model.finetune=full"])
    adapter, objective = build_policy(config, torch.device("cpu"))
    assert objective.needs_reference  # the trainer would keep a copy (flowgrpo.models.lora.setup_trainable)
    assert adapter.frozen_reference is None
    assert all(p.requires_grad for p in adapter.transformer.parameters())  # the policy itself stays trainable
