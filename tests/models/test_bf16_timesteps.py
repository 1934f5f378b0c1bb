"""The timestep a bfloat16 transformer sees: each adapter passes what its pipeline passes, bit for bit.

The FLUX.1, Kontext, FLUX.2 and Qwen-Image pipelines compute ``timestep = σ·1000`` (float32
``scheduler.timesteps``), cast it to the latents' dtype and divide by 1000 in that dtype: in bfloat16 two
roundings, which at several steps of the 10-, 28- and 50-step grids land one ulp away from σ rounded once. The
conformance suite runs float32 and cannot see it, so here each tiny pipeline runs in bfloat16 itself (its
transformer's forward stubbed to zeros: only its inputs matter) and the timesteps it hands the transformer are
recorded, then compared with those the adapter hands it at the same σ grid.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import AdapterConformance, tiny_folder

FAMILIES = ["flux", "kontext", "qwenimage", "qwenimage_edit_plus", "flux2_klein", "flux2"]


def _stub_and_record(transformer: torch.nn.Module) -> list[torch.Tensor]:
    """Replace the transformer's forward by zeros of its input's shape and record every timestep it is given."""
    seen: list[torch.Tensor] = []

    def forward(*args, hidden_states=None, timestep=None, **kwargs):
        seen.append(timestep.detach().clone())
        return (torch.zeros_like(hidden_states),)

    transformer.forward = forward
    return seen


def _sources(tmp_path, size: int):
    from PIL import Image

    paths = []
    for i in range(2):
        paths.append(tmp_path / f"source{i}.png")
        Image.new("RGB", (size, size), (40 + 90 * i, 120, 200 - 60 * i)).save(paths[-1])
    return paths


@pytest.mark.parametrize("name", FAMILIES)
def test_the_adapter_gives_the_transformer_the_pipelines_bf16_timestep(name, tmp_path, tmp_path_factory,
                                                                       monkeypatch):
    import importlib

    from flowgrpo.models import load_model
    from flowgrpo.sampling.rollout import encode_rows, load_condition_images

    case = CASES[name]
    for target, value in case.module_patches.items():  # as the conformance suite: seen by pipeline and adapter
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    adapter = load_model(str(tiny_folder(case, tmp_path_factory)), dtype="bfloat16", height=case.size,
                         width=case.size, max_sequence_length=case.max_sequence_length, **case.load_kwargs)
    assert adapter.dtype == torch.bfloat16
    adapter.pipe.set_progress_bar_config(disable=True)
    seen = _stub_and_record(adapter.pipe.transformer)
    suite = type("Suite", (AdapterConformance,), {"case": case})()
    sources = None if case.condition is None else _sources(tmp_path, case.size)
    extra = {} if sources is None else case.condition([load_condition_images([str(sources[0])])])
    prompts = list(case.prompts[:1])
    embeds = encode_rows(adapter, prompts, suite.metadata(sources, 1))
    x = adapter.initial_latents(1, [torch.Generator().manual_seed(0)])
    rounded_once = 0
    for steps in (10, 28, 50):
        seen.clear()
        with torch.no_grad():  # the pipeline's own loop, latents out (no decoding: only the timesteps matter)
            adapter.pipe(prompt=prompts, generator=torch.Generator().manual_seed(0), num_inference_steps=steps,
                         height=case.size, width=case.size, output_type="latent", **case.call_kwargs(1.0), **extra)
        theirs = [t.reshape(-1)[0] for t in seen]  # one call a step: no CFG at guidance 1
        sigmas = adapter.sigmas(steps)
        assert len(theirs) == steps
        seen.clear()
        with torch.no_grad():
            for i in range(steps):
                adapter.velocity(x, sigmas[i], embeds, 1.0)
        ours = [t.reshape(-1)[0] for t in seen]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a, b), f"{name}, {steps} steps, step {i}: ours {float(a)!r}, the pipeline's {float(b)!r}"
        rounded_once += sum(not torch.equal(sigmas[i].to(torch.bfloat16), theirs[i]) for i in range(steps))
    assert rounded_once > 0  # σ rounded once to bf16 differs from the pipeline's somewhere on these grids
