"""``flowgrpo sample``: every option is honoured or refused with a clear error, with and without ``--run``.

With ``--run`` the run's config gives the model and the evaluation settings; ``--seed``, ``--num-steps``,
``--guidance-scale``, ``--dtype``, ``--height``, ``--width`` and ``--max-sequence-length`` replace them when given
(they were once ignored: ``--num-steps 1 --seed 5`` reproduced the run's own evaluation images); ``--model`` and
``--lora`` cannot apply to a run and are refused. The expected images come from the sampler called directly with
the settings the options name.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.cli import main as cli_main


@pytest.fixture
def run_dir(tmp_path, tiny_flux_dir):
    """A run folder's config (tiny FLUX model, 3 evaluation steps, seed 11); weights are not needed with
    ``--no-weights``."""
    from flowgrpo.config import build_config, save_config

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cube\na blue ball\n")
    cfg = build_config({"output_dir": str(tmp_path / "run"),
                        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32,
                                  "width": 32},
                        "eval_sampling": {"num_steps": 3, "guidance_scale": 3.5}, "train": {"seed": 11},
                        "data": {"train_prompts": str(prompts), "eval_num_prompts": 2}})
    (tmp_path / "run").mkdir()
    save_config(cfg, tmp_path / "run" / "config.yaml")
    return tmp_path / "run", cfg


def _expected(cfg, *, steps: int, seed: int, guidance: float) -> torch.Tensor:
    from flowgrpo.models import load_model_from_config
    from flowgrpo.rng import derive_seed
    from flowgrpo.sampling.rollout import generate_images

    adapter = load_model_from_config(cfg.model)
    return generate_images(adapter, ["a red cube", "a blue ball"], [derive_seed(seed, "eval", i) for i in range(2)],
                           num_steps=steps, guidance_scale=guidance, batch_size=8)


def test_sample_run_applies_num_steps_seed_and_guidance(run_dir, tmp_path):
    run, cfg = run_dir
    cli_main(["sample", "--run", str(run), "--no-weights", "--out", str(tmp_path / "plain")])
    cli_main(["sample", "--run", str(run), "--no-weights", "--num-steps", "1", "--seed", "5", "--guidance-scale",
              "2.0", "--out", str(tmp_path / "given")])
    plain, given = (torch.load(tmp_path / d / "images.pt") for d in ("plain", "given"))
    torch.testing.assert_close(plain, _expected(cfg, steps=3, seed=11, guidance=3.5), rtol=0, atol=1e-6)
    torch.testing.assert_close(given, _expected(cfg, steps=1, seed=5, guidance=2.0), rtol=0, atol=1e-6)
    assert float((plain - given).abs().max()) > 1e-2


def test_sample_run_rebuilds_the_runs_model_with_the_model_options(run_dir, tmp_path, monkeypatch):
    import flowgrpo.models as models

    run, _ = run_dir
    seen = []

    def capture(model_cfg):
        seen.append(model_cfg)
        raise RuntimeError("stop after the model config")

    monkeypatch.setattr(models, "load_model_from_config", capture)
    with pytest.raises(RuntimeError, match="stop after"):
        cli_main(["sample", "--run", str(run), "--no-weights", "--dtype", "bfloat16", "--height", "64", "--width",
                  "48", "--max-sequence-length", "8", "--out", str(tmp_path / "o")])
    m = seen[0]
    assert (m.dtype, m.height, m.width, m.max_sequence_length) == ("bfloat16", 64, 48, 8)
    assert m.pretrained == str(run_dir[1].model.pretrained)  # the run's model, its other settings kept


@pytest.mark.parametrize("extra, match", [
    (["--model", "tiny"], "--model cannot be used with --run"),
    (["--lora", "somewhere"], "--lora cannot be used with --run"),
])
def test_sample_run_refuses_what_cannot_apply_to_a_run(run_dir, tmp_path, capsys, extra, match):
    run, _ = run_dir
    with pytest.raises(SystemExit) as err:
        cli_main(["sample", "--run", str(run), *extra, "--out", str(tmp_path / "o")])
    assert err.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_sample_without_run_applies_its_defaults_and_options(tmp_path, monkeypatch, capsys):
    import flowgrpo.models as models

    seen = []

    def capture(name, **kwargs):
        seen.append((name, kwargs))
        raise RuntimeError("stop after the model options")

    monkeypatch.setattr(models, "load_model", capture)
    for extra in ([], ["--dtype", "bfloat16", "--max-sequence-length", "32", "--height", "16", "--width", "32",
                       "--num-frames", "5"]):
        with pytest.raises(RuntimeError, match="stop after"):
            cli_main(["sample", "--model", "tiny", "--prompts", "digits_eval", *extra, "--out", str(tmp_path / "o")])
    assert seen == [("tiny", {"dtype": "float32", "height": None, "width": None, "max_sequence_length": 512,
                              "num_frames": None}),
                    ("tiny", {"dtype": "bfloat16", "height": 16, "width": 32, "max_sequence_length": 32,
                              "num_frames": 5})]
    with pytest.raises(SystemExit):
        cli_main(["sample", "--model", "tiny", "--lora", "x", "--no-weights", "--out", str(tmp_path / "o")])
    assert "--no-weights samples the base model alone, --lora adds weights" in capsys.readouterr().err


def test_sample_into_its_own_folder_again_holds_only_the_second_calls_images(run_dir, tmp_path):
    """Before: a second call with fewer images left the first call's 00002.png beside the new ones, so the
    folder mixed two calls. A file flowgrpo did not write (the user's notes) is kept."""
    run, _ = run_dir
    out = tmp_path / "samples"
    cli_main(["sample", "--run", str(run), "--no-weights", "--num-steps", "1", "--num-images", "3",
              "--out", str(out)])
    (out / "notes.txt").write_text("mine")
    cli_main(["sample", "--run", str(run), "--no-weights", "--num-steps", "1", "--num-images", "2",
              "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == [".flowgrpo-output", "00000.png", "00001.png", "grid.png",
                                                     "images.pt", "notes.txt"]
    assert len(torch.load(out / "images.pt")) == 2 and (out / "notes.txt").read_text() == "mine"


def test_sample_refuses_an_image_it_did_not_write_before_building_the_model(run_dir, tmp_path, capsys, monkeypatch):
    """A file named as sample names its images but not recorded by an earlier call (a user's own 00005.png, or a
    folder written by a version that recorded nothing) is neither replaced nor left to mix with the new images."""
    import flowgrpo.models as models

    run, _ = run_dir
    out = tmp_path / "samples"
    out.mkdir()
    (out / ".flowgrpo-output").write_text('{"kind": "sample"}\n')
    (out / "00005.png").write_bytes(b"the user's own")
    monkeypatch.setattr(models, "load_model_from_config", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(SystemExit) as err:
        cli_main(["sample", "--run", str(run), "--no-weights", "--out", str(out)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err.value.code == 2 and errors == [
        f"flowgrpo sample: error: --out {str(out)!r} holds '00005.png', which no earlier flowgrpo call recorded "
        "writing: nothing was written; choose another folder, or move it out of this one"], errors
    assert (out / "00005.png").read_bytes() == b"the user's own"
