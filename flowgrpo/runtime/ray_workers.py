"""The bodies of the Ray actors of ``runtime.engine: ray`` (docs/async.md) and the one device boundary of the records
they send: :class:`RolloutWorker` holds the policy and samples a data rank's request, :class:`RewardWorker` holds
the rewards and scores the decoded images; :func:`host_record` / :func:`placed_record` move a record to the host
for the object store and back onto the trainer's device. What drives them is :mod:`flowgrpo.runtime.ray_engine`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import types

import torch


def build_policy(config, device: torch.device):
    """The rollout policy of ``config`` on one process: the model loaded and made trainable as the runner does
    (:func:`~flowgrpo.models.load_model_from_config`, the seed set first, the prompt cache, LoRA or full with
    float32 LoRA weights, float32 masters computing in ``model.dtype``), never sharded, without full
    fine-tuning's frozen reference copy (the rollout never forwards it; ``flowgrpo plan`` counts what a worker
    holds: :func:`flowgrpo.memory_plan.estimate.rollout_worker`). Returns (adapter,
    objective); the objective samples under whatever weights are loaded (its ``rollout_weights`` swap is the
    trainer's: the weights sent are already the ones it would swap in)."""
    from accelerate.utils import set_seed

    from flowgrpo import parallel
    from flowgrpo.algo.objectives import build_objective
    from flowgrpo.config.schema import ParallelConfig
    from flowgrpo.models import load_model_from_config
    from flowgrpo.models.lora import make_trainable
    from flowgrpo.models.quiet import quiet_libraries
    from flowgrpo.sampling.prompt_cache import attach_prompt_cache

    quiet_libraries()
    one = config.model_copy(update={"parallel": ParallelConfig()})
    set_seed(config.train.seed)
    m = config.model
    adapter = load_model_from_config(m, progress=False)
    parallel.place_pipeline(adapter, device, one.parallel)
    if m.cache_prompt_embeddings:
        attach_prompt_cache(adapter, m.pretrained, one.parallel.text_encoders, m.prompt_embeddings_dir)
    objective = build_objective(config)
    # no frozen reference (full fine-tuning's whole second copy): only the update forwards it, in the trainer
    make_trainable(adapter, one, types.SimpleNamespace(needs_reference=False))
    compute = parallel.master_weights(config)
    if compute is not None:
        adapter.transformer.to(torch.float32)
        adapter.forward_module = parallel.ComputeIn(adapter.transformer, compute, device.type)
    adapter.compute_dtype = compute
    if hasattr(objective, "rollout_weights"):
        objective.rollout_weights = contextlib.nullcontext
    return adapter, objective


class RolloutWorker:
    """A Ray actor's body: holds the policy and samples requests with it.

    Args:
        config: the run's :class:`~flowgrpo.config.Config`.
        threads: torch's thread count, the training process's (CPU float results depend on it).
    """

    def __init__(self, config, threads: int) -> None:
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.adapter, self.objective = build_policy(config, self.device)
        self.params = {n: p for n, p in self.adapter.transformer.named_parameters() if p.requires_grad}
        self.version = -1
        self.forward = [0, 0]
        self.adapter.transformer.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        x = kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None))
        self.forward[0] += 1
        self.forward[1] += 0 if x is None else len(x)

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, version: int, state: dict[str, torch.Tensor]) -> int:
        """Load the trained parameters ``state`` ({name: whole tensor}, exactly the trainable ones) as policy
        version ``version``; ``ValueError`` naming the first missing or extra name."""
        if set(state) != set(self.params):
            odd = sorted(set(state) ^ set(self.params))
            raise ValueError(f"the synced weights do not fit the rollout worker's trainable parameters: {odd[:3]}")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state[name])
        self.version = version
        return version

    def rollout(self, key: tuple[int, int], request) -> dict:
        """Sample ``request`` (a :class:`~flowgrpo.sampling.rollout.RolloutRequest` without ``on_images``).
        Returns ``key``, the ``record`` (tensors on the host), the micro-batches handed to ``on_images``
        (``calls``: (images, prompts, metadata) each), the transformer ``forward`` (calls, rows), the prompts the
        text encoders ``truncated`` ({encoder: count}), the policy ``version`` and the ``seconds`` taken."""
        calls: list = []
        truncation = getattr(self.adapter, "truncation", None)
        cut0 = dict(truncation.counts) if truncation is not None else {}
        f0 = list(self.forward)
        t0 = time.perf_counter()
        def on_images(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
            calls.append((images.cpu(), list(prompts), list(metadata)))

        request = dataclasses.replace(request, on_images=on_images)
        record = self.objective.rollout(self.adapter, request)
        cut = {k: v - cut0.get(k, 0) for k, v in (truncation.counts.items() if truncation is not None else ())}
        record, moved = host_record(record)
        return {"key": key, "record": record, "moved": moved, "calls": calls, "version": self.version,
                "forward": (self.forward[0] - f0[0], self.forward[1] - f0[1]), "truncated": cut,
                "seconds": time.perf_counter() - t0}

    def rollout_parts(self, key: tuple[int, int], request) -> tuple[dict, list]:
        """:meth:`rollout` in two objects (called with ``num_returns=2``): the result without ``calls``, and the
        ``calls`` (the decoded micro-batches), which go to a reward worker as an object ref of their own: the
        images never pass through the trainer."""
        out = self.rollout(key, request)
        return out, out.pop("calls")


class RewardWorker:
    """A Ray actor's body: the run's rewards, built once (the registry and factories the trainer uses:
    :func:`flowgrpo.preflight.build_rewards`) and set up on the CPU, scoring a rollout's decoded micro-batches.

    Args:
        config: the run's :class:`~flowgrpo.config.Config`.
        threads: torch's thread count, the training process's (CPU float results depend on it).
    """

    def __init__(self, config, threads: int) -> None:
        from flowgrpo.models.quiet import quiet_libraries
        from flowgrpo.preflight import build_rewards

        quiet_libraries()
        torch.set_num_threads(threads)
        self.rewards, _ = build_rewards(config.rewards)
        self.rewards.setup(torch.device("cpu"))

    def pid(self) -> int:
        return os.getpid()

    def score(self, key: tuple[int, int], calls: list) -> dict:
        """Score ``calls`` ((images, prompts, metadata) each, as the rollout worker decoded them) one by one, as
        the trainer's background scorer would (:func:`~flowgrpo.rewards.compose.score_components_named`: the
        point-wise components; group-wise ones are scored by the trainer on whole groups). Returns ``key``, the
        ``parts`` ((batch size, non-finite values, components or None) per call: a batch holding a non-finite
        value is not scored, as in the trainer) and the ``seconds`` taken."""
        from flowgrpo.rewards.compose import score_components_named

        t0 = time.perf_counter()
        parts = []
        for images, prompts, metadata in calls:
            bad = int((~torch.isfinite(images)).sum())
            parts.append((len(images), bad, None if bad else score_components_named(self.rewards, images, prompts,
                                                                                     metadata)))
        return {"key": key, "parts": parts, "seconds": time.perf_counter() - t0}


def host_record(record) -> tuple[object, dict[str, bool]]:
    """``record`` (a frozen dataclass of tensors and :class:`~flowgrpo.records.PromptEmbeds`) with every tensor on
    the host, and {field: whether it was on an accelerator}: what :func:`placed_record` puts back on the trainer's
    device (the record's one device boundary)."""
    if not dataclasses.is_dataclass(record):
        return record, {}
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.init}
    moved = {k: _device_of(v).type != "cpu" for k, v in fields.items() if _device_of(v) is not None}
    return dataclasses.replace(record, **{k: fields[k].to("cpu") for k in moved}), moved


def placed_record(record, moved: dict[str, bool], device: torch.device):
    """:func:`host_record`'s record with the fields that were on an accelerator moved to ``device``."""
    on_device = {k: getattr(record, k).to(device) for k, was in moved.items() if was}
    return dataclasses.replace(record, **on_device) if on_device else record


def _device_of(value) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if dataclasses.is_dataclass(value) and hasattr(value, "to") and hasattr(value, "device"):  # PromptEmbeds
        return value.device
    return None
