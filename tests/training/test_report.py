"""What a researcher reads at the end of a run (flowgrpo.training.report): the end-of-run report with a task's
per-group table, the before/after picture, the model card, quiet library logs, a whole run without evaluation
prompts. The epoch line is specified in tests/test_metrics.py, the pictures' layout in tests/test_plots.py,
``--help`` in tests/config/test_help.py. Expected values are computed here by hand or from the inputs, never copied
from the code's output."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


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


# ------------------------------------------------------------------ model card
def _config(**kw):
    from flowgrpo.config import build_config

    return build_config({"output_dir": "runs/flux", "model": {"pretrained": "black-forest-labs/FLUX.1-dev", **kw}})


def test_model_card_names_base_algorithm_figures_and_loading():
    import yaml

    from flowgrpo.training.model_card import model_card

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


@pytest.mark.parametrize("pipeline, task", [("FluxPipeline", "text-to-image"), ("WanPipeline", "text-to-video"),
                                            ("WanImageToVideoPipeline", "image-to-video"),
                                            ("LTX2ImageToVideoPipeline", "image-to-video")])
def test_the_model_card_tags_the_task_of_its_pipeline(pipeline, task):
    """A video model's card was tagged text-to-image (issue 54): the tag is the pipeline's task."""
    import yaml

    from flowgrpo.training.model_card import model_card

    front = yaml.safe_load(model_card(_config(finetune="lora"), SUMMARY, pipeline_class=pipeline,
                                      repo="me/x").split("---")[1])
    others = {"text-to-image", "text-to-video", "image-to-video"} - {task}
    assert task in front["tags"] and not others & set(front["tags"])


def test_quiet_libraries_hides_http_request_lines_unless_debugging():
    from flowgrpo.models.quiet import quiet_libraries

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
