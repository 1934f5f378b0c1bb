"""The video adapters (Wan2.1, Wan2.2 two-expert, Wan2.2 TI2V-5B) through the shared adapter conformance suite, and
what is particular to them, checked against ``WanPipeline`` itself."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import AdapterConformance, tiny_folder


class TestWan21(AdapterConformance):
    case = CASES["wan21"]


class TestWan22TwoExperts(AdapterConformance):
    case = CASES["wan22"]

    @pytest.mark.parametrize("strategy", ["per_step"])  # the chunk path of video latents: TestWan21's
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        super().test_one_epoch_of_training(folder, sources, tmp_path, strategy)


class TestWan22TI2V(AdapterConformance):
    case = CASES["wan22_ti2v"]

    @pytest.mark.parametrize("strategy", ["per_step"])  # the chunk path of video latents: TestWan21's
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        super().test_one_epoch_of_training(folder, sources, tmp_path, strategy)


def _load(case, tmp_path_factory, **kwargs):
    from flowgrpo.models import load_model

    return load_model(str(tiny_folder(case, tmp_path_factory)), height=case.size, width=case.size,
                      max_sequence_length=case.max_sequence_length, num_frames=case.num_frames, **kwargs)


def _pipeline_frames(adapter, case, seeds, **call):
    with torch.no_grad():
        return adapter.pipe(prompt=list(case.prompts), generator=[torch.Generator().manual_seed(s) for s in seeds],
                            num_inference_steps=case.num_steps, height=case.size, width=case.size, output_type="pt",
                            **{**case.call_kwargs(case.guidance_scale), **call}).frames


def test_wan22_low_noise_expert_and_its_own_guidance_scale(tmp_path_factory):
    """The pipeline's ``guidance_scale_2`` on the low-noise expert, and the expert switch at the boundary: each
    step's velocity is the expert's own (the high-noise one at t >= 875 only)."""
    case = CASES["wan22"]
    suite = TestWan22TwoExperts()
    adapter = _load(case, tmp_path_factory, guidance_scale_2=2.0)
    _, ours = suite.ode(adapter, case.prompts, [3, 11], None, guidance=case.guidance_scale)
    ref = _pipeline_frames(adapter, case, [3, 11], guidance_scale_2=2.0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    assert float((ref - _pipeline_frames(adapter, case, [3, 11])).abs().max()) > 1e-3  # the second scale matters
    x = adapter.initial_latents(2, [torch.Generator().manual_seed(0) for _ in range(2)])
    embeds = adapter.encode_prompts(list(case.prompts))
    with torch.no_grad():
        for sigma, expert in ((0.9, adapter.pipe.transformer), (0.5, adapter.pipe.transformer_2)):
            t = torch.full((2,), sigma) * 1000
            by_hand = expert(hidden_states=x, timestep=t, encoder_hidden_states=embeds["prompt_embeds"],
                             return_dict=False)[0]
            assert torch.equal(adapter.velocity(x, torch.full((2,), sigma), embeds, 1.0), by_hand)
        mixed = adapter.velocity(x, torch.tensor([0.9, 0.5]), embeds, 4.0)  # rows on both sides of the boundary
        for i, s in enumerate((0.9, 0.5)):
            alone = adapter.velocity(x[i : i + 1], torch.tensor([s]), embeds.index(slice(i, i + 1)), 4.0)
            torch.testing.assert_close(mixed[i : i + 1], alone, rtol=0, atol=1e-6)


def test_wan22_training_the_low_noise_expert(tmp_path_factory, tmp_path):
    """``trained_expert: transformer_2``: the LoRA goes on the low-noise expert alone, the other is frozen, and
    the saved LoRA loads back through ``load_lora_weights(..., load_into_transformer_2=True)``."""
    from flowgrpo.models.lora import save_lora, setup_trainable

    case = CASES["wan22"]
    adapter = _load(case, tmp_path_factory, trained_expert="transformer_2")
    assert adapter.transformer is adapter.pipe.transformer_2
    params = setup_trainable(adapter, finetune="lora", rank=4, alpha=8.0, target_modules=["to_q", "to_v"],
                             need_reference=False)
    assert params and not any(p.requires_grad for p in adapter.pipe.transformer.parameters())
    assert not hasattr(adapter.pipe.transformer, "peft_config")
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    _, ours = TestWan22TwoExperts().ode(adapter, case.prompts, [5, 6], None, guidance=case.guidance_scale)
    save_lora(adapter, tmp_path / "lora")
    from diffusers import WanPipeline

    fresh = WanPipeline.from_pretrained(str(tiny_folder(case, tmp_path_factory)))
    fresh.set_progress_bar_config(disable=True)
    base = _pipeline_frames(type("A", (), {"pipe": fresh})(), case, [5, 6])
    fresh.load_lora_weights(str(tmp_path / "lora"), load_into_transformer_2=True)
    theirs = _pipeline_frames(type("A", (), {"pipe": fresh})(), case, [5, 6])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert float((theirs - base).abs().max()) > 1e-3


def test_video_settings_are_checked_where_they_enter(tmp_path_factory):
    from diffusers import UniPCMultistepScheduler

    from flowgrpo.models import load_model
    from flowgrpo.models.wan import euler_scheduler

    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        load_model(str(tiny_folder(CASES["wan21"], tmp_path_factory)), height=32, width=32, num_frames=4)
    with pytest.raises(ValueError, match="two-expert"):
        _load(CASES["wan21"], tmp_path_factory, guidance_scale_2=2.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        load_model(str(tiny_folder(CASES["wan21"], tmp_path_factory)), height=40, width=32, num_frames=5)
    with pytest.raises(ValueError, match="model.num_frames applies to video models only"):
        load_model("tiny", num_frames=5)
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    euler = euler_scheduler(unipc)  # what the released Wan folders ship, made the Euler scheduler
    assert type(euler).__name__ == "FlowMatchEulerDiscreteScheduler" and euler.config.shift == 5.0
    with pytest.raises(ValueError, match="not a flow-matching one"):
        euler_scheduler(UniPCMultistepScheduler())


class TestHunyuanVideo15(AdapterConformance):
    case = CASES["hunyuan_video15"]

    @pytest.mark.parametrize("strategy", ["per_step"])  # the chunk path of video latents: TestWan21's
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        super().test_one_epoch_of_training(folder, sources, tmp_path, strategy)


def test_flowgrpo_sample_writes_videos(tmp_path_factory, tmp_path):
    """``flowgrpo sample`` on a video model: an animated GIF per video (its frames in order) and the exact frames."""
    from PIL import Image

    from flowgrpo.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\ntwo green dogs\n")
    main(["sample", "--model", str(tiny_folder(CASES["wan21"], tmp_path_factory)), "--height", "32", "--width", "32",
          "--num-frames", "5", "--max-sequence-length", "16", "--num-steps", "2", "--prompts", str(prompts),
          "--out", str(tmp_path / "out")])
    videos = torch.load(tmp_path / "out" / "images.pt")
    assert videos.shape == (2, 5, 3, 32, 32)
    gif = Image.open(tmp_path / "out" / "00001.gif")
    assert gif.n_frames == 5 and gif.size == (32, 32)


def test_the_wan_builder_commands_build_the_variant_they_are_given(tmp_path, capsys):
    """``python -m flowgrpo.models.wan OUT --variant ti2v`` writes a Wan2.2 TI2V-5B layout (``expand_timesteps``, one
    expert); ``flowgrpo.models.wan_i2v`` defaults to Wan2.1 I2V (a CLIP image encoder) and refuses a variant it
    does not build, naming the choices."""
    import json

    from flowgrpo.models.wan import main as wan_main
    from flowgrpo.models.wan_i2v import main as wan_i2v_main

    wan_main([str(tmp_path / "ti2v"), "--variant", "ti2v", "--seed", "1"])
    index = json.loads((tmp_path / "ti2v" / "model_index.json").read_text())
    assert (index["_class_name"], index["expand_timesteps"], index["transformer_2"]) == ("WanPipeline", True,
                                                                                         [None, None])
    wan_i2v_main([str(tmp_path / "i2v")])
    index = json.loads((tmp_path / "i2v" / "model_index.json").read_text())
    assert (index["_class_name"], index["image_encoder"]) == ("WanImageToVideoPipeline",
                                                               ["transformers", "CLIPVisionModel"])
    with pytest.raises(SystemExit):
        wan_i2v_main([str(tmp_path / "other"), "--variant", "ti2v"])
    line = capsys.readouterr().err.splitlines()[-1]
    assert "--variant: invalid choice: 'ti2v'" in line and "wan21" in line and "wan22" in line
    assert not (tmp_path / "other").exists()
