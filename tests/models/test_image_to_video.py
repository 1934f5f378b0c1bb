"""The image-to-video adapters (Wan2.1 I2V with its CLIP image encoder, Wan2.2 I2V A14B with two experts,
HunyuanVideo-1.5 I2V) through the shared adapter conformance suite, and what is particular to them: the
conditioning image is a fixed input, never part of the sampled state. LTX-2 I2V, whose image is a latent frame of
the video rather than condition channels, has its own file (tests/models/test_ltx2_i2v.py)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.random_pipelines import CASES
from flowgrpo.testing.adapters import AdapterConformance, tiny_folder


class TestWan21I2V(AdapterConformance):
    case = CASES["wan21_i2v"]


class TestWan22I2VTwoExperts(AdapterConformance):
    case = CASES["wan22_i2v"]

    @pytest.mark.parametrize("strategy", ["per_step"])  # the chunk path of image-to-video latents: TestWan21I2V's
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        super().test_one_epoch_of_training(folder, sources, tmp_path, strategy)


class TestHunyuanVideo15I2V(AdapterConformance):
    case = CASES["hunyuan_video15_i2v"]

    @pytest.mark.parametrize("strategy", ["per_step"])  # the chunk path of image-to-video latents: TestWan21I2V's
    def test_one_epoch_of_training(self, folder, sources, tmp_path, strategy):
        super().test_one_epoch_of_training(folder, sources, tmp_path, strategy)


def _condition_by_hand(adapter, image, family: str):
    """The condition channels the transformer must see, from the VAE directly: the image as [−1, 1] pixels (the
    test images are already the output size), encoded with the posterior's mode; Wan: frame 0 of a black video,
    normalised (z − mean)/std, after a 4-channel mask that is 1 on latent frame 0 only; HunyuanVideo-1.5: the image
    alone, times the scaling factor, on latent frame 0 (zeros after), then a 1-channel mask, 1 on frame 0 only."""
    import numpy as np

    vae = adapter.pipe.vae
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    _, f, h, w = adapter.latent_shape
    with torch.no_grad():
        if family == "wan":
            video = torch.cat([pixels, torch.zeros(1, 3, adapter.num_frames - 1, *pixels.shape[-2:])], dim=2)
            z = vae.encode(video).latent_dist.mode()
            c = vae.config.z_dim
            z = (z - torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1)) / torch.tensor(
                vae.config.latents_std).view(1, c, 1, 1, 1)
            mask = torch.zeros(1, 4, f, h, w)
            mask[:, :, 0] = 1
            return torch.cat([mask, z], dim=1)
        z = vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor  # (1, C, 1, h, w)
        cond = torch.zeros(1, z.shape[1], f, h, w)
        cond[:, :, :1] = z
        mask = torch.zeros(1, 1, f, h, w)
        mask[:, :, 0] = 1
        return torch.cat([cond, mask], dim=1)


@pytest.mark.parametrize("name, family", [("wan21_i2v", "wan"), ("hunyuan_video15_i2v", "hunyuan")])
def test_the_conditioning_image_is_a_fixed_input_never_sampled_or_noised(name, family, tmp_path_factory):
    """The image's latents enter every transformer call as the same fixed condition channels — equal to the VAE's
    encoding by hand, whatever the SDE noise of the rollout — while the sampled state (whose transitions carry the
    log-probs) is the C latent channels alone; two rollouts with different SDE noise differ in the state only."""
    from PIL import Image

    from flowgrpo.config import SamplingConfig
    from flowgrpo.models import load_model
    from flowgrpo.sampling.rollout import denoise, encode_rows
    from flowgrpo.testing.adapters import tiny_folder
    from flowgrpo.testing.rewards import default_images

    case = CASES[name]
    adapter = load_model(str(tiny_folder(case, tmp_path_factory)), height=case.size, width=case.size,
                         max_sequence_length=case.max_sequence_length, **case.load_kwargs)
    pixels = default_images(2, case.size, case.size, torch.Generator().manual_seed(0))
    paths = []
    for i, img in enumerate(pixels):
        paths.append(tmp_path_factory.mktemp("img") / f"first{i}.png")
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(paths[-1])
    meta = [{"images": [str(p)]} for p in paths]
    expected = torch.cat([_condition_by_hand(adapter, Image.open(p).convert("RGB"), family) for p in paths])
    c = adapter.latent_shape[0]
    # parenthesised: ``assert c == a if h else b`` asserted b alone (a truthy int) for Wan, which could not fail
    assert c == (adapter.pipe.vae.config.latent_channels if family == "hunyuan" else adapter.pipe.vae.config.z_dim)
    seen = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].detach().clone()), with_kwargs=True)
    settings = SamplingConfig(num_steps=case.num_steps, guidance_scale=case.guidance_scale, sde_kind="flow_sde",
                               noise_level=0.7)
    runs = []
    try:
        for sde_seed in (100, 200):
            seen.clear()
            x0 = adapter.initial_latents(2, [torch.Generator().manual_seed(s) for s in (1, 2)])
            with torch.no_grad():
                embeds = encode_rows(adapter, list(case.prompts), meta)
                xs, log_probs, stochastic = denoise(
                    adapter, x0, embeds, adapter.sigmas(case.num_steps), settings,
                    torch.ones(case.num_steps, dtype=torch.bool),
                    [torch.Generator().manual_seed(sde_seed + i) for i in range(2)])
            assert xs.shape == (2, case.num_steps + 1, *adapter.latent_shape)  # the state: latents alone
            assert torch.isfinite(log_probs).all() and stochastic.all()
            for hidden in seen:  # every call (cond and uncond, every step): [latents ‖ the fixed condition]
                assert hidden.shape[1] == c + expected.shape[1]
                torch.testing.assert_close(hidden[:, c:], expected, rtol=0, atol=1e-5)
            runs.append((xs, [h[:, :c] for h in seen]))
    finally:
        hook.remove()
    assert float((runs[0][0][:, -1] - runs[1][0][:, -1]).abs().max()) > 1e-3  # the SDE noise moved the state
    image_latents = expected[:, 4:, 0] if family == "wan" else expected[:, :c, 0]
    assert float((image_latents[0] - image_latents[1]).abs().max()) > 1e-3  # each row sees its own image


@pytest.mark.parametrize("name", ["wan21_i2v", "hunyuan_video15_i2v", "ltx2_i2v"])
def test_flowgrpo_sample_writes_image_to_video_samples(name, tmp_path_factory, tmp_path, monkeypatch):
    """``flowgrpo sample`` on an image-to-video model with a JSONL prompt file whose records name their first-frame
    image (relative paths): each record's image reaches the model (without it the model refuses the record), and a
    GIF per video and the exact frames are written (LTX-2: decoded with the record's image as latent frame 0)."""
    import importlib
    import json

    from PIL import Image

    from flowgrpo.cli import main
    from flowgrpo.testing.adapters import tiny_folder
    from flowgrpo.testing.rewards import default_images

    case = CASES[name]
    for target, value in case.module_patches.items():  # LTX-2: the two-block STG, the H.264 stand-in
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, value)
    (tmp_path / "img").mkdir()
    for i, img in enumerate(default_images(2, case.size, case.size, torch.Generator().manual_seed(3))):
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(tmp_path / "img" / f"{i}.png")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": case.prompts[0], "image": f"img/{i}.png"}) + "\n"
                               for i in range(2)))
    main(["sample", "--model", str(tiny_folder(case, tmp_path_factory)), "--height", str(case.size), "--width",
          str(case.size), "--num-frames", str(case.num_frames), "--max-sequence-length",
          str(case.max_sequence_length), "--num-steps", "2", "--prompts", str(prompts), "--out", str(tmp_path / "out")])
    videos = torch.load(tmp_path / "out" / "images.pt")
    assert videos.shape == (2, case.num_frames, 3, case.size, case.size)
    gif = Image.open(tmp_path / "out" / "00001.gif")
    assert gif.n_frames == case.num_frames and gif.size == (case.size, case.size)


def test_one_epoch_of_a_forward_process_objective_on_image_to_video(tmp_path_factory, tmp_path):
    """DiffusionNFT (``objective: nft``) through the real trainer on the tiny Wan2.1 I2V model, the prompt file's
    ``image`` conditioning every sample: at the first update the trained policy is the one that sampled, so its
    implicit positive and negative policies coincide and their losses are equal bit for bit (the forward-process
    form of an on-policy mismatch of 0.0)."""
    import json

    from PIL import Image

    from flowgrpo.config import build_config
    from flowgrpo.runner import run
    from flowgrpo.testing.adapters import tiny_folder
    from flowgrpo.testing.rewards import default_images

    case = CASES["wan21_i2v"]
    (tmp_path / "img").mkdir()
    for i, img in enumerate(default_images(2, case.size, case.size, torch.Generator().manual_seed(0))):
        Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).save(tmp_path / "img" / f"{i}.png")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "image": f"img/{i}.png"}) + "\n"
                               for i, p in enumerate(case.prompts)))
    out = tmp_path / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(build_config({}, [
            f"model.pretrained={tiny_folder(case, tmp_path_factory)}", "model.max_sequence_length=16",
            f"model.height={case.size}", f"model.width={case.size}", f"model.num_frames={case.num_frames}",
            "model.lora_rank=4", "model.lora_alpha=8", f"sampling.num_steps={case.num_steps}",
            f"sampling.guidance_scale={case.guidance_scale}", "objective={name: nft}", "train.num_epochs=1",
            "train.group_size=2", "train.prompts_per_epoch=2", "train.rollout_batch_size=2", "train.lr=1e-3",
            f"data.train_prompts={prompts}", f"output_dir={out}", "logging.progress=false", "data.eval_num_prompts=2",
            f"eval_sampling.num_steps={case.num_steps}",
            "rewards=[{name: video_frames, kwargs: {base: jpeg_compressibility}}]"]))
    finally:
        torch.set_num_threads(before)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0]
    r = records[0]
    assert r["objective/positive_loss"] == r["objective/negative_loss"] > 0 and r["adv/abs_mean"] > 0
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_what_the_image_to_video_adapters_refuse(tmp_path_factory):
    """One-line errors where the input enters: a record without its image, two images for one video, Wan2.2
    TI2V-5B's image mode (the image written into the state's first frame) and a step-distilled (meanflow)
    HunyuanVideo-1.5 I2V transformer."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, WanImageToVideoPipeline
    from PIL import Image

    from flowgrpo.models import load_model
    from flowgrpo.models.hunyuan_video15 import HunyuanVideo15I2VAdapter
    from flowgrpo.models.wan_i2v import WanI2VAdapter
    from flowgrpo.sampling.rollout import encode_rows
    from flowgrpo.testing.adapters import tiny_folder

    folder = tiny_folder(CASES["wan21_i2v"], tmp_path_factory)
    adapter = load_model(str(folder), height=32, width=32, max_sequence_length=16, num_frames=5)
    with pytest.raises(ValueError, match="conditions every sample on an image \\(its first frame\\), but the prompt "
                       "record 'a red cube' has none: write the prompt file as JSONL"):
        encode_rows(adapter, ["a red cube"], [{}])
    img = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="exactly one image per prompt, got \\[2\\]"):
        adapter.encode_prompts(["a red cube"], images=[[img, img]])
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder))
    pipe.register_to_config(expand_timesteps=True)
    with pytest.raises(ValueError, match="expand_timesteps"):
        WanI2VAdapter(pipe, height=32, width=32, num_frames=5, max_sequence_length=16)
    hy = HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(tiny_folder(CASES["hunyuan_video15_i2v"],
                                                                             tmp_path_factory)))
    hy.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match="use_meanflow"):
        HunyuanVideo15I2VAdapter(hy, height=32, width=32, num_frames=5)


def test_training_without_a_records_first_frame_says_what_to_add_before_anything_is_sampled(
        tmp_path_factory, tmp_path, capsys):
    """``flowgrpo train`` on an image-to-video model with a prompt file whose records lack their image: the one
    error line named an editing model ("edits images") and came from the first evaluation; it now comes right
    after the model loads, names the setting, the file and the count, and shows the JSONL record to write."""
    import json

    from PIL import Image

    from flowgrpo.runner import main
    from flowgrpo.testing.adapters import tiny_folder
    from tests.tiny_runs import _tiny_overrides

    case = CASES["wan21_i2v"]
    model = [f"model.pretrained={tiny_folder(case, tmp_path_factory)}", f"model.num_frames={case.num_frames}",
             f"model.max_sequence_length={case.max_sequence_length}"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a red cube", "image": "f.png"}) + "\n"
                                      + json.dumps({"prompt": "a blue ball"}) + "\n")
    Image.new("RGB", (case.size, case.size)).save(tmp_path / "f.png")
    for prompts, setting, count in ((tmp_path / "p.txt", "data.train_prompts", "2 of 2"),
                                    (tmp_path / "p.jsonl", "data.train_prompts", "1 of 2")):
        out = tmp_path / f"run_{prompts.suffix[1:]}"
        with pytest.raises(SystemExit) as err:
            main([*_tiny_overrides(tmp_path, tmp_path), *model, f"model.height={case.size}",
                  f"model.width={case.size}", f"output_dir={out}", f"data.train_prompts={prompts}",
                  f"data.eval_prompts={prompts}"])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.value.code == 2
        missing = "a blue ball" if prompts.suffix == ".jsonl" else "a red cube"
        assert line.startswith(f"error: WanImageToVideoPipeline conditions every sample on an image (its first frame), "
                               f"but the prompt record {missing!r} of {setting} ({prompts}; {count} records lack one) "
                               "has none: write the prompt file as JSONL (.jsonl), one record a line with its image, "
                               f'e.g. {{"prompt": "{missing}", "image": "first_frames/0001.png"}}'), line
        assert not (out / "eval_before.json").exists()  # refused before the first evaluation sampled anything


@pytest.mark.parametrize("name", ["wan21", "wan21_i2v"])
def test_both_wan_loaders_name_the_defaults_and_the_options_when_no_size_was_given(name, tmp_path_factory):
    """The tiny Wan folders' rotary tables (32 positions) are too short for the pipelines' default 480 x 832: the
    text-to-video and the image-to-video loaders say alike which sizes were defaulted and how to give them."""
    from flowgrpo.models import load_model

    with pytest.raises(ValueError) as err:
        load_model(str(tiny_folder(CASES[name], tmp_path_factory)), height=None, width=None, max_sequence_length=16,
                   num_frames=5)
    assert "height and width not given, so the pipeline's defaults (480x832, 81 frames) were used: give --height " \
           "and --width (model.height, model.width in a config)" in str(err.value)
