"""Every model adapter runs the shared conformance suite (flowgrpo.testing.adapters) on its tiny random
pipeline: registry, pipeline parity, SDE at noise 0, exact on-policy log-probs, LoRA round trip through the
pipeline's loader, one epoch of training with the per_step and chunk strategies.

A new adapter: one case in flowgrpo.models.random_pipelines.CASES and one line here.
"""

from __future__ import annotations

from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import AdapterConformance


class TestFlux(AdapterConformance):
    case = CASES["flux"]


class TestSD3(AdapterConformance):
    case = CASES["sd3"]


class TestQwenImage(AdapterConformance):
    case = CASES["qwenimage"]


class TestZImage(AdapterConformance):
    case = CASES["zimage"]


class TestFlux2Klein(AdapterConformance):
    case = CASES["flux2_klein"]


class TestFlux2(AdapterConformance):
    case = CASES["flux2"]


class TestKontext(AdapterConformance):
    case = CASES["kontext"]


class TestQwenImageEditPlus(AdapterConformance):
    case = CASES["qwenimage_edit_plus"]


class TestQwenImage21(AdapterConformance):
    case = CASES["qwenimage21"]


class TestFlux3(AdapterConformance):  # a modular pipeline (modular_model_index.json)
    case = CASES["flux3"]


class TestFlux3Distilled(AdapterConformance):
    case = CASES["flux3_distilled"]


class TestLTX2I2V(AdapterConformance):  # image-to-video whose image is latent frame 0 (not in the sampled state)
    case = CASES["ltx2_i2v"]


def test_flux2_klein_distilled_ignores_guidance_as_its_pipeline(tmp_path_factory):
    """A step-distilled klein (``is_distilled``) runs no CFG: the adapter's velocity does not depend on the
    guidance scale, and its ODE rollout still equals the pipeline's (which skips CFG for such a model)."""
    import torch
    from diffusers import Flux2KleinPipeline

    from flowgrpo.models.flux2 import Flux2Adapter
    from flowgrpo.testing.adapters import tiny_folder

    case = CASES["flux2_klein"]
    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_folder(case, tmp_path_factory)))
    pipe.set_progress_bar_config(disable=True)
    pipe.register_to_config(is_distilled=True)
    adapter = Flux2Adapter(pipe, height=case.size, width=case.size, max_sequence_length=case.max_sequence_length)
    assert not adapter.true_cfg
    suite = TestFlux2Klein()
    xs, images = suite.ode(adapter, case.prompts, [3, 11], None, guidance=4.0)
    ref, _ = suite.call_pipeline(pipe, case.prompts, [3, 11], None, guidance=4.0)
    torch.testing.assert_close(images, ref, rtol=0, atol=case.parity_atol)
    x = xs[:, 1]
    embeds = adapter.encode_prompts(list(case.prompts))
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, torch.full((2,), 0.5), embeds, 4.0),
                           adapter.velocity(x, torch.full((2,), 0.5), embeds, 1.0))
