"""What a researcher reads: the epoch line, the per-digit figures, the end-of-run report, the pictures, the
model card, ``--help`` and the launch defaults. Expected values are computed here by hand or from the inputs,
never copied from the code's output."""

from __future__ import annotations

import io
import itertools
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ epoch line
def test_epoch_line_shows_progress_eta_reward_and_later_updates():
    from flowgrpo.metrics import epoch_line

    record = {"reward/total/mean": 0.625, "reward/total/std": 0.25, "adv/kept_frac": 0.75, "plan/trained_frac": 0.5,
              "policy/clipfrac": 0.0, "policy/approx_kl": 0.0, "policy/logprob_mismatch_max": 0.0,
              "policy_later/clipfrac": 0.125, "policy_later/approx_kl": 3e-6}
    line = epoch_line(record, 4, 80, elapsed=65.0, eta=75 * 13.0)
    assert line.startswith("epoch 5/80 · 1:05 elapsed · ETA 16:15")  # 975 s = 16 min 15 s
    assert "reward 0.625 ± 0.25" in line
    assert "trained 75% of samples, 50% of steps" in line
    assert "later clip 0.125 kl 3e-06" in line
    assert "mismatch" not in line and "policy/clipfrac" not in line  # the on-policy step's 0 is not news
    line = epoch_line({**record, "adv/learning_frac": 0.75}, 4, 80, elapsed=65.0, eta=0.0)
    assert "trained 75% of samples, 50% of steps" in line  # every kept sample carries a signal: no note
    line = epoch_line({**record, "adv/learning_frac": 0.0}, 4, 80, elapsed=65.0, eta=0.0)
    assert "trained 75% of samples (0% with a learning signal), 50% of steps" in line  # a constant reward
    line = epoch_line({**record, "policy/logprob_mismatch_max": 1.2e-7}, 0, 3, elapsed=3725.0, eta=0.0)
    assert line.startswith("epoch 1/3 · 1:02:05 elapsed · ETA 0:00")
    assert line.endswith("first-update mismatch 1.2e-07")


# ------------------------------------------------------------------ per-digit figures
def test_min_diversity_ratio_is_the_worst_digit_against_its_own_real_diversity():
    from flowgrpo.tasks.digits.scoring import min_diversity_ratio

    assert min_diversity_ratio({0: 20.0, 1: 20.0}, {0: 25.0, 1: 40.0}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="digits \\[2\\]"):
        min_diversity_ratio({2: 1.0}, {0: 1.0})
    with pytest.raises(ValueError, match="at least one digit"):
        min_diversity_ratio({}, {0: 1.0})


# ------------------------------------------------------------------ end-of-run report
SUMMARY = {
    "correctness_before": 0.5, "correctness_after": 0.9, "diversity_before": 38.0, "diversity_after": 20.0,
    "diversity_real": 36.0, "diversity_min_ratio_before": 0.9, "diversity_min_ratio_after": 0.25,
    **{f"digit_{d}_{k}": v for d in range(10) for k, v in
       {"correctness_before": 0.5, "correctness_after": 1.0, "diversity_before": 38.0,
        "diversity_after": 30.0 if d != 4 else 10.0, "diversity_real": 40.0}.items()},
    "epochs": 3, "train_seconds": 9.0, "phase_seconds": {"rollout": 3.0, "update": 6.0, "eval": 1.0},
    "outputs": {"run folder": "runs/x", "weights": "runs/x/transformer", "model card": "runs/x/transformer/README.md"},
}


def test_report_says_where_what_per_digit_and_how_long():
    from flowgrpo.tasks.digits.report import digit_table
    from flowgrpo.training.report import format_report

    text = format_report(SUMMARY, [digit_table(SUMMARY)])
    assert "runs/x/transformer/README.md" in text
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.split()}
    assert rows["correctness"][1:] == ["0.5000", "0.9000"]
    assert rows["diversity_min_ratio"][1:] == ["0.9000", "0.2500"]
    assert "digit_4_diversity" not in text  # per-digit figures go to their own table, not the main one
    assert rows["4"][1:6] == ["0.500", "1.000", "38.0", "10.0", "40.0"] and rows["4"][6] == "0.250"
    assert "collapsed" in " ".join(rows["4"]) and "collapsed" not in " ".join(rows["3"])
    assert rows["update"][1:] == ["6.0", "60.0%"]  # 6 of 10 s
    assert rows["all"][1] == "10.0"
    # the table takes only its per-digit figures: the optimised reward's own mean stays in the main table
    more = {**SUMMARY, "digit_correctness_mean_before": 0.4, "digit_correctness_mean_after": 0.6}
    rows = {ln.split()[0]: ln.split() for ln in format_report(more, [digit_table(more)]).splitlines() if ln.split()}
    assert rows["digit_correctness_mean"][1:] == ["0.4000", "0.6000"]


# ------------------------------------------------------------------ pictures
def test_before_after_has_a_per_digit_row(tmp_path):
    from flowgrpo.plots import before_after
    from flowgrpo.tasks.digits.report import digit_table

    table = digit_table(SUMMARY)
    footer = table.panels
    assert len(footer) == 10
    assert footer[4] == "digit 4\ncorrect 0.50→1.00\ndiversity 38→10\n0.250× real collapsed"  # 10 / 40
    assert footer[3].endswith("0.750× real")  # 30 / 40, not flagged
    assert table.alerts == (False,) * 4 + (True,) + (False,) * 5
    before_after(torch.rand(20, 3, 32, 32), torch.rand(20, 3, 32, 32), ["p"] * 20, tmp_path / "ba.png",
                 footer=list(table.panels), alerts=list(table.alerts))
    assert (tmp_path / "ba.png").read_bytes()[:4] == b"\x89PNG"


def test_smooth_is_a_trailing_mean():
    from flowgrpo.plots import smooth

    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]


def test_reward_curve_one_panel_per_component_no_duplicate_total():
    from flowgrpo.plots import reward_curve_figure

    one = [{"epoch": e, "reward/jpeg/mean": float(e), "reward/total/mean": float(e)} for e in range(20)]
    fig = reward_curve_figure(one)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["reward: jpeg"]
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["per epoch", "smoothed"]
    two = [{**r, "reward/clip/mean": 1.0, "eval/jpeg/mean": 2.0, "eval/correctness": 0.5,
            "eval/digit_3/diversity": 1.0, "eval/diversity_real": 36.0} for r in one]
    assert [ax.get_title() for ax in reward_curve_figure(two).axes] == [
        "reward: clip", "reward: jpeg", "reward: total", "evaluation: correctness", "evaluation: jpeg"]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_sample_grid_captions_never_overlap():
    from flowgrpo.plots import sample_grid_figure

    images = torch.rand(20, 3, 32, 32)
    long = "a very long prompt about a handwritten digit seven drawn on a napkin in a dark bar at night"
    fig = sample_grid_figure(images, [f"before: {long} {i}" for i in range(20)], ncols=10, title="t",
                             footer=[f"digit {d}\ncorrect 0.50→1.00\ndiversity 38→10\n0.250× real collapsed"
                                     for d in range(10)])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.texts]
    images_ = [ax.get_window_extent(renderer) for ax in fig.axes if ax.images]
    assert len(texts) == 30 and len(images_) == 20
    for a, b in itertools.combinations(texts, 2):
        assert not _overlap(a, b)
    for t in texts:
        assert not any(_overlap(t, im) for im in images_)


# ------------------------------------------------------------------ model card
def _config(**kw):
    from flowgrpo.config import build_config

    return build_config({"output_dir": "runs/flux", "model": {"pretrained": "black-forest-labs/FLUX.1-dev", **kw}})


def test_model_card_names_base_algorithm_figures_and_loading():
    import yaml

    from flowgrpo.model_card import model_card

    text = model_card(_config(finetune="lora", lora_rank=32), SUMMARY, pipeline_class="FluxPipeline",
                      repo="me/flux-rl")
    front = yaml.safe_load(text.split("---")[1])
    assert front["base_model"] == "black-forest-labs/FLUX.1-dev" and front["library_name"] == "diffusers"
    assert "LoRA (rank 32" in text
    assert "chunker\n  `per_step`" in text or "`per_step`" in text
    assert "| correctness | 0.5 | 0.9 |" in text
    assert "![reward curve](reward_curve.png)" in text and "![before after](before_after.png)" in text
    assert 'pipe.load_lora_weights("me/flux-rl")' in text
    assert "output_dir: runs/flux" in text  # the resolved config
    full = model_card(_config(finetune="full"), SUMMARY, repo="me/x")
    assert 'FluxTransformer2DModel.from_pretrained("me/x")' in full and "load_lora_weights" not in full


# ------------------------------------------------------------------ --help and launch defaults
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def _help_value(text: str, key: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == key)
    return line.rsplit("[", 1)[1].rstrip("]")


def test_train_help_shows_the_values_this_command_uses():
    import yaml

    digits = yaml.safe_load((REPO / "flowgrpo" / "configs" / "digits.yaml").read_text())
    out = _run("flowgrpo/train.py", "--help")
    assert out.returncode == 0, out.stderr
    assert _help_value(out.stdout, "train.num_epochs") == str(digits["train"]["num_epochs"])
    assert _help_value(out.stdout, "output_dir") == digits["output_dir"]
    assert _help_value(out.stdout, "model.finetune") == digits["model"]["finetune"]
    assert "base: OTHER.yaml" in out.stdout and "train.resume_from=auto" in out.stdout
    assert "digit_correctness" in out.stdout.split("registered rewards")[1]
    jpeg = yaml.safe_load((REPO / "configs" / "tiny_jpeg.yaml").read_text())
    out = _run("-m", "flowgrpo.cli", "train", "configs/tiny_jpeg.yaml", "train.seed=7", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: flowgrpo train ")
    assert _help_value(out.stdout, "train.num_epochs") == str(jpeg["train"]["num_epochs"])
    assert _help_value(out.stdout, "train.seed") == "7"


def test_geneval_help_shows_defaults():
    out = _run("eval/geneval.py", "--help")
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "(default: 28)" in flat and "(default: 4)" in flat and "(default: float32)" in flat


def test_shipped_launch_defaults_silence_accelerates_warning():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger().addHandler(handler)
    try:
        args = launch_command_parser().parse_args(
            ["--config_file", str(REPO / "configs" / "accelerate" / "default.yaml"), "flowgrpo/train.py"])
        args, _, _ = _validate_launch_command(args)
    finally:
        logging.getLogger().removeHandler(handler)
    assert "were not passed" not in buf.getvalue()
    assert args.num_processes == 1 and args.mixed_precision == "no"


def test_quiet_libraries_hides_http_request_lines_unless_debugging():
    from flowgrpo.runner import quiet_libraries

    root = logging.getLogger()
    old = root.level
    try:
        root.setLevel(logging.INFO)
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        quiet_libraries()
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        root.setLevel(logging.DEBUG)
        quiet_libraries()
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    finally:
        root.setLevel(old)
        logging.getLogger("httpx").setLevel(logging.NOTSET)


# ------------------------------------------------------------------ a whole run without evaluation prompts
def _python_block(markdown: str) -> str:
    return markdown.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_run_without_eval_prompts_reports_card_and_auto_resume(tmp_path, tiny_flux_dir, caplog):
    """A LoRA run on training prompts only: the summary compares the training reward before/after on held-out
    seeds, times every phase, says where everything went; the model card's loading code works with diffusers;
    ``train.resume_from=auto`` continues the run with its saved config."""
    import json

    from flowgrpo.config import build_config
    from flowgrpo.preflight import resolve_auto_resume
    from flowgrpo.runner import run
    from flowgrpo.training.report import format_report

    out = tmp_path / "run"
    data = {
        "output_dir": str(out),
        "model": {"pretrained": str(tiny_flux_dir), "max_sequence_length": 16, "height": 32, "width": 32,
                  "finetune": "lora", "lora_rank": 2},
        "sampling": {"num_steps": 3}, "eval_sampling": {"num_steps": 3},
        "train": {"num_epochs": 2, "prompts_per_epoch": 2, "group_size": 2, "rollout_batch_size": 2,
                  "optimizer_steps_per_epoch": 2, "lr": 1e-2},
        "rewards": [{"name": "jpeg_compressibility"}],
        "data": {"train_prompts": "t2i_compbench", "eval_num_prompts": 3},
        "logging": {"progress": False, "save_every": 1},
    }
    with caplog.at_level(logging.INFO, logger="flowgrpo.training"):
        summary = run(build_config(data))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch ")]
    assert [ln.split(" · ")[0] for ln in lines] == ["epoch 1/2", "epoch 2/2"]
    assert all("ETA" in ln and "reward " in ln and "later clip" in ln for ln in lines)
    assert {"jpeg_compressibility_mean_before", "jpeg_compressibility_mean_after"} <= set(summary)
    assert json.loads((out / "summary.json").read_text())["outputs"]["weights"] == str(out / "lora")
    assert {"rollout", "reward", "update", "eval", "save"} <= set(summary["phase_seconds"])
    assert summary["train_seconds"] == pytest.approx(sum(v for k, v in summary["phase_seconds"].items()
                                                         if k not in ("eval", "save")))
    for path in summary["outputs"].values():
        assert Path(path).exists(), path
    report = format_report(summary)
    assert "jpeg_compressibility_mean" in report and str(out / "lora" / "README.md") in report

    card = (out / "lora" / "README.md").read_text()
    assert str(tiny_flux_dir) in card and "jpeg_compressibility" in card
    assert (out / "lora" / "reward_curve.png").exists() and (out / "lora" / "before_after.png").exists()
    code = _python_block(card).replace("torch.bfloat16", "torch.float32")
    assert "height=32, width=32, num_inference_steps=3" in code  # the run's size and steps, not the pipeline's
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the card's own loading and generating code, run as a user would
    assert any("lora" in n for n, _ in scope["pipe"].transformer.named_parameters())
    assert scope["image"].size == (32, 32)

    again = resolve_auto_resume(build_config({"output_dir": str(out), "train": {"resume_from": "auto"}}),
                                ["train.num_epochs=3"])
    assert again.train.resume_from == str(out / "checkpoints")
    assert again.model.finetune == "lora" and again.train.num_epochs == 3  # the saved config, plus the override
    summary = run(again)
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2]
    fresh = resolve_auto_resume(build_config({"output_dir": str(tmp_path / "new"), "train": {"resume_from": "auto"}}))
    assert fresh.train.resume_from is None


def test_docs_point_at_the_weights_layout_we_write():
    """docs/geneval.md's --lora is the config's ``<output_dir>/lora`` (a run writes no ``checkpoint-N/lora``)."""
    import re

    import yaml

    text = (REPO / "docs" / "geneval.md").read_text()
    out = yaml.safe_load((REPO / "configs" / "sd35_grpo.yaml").read_text())["output_dir"]
    loras = re.findall(r"--lora (\S+)", text)
    assert loras and all(p == f"{out}/lora" for p in loras), loras
    assert "checkpoint-" not in text


def test_configs_name_the_command_that_builds_their_prompt_files():
    import yaml

    for path in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        train = (data.get("data") or {}).get("train_prompts", "")
        if train.startswith("data/"):
            text = path.read_text()
            # a builder command, or (editing sets with source images, which no public set ships) the file's format
            assert "flowgrpo prompts" in text or "geneval.prompts" in text or "# Prompt file: JSONL" in text, path
