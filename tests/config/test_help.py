"""Specification of ``--help`` (flowgrpo.config.help): ``train.py --help`` lists every field of the schema with its
description and the value this command would use (``flowgrpo train`` too); ``eval/geneval.py --help`` shows its
defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from flowgrpo.config import Config

REPO = Path(__file__).resolve().parents[2]


def _schema_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, description) of every leaf field, walked from the pydantic schema here in the test."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _schema_keys(ann, f"{prefix}{name}.")
        else:
            rows.append((prefix + name, field.description or ""))
    return rows


def test_train_help_lists_every_field():
    out = subprocess.run([sys.executable, str(REPO / "flowgrpo" / "train.py"), "--help"], capture_output=True,
                         text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 0, out.stderr
    keys = _schema_keys(Config)
    assert len(keys) > 50
    lines = out.stdout.splitlines()
    for key, description in keys:
        line = next((ln for ln in lines if ln.split() and ln.split()[0] == key), None)
        assert line is not None, f"--help does not list {key}"
        assert description[:30] in line, f"--help does not describe {key}"


# ------------------------------------------------------------------------------------- the values this command uses
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=1800, cwd=REPO)


def _help_value(text: str, key: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == key)
    return line.rsplit("[", 1)[1].rstrip("]")


def test_train_help_shows_the_values_this_command_uses():
    import yaml

    digits = yaml.safe_load((REPO / "flowgrpo" / "tasks" / "digits" / "default.yaml").read_text())
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


# ------------------------------------------------------------------------------- lists derived from the registries
def _rows(text: str) -> dict[str, str]:
    return {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  ") and ln.split()}


def test_help_lists_every_registered_name_and_no_stale_list():
    """The strategies, a registered field's names, the model families and the embedded prompt sets are read from
    their registries when --help is shown: a plugin registered now is listed too."""
    from flowgrpo.algo.objectives import OBJECTIVES, SdeRatio
    from flowgrpo.config.schema import STRATEGY_SECTIONS
    from flowgrpo.data.prompts import EMBEDDED
    from flowgrpo.models import ADAPTERS, EMBEDDED_MODELS
    from flowgrpo.runner import help_text
    from flowgrpo.sampling.config import SamplingConfig
    from flowgrpo.sampling.sde import SDE_KINDS

    OBJECTIVES.register("help_probe")(SdeRatio)
    try:
        text = help_text(None, [])
    finally:
        OBJECTIVES.unregister("help_probe")
    rows = _rows(text)
    for prefix, (registry, _) in STRATEGY_SECTIONS.items():
        listed = rows[f"{prefix}.name"].split("(registered: ")[1].split(")")[0].split(", ")
        assert listed == sorted(registry.names() + (["help_probe"] if registry is OBJECTIVES else [])), prefix
    for name in [*ADAPTERS.names(), *EMBEDDED_MODELS]:
        assert name in rows["model.pretrained"], name
    for key in ("data.train_prompts", "data.eval_prompts"):
        for name in EMBEDDED:
            assert name in rows[key], (key, name)
    assert SDE_KINDS.names() and all(n in rows["sampling.sde_kind"] for n in SDE_KINDS.names())
    assert "RegisteredIn" in repr(SamplingConfig.model_fields["sde_kind"].metadata)
    assert "FLUX.1 or SD3.5" not in text and "an embedded set: digits, t2i_compbench" not in text


def test_help_shows_strategy_settings_the_chosen_strategy_does_not_read_as_not_read():
    """A setting of another objective (refl has no solver) or one the objective has but never reads (sft's
    solver) shows no value, as no value of it is used; the ones it reads show the config's."""
    from flowgrpo.runner import help_text

    def value(rows: dict, key: str) -> str:
        return rows[key].rsplit("[", 1)[1].rstrip("]")

    refl = _rows(help_text("configs/digits_refl.yaml", []))
    assert value(refl, "objective.solver_noise_level") == "not read by objective 'refl'"
    assert value(refl, "objective.k") == "1" and value(refl, "objective.variant") == "draft_k"
    assert value(refl, "objective.chunker.window_size") == "not read by objective 'refl'"  # sde_ratio's chunker
    digits = _rows(help_text(None, []))  # sde_ratio with E-GRPO's chunker: another chunker's setting
    assert value(digits, "objective.chunker.window_size") == "not read by objective.chunker 'entropy_merge'"
    assert value(digits, "objective.chunker.sde_fraction") == "0.5"
    sft = _rows(help_text("configs/digits_sft.yaml", []))
    for key in ("solver", "solver_noise_level", "grid", "adv_clip_max", "decay_cap", "pairs"):
        assert value(sft, f"objective.{key}") == "not read by objective 'sft'", key
    assert value(sft, "objective.num_train_timesteps") == "1" and value(sft, "objective.kl_beta") == "0.0"
    assert "[awm, dgpo, dpo, nft, srpo] " in sft["objective.solver"]  # who reads it: not sft, which has it unread


def test_help_of_an_objective_the_config_refuses_shows_the_configs_values_and_marks_the_refused_ones():
    """``objective=nft`` (or dpo) over the digits default with a rollout setting only the SDE-ratio objective reads
    (``sampling.noise_level``): --help showed every row at the schema's default (objective.name 'sde_ratio',
    model.pretrained 'tiny'); it shows the command's own values, lists the refusals first and marks each refused row
    with the value it accepts. The SDE-ratio objective's own settings (its clip range, chunker) are its section's,
    replaced with it: shown as not read, never refused."""
    import yaml

    from flowgrpo.runner import help_text

    digits = yaml.safe_load((REPO / "flowgrpo" / "tasks" / "digits" / "default.yaml").read_text())
    for name in ("nft", "dpo"):
        text = help_text(None, [f"objective={name}", "sampling.noise_level=0.5"])
        rows = _rows(text)

        def value(key: str) -> str:
            return rows[key].rsplit("  [", 1)[1].rstrip("]")  # noqa: B023 - used at once

        assert "could not be read" not in text and "schema defaults" not in text
        assert value("objective.name") == name and value("model.pretrained") == digits["model"]["pretrained"]
        assert value("output_dir") == digits["output_dir"]
        head = text.split("\n  output_dir")[0]
        assert f"this command is refused: objective {name!r} cannot run with this config" in head
        assert "sampling.noise_level=0.5 is read only by objective.name=sde_ratio" in head
        assert value("sampling.noise_level") == f"REFUSED: 0.5 (objective {name!r} accepts 0.7)"
        assert value("objective.clip_range") == f"not read by objective {name!r}"  # sde_ratio's own, not a refusal
        assert value("objective.chunker.name") == f"not read by objective {name!r}"
        assert value("sampling.num_steps") == str(digits["sampling"]["num_steps"])  # read by nft and dpo too
        assert "this command is refused" not in help_text(None, [f"objective={name}"])  # its own section: runs
    # a config that runs lists no refusal; one with another fault still falls back to the schema's defaults
    assert "this command is refused" not in help_text("configs/digits_nft.yaml", [])
    assert "the override 'train.num_epochs=0' could not be applied" in help_text(None, ["train.num_epochs=0"])


def test_help_blames_a_bad_override_not_the_config_file(tmp_path):
    from flowgrpo.runner import help_text

    # a typo'd override names the override, not the (good) embedded default
    text = help_text(None, ["train.lr=1e-4", "train.num_epoch=3"])
    head = text.splitlines()[0]
    assert "the override 'train.num_epoch=3' could not be applied to" in head and "(the embedded default)" in head
    assert "unknown config key 'train.num_epoch'" in head and "could not be read" not in head
    # a file that is itself broken is still the one blamed
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {num_epoch: 3}\n")
    head = help_text(str(bad), ["train.lr=1e-4"]).splitlines()[0]
    assert f"{bad} could not be read" in head and "override" not in head


def test_each_shared_knob_is_one_help_row_naming_every_reader():
    """issue #55: kl_beta, clip_range and timestep_fraction were declared in two to four places (algo.*, chunker.*,
    objective.*); each is now one key of the objective section, one --help row listing the objectives that read
    it."""
    from flowgrpo.config.help import describe_fields

    rows = describe_fields()
    readers = {"kl_beta": {"sde_ratio", "nft", "awm", "dgpo", "sft"},
               "clip_range": {"sde_ratio", "awm", "dgpo", "tdm_r1"},
               "timestep_fraction": {"sde_ratio", "nft", "awm", "opd"}, "teacher": {"opd", "dmd2", "tdm_r1"}}
    defaults = {"kl_beta": "0.0", "clip_range": "0.0001", "timestep_fraction": "1.0",  # sde_ratio's, the default's
                "teacher": "None"}
    for leaf, objectives in readers.items():
        (row,) = [r for r in rows if r[0].rsplit(".", 1)[-1] == leaf]
        assert row[0] == f"objective.{leaf}" and row[1] == defaults[leaf], row
        assert set(row[2].split("]")[0].lstrip("[").split(", ")) == objectives, row
