"""GRPO on the digits task, one row per setting, over several RL seeds (a table; never a test).

    python bench/learning.py [--seed 0 1 2] [--base-seed 0 1 2] [--rows default old_default ...] [--epochs N]
                             [--set KEY=VALUE ...] [--eval-every 5] [--out runs/learning] [--resume] [--json PATH]

Every row starts from the same pretrained base model and changes only the settings named in its row: ``default``
is the shipped ``flowgrpo/tasks/digits/default.yaml`` as it is when the bench runs; ``per_step_default`` and
``old_default`` write out the settings that file shipped before (per-step Flow-GRPO with KL beta 0.04, before
E-GRPO became the default; uncapped ``digit_correctness``, lr 2e-4, clip 2e-4, 80 epochs, before the collapse
work); the chunker, SDE, estimator, policy-loss and filter rows change the default in one respect (a chunker row
replaces the whole ``chunker`` section; ``cps`` also trains per step, since E-GRPO refuses CPS). Overrides are
applied in this order: the row's, then ``--set`` (shared by every row), then ``--epochs`` (if given; otherwise
each row keeps its config's ``train.num_epochs``), then the bench's own (seed, output folder, ``logging.eval_every``).
``--set`` may be given more than once (its lists combine); ``--epochs`` must be >= 1 and each ``--seed`` in 0 to
2**32 - 1. Every (row, seed)'s config is built and validated (``flowgrpo.config.build_config``, as its run builds
it) before the first run trains: a bad one (e.g. a ``--set`` key that a row's chunker lacks) stops the bench with an
error naming the row, nothing trained.

Base models (``--base-seed``): without it every run starts from the config's ``model.pretrained`` (the cached
digits base of pretraining seed 0, or whatever ``--set model.pretrained=…`` names). With ``--base-seed B …`` (each
in 0 to 2**32 - 1, no repeats) the base is a random draw, a stand-in for another machine's build (an AMD and an
Intel CPU build different bytes, :mod:`flowgrpo.builds.repeatable`): every (row, base, seed) trains from the digits
base of
pretraining seed B (:func:`flowgrpo.tasks.digits.model.ensure_digits_model`, built into the cache first if absent,
about 5 minutes of one thread each, before any run trains), through ``model.pretrained=<its folder>`` after every
other override; ``--set model.pretrained=…`` is then refused. Each run's JSON and the per-run table record the base
seed and its weights' sha256 (:func:`flowgrpo.builds.repeatable.weights_digest`), so 3 base seeds × 3 RL seeds come out
of one command.

Per (row, seed) the run folder is ``OUT/<row>/seed<s>/`` (with base seeds ``OUT/<row>/base<b>/seed<s>/``) and its
figures go to ``OUT/<row>/seed<s>.json`` (``OUT/<row>/base<b>/seed<s>.json``) as soon as the run ends, so an
interrupted table keeps its finished runs; ``--resume`` skips every run whose JSON exists (and refuses one written
with other overrides or from a base of other bytes). Runs go one after another.

Figures per run (from the run's ``summary.json`` and ``metrics.jsonl``):

- judge correctness: the independent judge's strict correctness on the evaluation images (1000 seeded ODE images,
  100 per digit, by default), before and after;
- diversity ratio: per digit d, intra-digit diversity after RL / the same digit's real diversity; the table shows
  the average over digits and the minimum over digits (a collapse of one digit to a prototype shows in the minimum);
- RL wall time: the sum over epochs of the epoch phases' ``timing/<phase>`` seconds (rollout, reward, filter,
  advantage, plan, recompute, update), without ``timing/eval`` (the periodic evaluation the bench asks for) and
  without the before/after evaluation, the final save and the model's one-time pretraining;
- epochs to reach judge correctness 0.97: the first periodic evaluation (every ``--eval-every`` epochs, key
  ``eval/correctness``) at or above it, counted in epochs done; the final evaluation counts as epoch
  ``train.num_epochs``; none (``—``) if never;
- time to quality (the summary's, :func:`flowgrpo.tasks.digits.report.time_to_quality`): the epochs done and the RL
  seconds (as above, through that epoch) at the first evaluation with judge correctness >= 0.97 and every digit
  >= 0.6 (and, a second column, >= 0.7) of its real diversity; the cell is ``epochs; seconds`` (mean (min–max) over
  the seeds that got there, ``k/n seeds`` when some did not);
- the steady state from epoch 60 (:func:`steady_state`): the smallest min per-digit diversity ratio over the
  evaluations after 60 epochs or more (the periodic ones and the final one), and how many seeds keep every one of
  them at judge correctness >= 0.97 with every digit >= 0.7 of its real diversity (``—``: no evaluation that late);
  the per-run table also gives the smallest judge correctness over those evaluations;
- the main job's bar (:func:`meets_bar`): the final evaluation at judge correctness >= 0.97 with every digit >= 0.65
  of its real diversity, and every evaluation from epoch 60 on at judge >= 0.95 with every digit >= 0.6.

Rows ``nft``, ``awm`` and ``dgpo`` train the shipped ``configs/digits_<method>.yaml`` (the forward-process
objectives; :data:`ROW_BASES`) instead of the default, with the same bench overrides.

The table gives, per row, the mean over its runs (seeds, and base seeds if given) and the spread as (min–max) over
them; a second table gives every run on its own line (:func:`runs_markdown`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from flowgrpo.tasks.digits.report import QUALITY_JUDGE, QUALITY_RATIOS
from flowgrpo.writing.outputs import OutputRefused, check_file, check_folder, claim_folder

#: the shipped digits.yaml's settings before the collapse work, written out so the row keeps them whatever the
#: shipped default becomes
OLD_DEFAULT = [
    "rewards=[{name: digit_correctness}]", "advantage.name=grpo", "objective.policy_loss=clipped",
    "objective.clip_range=2.0e-4",
    "objective.kl_beta=0", "train.lr=2.0e-4", "train.num_epochs=80", "train.prompts_per_epoch=16", "train.group_size=8",
    "train.rollout_batch_size=32", "train.train_batch_size=null", "train.optimizer_steps_per_epoch=2",
    "objective.chunker={name: per_step}", "sampling.sde_kind=flow_sde", "sampling.noise_level=0.7",
    "model.finetune=full",
    "group_filter={name: none}", "advantage.std_eps=1.0e-4", "train.lr_schedule=constant", "train.lr_min_ratio=0",
]

#: the shipped digits.yaml between the collapse work and E-GRPO (Flow-GRPO's per-step chunker, KL beta 0.04, 16
#: prompts an epoch, 50 epochs), written out so the row keeps it whatever the shipped default becomes
PER_STEP_DEFAULT = [
    "rewards=[{name: digit_correctness, kwargs: {cap: 0.8}}]", "advantage.name=grpo", "objective.policy_loss=clipped",
    "objective.clip_range=3.0e-4", "objective.kl_beta=0.04", "objective.kl_form=flow_grpo", "train.lr=3.0e-4",
    "train.num_epochs=50", "train.prompts_per_epoch=16", "train.group_size=8", "train.rollout_batch_size=32",
    "train.train_batch_size=null", "train.optimizer_steps_per_epoch=2", "objective.chunker={name: per_step}",
    "sampling.sde_kind=flow_sde", "sampling.noise_level=0.7", "model.finetune=full", "group_filter={name: none}",
    "advantage.std_eps=1.0e-4", "train.lr_schedule=constant", "train.lr_min_ratio=0",
]

ROWS: dict[str, list[str]] = {
    "default": [],
    "per_step_default": PER_STEP_DEFAULT,
    "old_default": OLD_DEFAULT,
    # chunkers on the default (each replaces the default's whole chunker section)
    "per_step": ["objective.chunker={name: per_step}"],
    "chunk": ["objective.chunker={name: chunk, min_chunk_size: 2}"],
    "chunk_fixed": ["objective.chunker={name: chunk, chunk_sizes: [2, 2, 4]}"],
    "trajectory": ["objective.chunker={name: trajectory}"],
    "window": ["objective.chunker={name: window, window_size: 4, window_shift_every: 20}"],
    "entropy_merge": ["objective.chunker={name: entropy_merge, entropy_threshold: 0.9, sde_fraction: 0.5}"],
    # SDE kinds on the default
    "flow_sde": ["sampling.sde_kind=flow_sde", "sampling.noise_level=0.7"],
    # DanceGRPO's eta 0.7 reaches at most 0.72 nats per dim in E-GRPO's first four steps: tau 0.3 (jumps (0, 2), (2, 2))
    "dance_sde": ["sampling.sde_kind=dance_sde", "sampling.noise_level=0.7", "objective.chunker.entropy_threshold=0.3"],
    # E-GRPO refuses CPS (its std shrinks as a jump grows, so a merge lowers the entropy): CPS with per-step
    # training, its deterministic last step left out
    "cps": ["sampling.sde_kind=cps", "sampling.noise_level=0.8",
            "objective.chunker={name: per_step, drop_last_step: true}"],
    # advantage estimators
    "dr_grpo": ["advantage.name=dr_grpo", "advantage.std_eps=0.0001"],  # the std floor is read by grpo alone
    "rloo": ["advantage.name=rloo", "advantage.std_eps=0.0001"],
    "grpo_global_std": ["advantage.global_std=true"],
    # policy losses (flowgrpo.algo.policy_losses) beside the clipped default; SAPO's temperature ~1/clip_range, since
    # flow-model ratios move ~1e-4 from 1 (the paper's 1.0/1.05 are for LLM token ratios)
    "sapo": ["objective.policy_loss={name: sapo, tau_pos: 5000, tau_neg: 5250}"],
    "dual_clip": ["objective.policy_loss={name: dual_clip, c: 3}"],
    "grpo_guard": ["objective.policy_loss=grpo_guard"],
    # GFPO: draw G' = 16 per prompt, keep the 8 of largest reward spread (PODS max-variance selection)
    "gfpo": ["train.group_size=16", "group_filter={name: gfpo, keep: 8, select: max_spread}"],
    # online difficulty filtering (arXiv 2504.03380): a group trains only while at most 6 of its 8 samples reach
    # the reward's cap
    "pass_rate": ["group_filter={name: pass_rate, pass_threshold: 0.8, max_pass_rate: 0.75}"],
    # the forward-process objectives, each its shipped digits config (ROW_BASES), as it is when the bench runs
    "nft": [],
    "awm": [],
    "dgpo": [],
}

#: rows trained from a config of their own instead of the default (a path from the repository root)
ROW_BASES = {"nft": "configs/digits_nft.yaml", "awm": "configs/digits_awm.yaml", "dgpo": "configs/digits_dgpo.yaml"}

#: how the table's settings column names a row whose overrides are too long to print (default: its overrides)
ROW_LABELS = {"default": "digits.yaml",
              "per_step_default": "PER_STEP_DEFAULT: per_step, KL beta 0.04, 16 prompts, 50 epochs (digits.yaml "
              "before E-GRPO)",
              "old_default": "OLD_DEFAULT: uncapped digit_correctness, lr 2e-4, clip 2e-4, 80 epochs (digits.yaml "
              "before the collapse work)", **ROW_BASES}

TARGET = 0.97  # judge correctness the "epochs to reach" column counts to
JUDGE_KEY = "eval/correctness"  # the judge's strict correctness in a periodic evaluation record
EXCLUDED_PHASES = ("eval",)  # timing/<phase> not counted as RL time
STEADY_FROM = 60  # the steady-state columns read the evaluations after this many epochs and later
STEADY_RATIO = 0.7  # ... each at judge >= TARGET with every digit >= this ratio of its real diversity
RATIO_KEY = "eval/diversity_min_ratio"  # the smallest per-digit diversity ratio in a periodic evaluation record
BAR_FINAL = (0.97, 0.65)  # the main job's bar: the final evaluation's (judge correctness, min per-digit ratio) ...
BAR_STEADY = (0.95, 0.6)  # ... and every evaluation's from epoch STEADY_FROM on
#: the names this bench gives the folders of --out (one per row): a folder holding only them is its own
OWN_NAMES = "|".join(re.escape(name) for name in ROWS)


def rl_seconds(records: list[dict]) -> float:
    """Sum over the epoch records of ``timing/<phase>`` seconds, phases in :data:`EXCLUDED_PHASES` left out (the
    library's :func:`flowgrpo.tasks.digits.report.rl_seconds`, which the summary's time to quality counts)."""
    from flowgrpo.tasks.digits.report import rl_seconds as library_rl_seconds

    return library_rl_seconds(records)


def epochs_to_reach(records: list[dict], summary: dict, target: float = TARGET) -> int | None:
    """Epochs done at the first evaluation with judge correctness >= ``target``: a periodic one (record of 0-based
    ``epoch`` e counts as e + 1 epochs) or else the final one (``summary["epochs"]``); None if none reached it."""
    for r in sorted(records, key=lambda r: r["epoch"]):
        v = r.get(JUDGE_KEY)
        if v is not None and v >= target:
            return r["epoch"] + 1
    after = summary.get("correctness_after")
    return summary["epochs"] if after is not None and after >= target else None


def steady_state(records: list[dict], summary: dict, start: int = STEADY_FROM) -> tuple[float | None, bool | None]:
    """(smallest min per-digit diversity ratio, whether every evaluation is steady) over the evaluations after
    ``start`` epochs or more: the periodic ones (record of 0-based ``epoch`` e counts as e + 1 epochs) and the final
    one (``summary["epochs"]``). Steady: judge correctness >= :data:`TARGET` and min ratio >= :data:`STEADY_RATIO`.
    (None, None) when the run has no evaluation that late."""
    evals = [(r.get(JUDGE_KEY), r.get(RATIO_KEY)) for r in records if r["epoch"] + 1 >= start and JUDGE_KEY in r]
    if summary.get("epochs", 0) >= start and "correctness_after" in summary:
        evals.append((summary.get("correctness_after"), summary.get("diversity_min_ratio_after")))
    evals = [(j, m) for j, m in evals if j is not None and m is not None]
    if not evals:
        return None, None
    return min(m for _, m in evals), all(j >= TARGET and m >= STEADY_RATIO for j, m in evals)


def steady_judge_min(records: list[dict], summary: dict, start: int = STEADY_FROM) -> float | None:
    """The smallest judge correctness over the evaluations after ``start`` epochs or more (as
    :func:`steady_state` counts them); None when the run has none that late."""
    got = [r[JUDGE_KEY] for r in records if r["epoch"] + 1 >= start and r.get(JUDGE_KEY) is not None]
    if summary.get("epochs", 0) >= start and summary.get("correctness_after") is not None:
        got.append(summary["correctness_after"])
    return min(got) if got else None


def meets_bar(fig: dict) -> bool | None:
    """Whether one run's figures (:func:`seed_figures`) meet the main job's bar: final judge correctness and min
    per-digit ratio at least :data:`BAR_FINAL`, and the smallest of each over the evaluations from epoch
    :data:`STEADY_FROM` on at least :data:`BAR_STEADY`; None when the run has no evaluation that late."""
    late = (fig.get("judge_min_from_60"), fig.get("min_ratio_from_60"))
    if None in late or fig.get("correctness_after") is None:
        return None
    return (fig["correctness_after"] >= BAR_FINAL[0] and fig["ratio_min_after"] >= BAR_FINAL[1]
            and late[0] >= BAR_STEADY[0] and late[1] >= BAR_STEADY[1])


def seed_figures(run_dir: Path) -> dict:
    """The figures of one finished run folder (``summary.json`` and ``metrics.jsonl``), see the module docstring.
    Raises ``ValueError`` when the summary has no per-digit diversity (not a digits run)."""
    from flowgrpo.tasks.digits.report import per_digit_rows, quality_figures
    from flowgrpo.writing.metrics import read_metrics

    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    ratios = [r["ratio_after"] for r in per_digit_rows(summary) if r["ratio_after"] is not None]
    if not ratios:
        raise ValueError(f"{run_dir / 'summary.json'} has no digit_<d>_diversity_after/_real: not a digits run")
    last = records[-1] if records else {}
    late_min, steady = steady_state(records, summary)
    digits = [r for r in per_digit_rows(summary) if r["ratio_after"] is not None]
    return {
        "min_ratio_from_60": late_min, "steady_from_60": steady,
        "judge_min_from_60": steady_judge_min(records, summary),
        "ratio_min_digit": min(digits, key=lambda r: r["ratio_after"])["digit"],
        "correctness_before": summary.get("correctness_before"), "correctness_after": summary.get("correctness_after"),
        "diversity_after": summary.get("diversity_after"), "diversity_real": summary.get("diversity_real"),
        "ratio_mean_after": sum(ratios) / len(ratios), "ratio_min_after": min(ratios),
        "epochs": summary["epochs"], "rl_seconds": rl_seconds(records),
        "eval_seconds_periodic": sum(r.get("timing/eval") or 0.0 for r in records),
        "epochs_to_target": epochs_to_reach(records, summary),
        **{k: v for k, v in quality_figures(records, summary).items() if k not in ("quality_bar", "quality_skipped")},
        "calls_per_epoch": last.get("rollout/transformer_calls"),
        "rows_per_epoch": last.get("rollout/transformer_rows"),
        "trajectories_per_epoch": last.get("rollout/trajectories"),
        "extra_sample_frac": last.get("filter/extra_sample_frac", 0.0),
    }


def spread(values: list[float | None], fmt: str) -> str:
    """``mean (min–max)`` over the values that are not None; with some None, ``; k/n seeds`` is added; ``—`` if
    all are None."""
    got = [v for v in values if v is not None]
    if not got:
        return "—"
    text = f"{sum(got) / len(got):{fmt}}"
    if len(got) > 1:
        text += f" ({min(got):{fmt}}–{max(got):{fmt}})"
    return text if len(got) == len(values) else f"{text}; {len(got)}/{len(values)} seeds"


def _quality_cell(col: dict[str, list], ratio: float) -> str:
    """The time-to-quality cell of a row: ``epochs; seconds`` spreads over the seeds that reached it (older
    per-seed files without the figures count as not reached)."""
    n = len(col["seed"])
    epochs = col.get(f"quality_{ratio}_epoch", [None] * n)
    seconds = col.get(f"quality_{ratio}_rl_seconds", [None] * n)
    got = [i for i, e in enumerate(epochs) if e is not None]
    if not got:
        return "—"
    text = f"{spread([epochs[i] for i in got], '.0f')}; {spread([seconds[i] for i in got], '.0f')} s"
    return text if len(got) == n else f"{text}; {len(got)}/{n} seeds"


def run_label(result: dict) -> str:
    """How the tables name one run: its RL seed, or ``<base seed>/<RL seed>`` for a run from a ``--base-seed``
    base."""
    base = result.get("base_seed")
    return str(result["seed"]) if base is None else f"{base}/{result['seed']}"


def aggregate(results: list[dict]) -> list[dict]:
    """Per row (in first-seen order): its seeds, its runs' labels (:func:`run_label`) and the table's cells
    (mean (min–max) over the row's runs)."""
    rows: dict[str, list[dict]] = {}
    for r in results:
        rows.setdefault(r["row"], []).append(r)
    out = []
    for name, rs in rows.items():
        col = {k: [r[k] for r in rs] for k in rs[0]}
        out.append({
            "row": name, "settings": ROW_LABELS.get(name, " ".join(ROWS.get(name, []))), "seeds": col["seed"],
            "runs": [run_label(r) for r in rs],
            "correctness_after": spread(col["correctness_after"], ".3f"),
            "ratio_mean_after": spread(col["ratio_mean_after"], ".2f"),
            "ratio_min_after": spread(col["ratio_min_after"], ".2f"),
            "rl_seconds": spread(col["rl_seconds"], ".0f"), "epochs": spread(col["epochs"], ".0f"),
            "epochs_to_target": spread(col["epochs_to_target"], ".0f"),
            **{f"quality_{r}": _quality_cell(col, r) for r in QUALITY_RATIOS},
            "min_ratio_from_60": spread(col.get("min_ratio_from_60", [None] * len(rs)), ".2f"),
            "steady": (f"{sum(bool(v) for v in col.get('steady_from_60', []))} of {len(rs)}"
                       if any(v is not None for v in col.get("steady_from_60", [])) else "—"),
            "bar": (f"{sum(bool(meets_bar(r)) for r in rs)} of {len(rs)}"
                    if any(meets_bar(r) is not None for r in rs) else "—"),
            "calls_rows": " / ".join("—" if v is None else f"{v:.0f}"
                                     for v in (rs[0]["calls_per_epoch"], rs[0]["rows_per_epoch"])),
            "extra_samples": f"{rs[0]['extra_sample_frac']:.0%}",
        })
    return out


def markdown(table: list[dict]) -> str:
    """The aggregated rows as a Markdown table (settings: the row's own; shared overrides are printed above it)."""
    lines = [f"| row | seeds | judge correctness after | diversity ratio, mean over digits | "
             f"min per-digit diversity ratio | RL wall time (s) | epochs | epochs to {TARGET} | "
             f"smallest min ratio, evaluations from epoch {STEADY_FROM} | seeds steady from {STEADY_FROM} "
             f"(judge >= {TARGET}, min ratio >= {STEADY_RATIO}) | runs meeting the bar | "
             + "".join(f"time to judge >= {QUALITY_JUDGE} with every digit >= {r}: epoch; RL s | "
                       for r in QUALITY_RATIOS)
             + "calls / rows per epoch | extra samples | settings |", "|" + "---|" * (14 + len(QUALITY_RATIOS))]
    for t in table:
        lines.append(f"| {t['row']} | {' '.join(t['runs'])} | {t['correctness_after']} | "
                     f"{t['ratio_mean_after']} | {t['ratio_min_after']} | {t['rl_seconds']} | {t['epochs']} | "
                     f"{t['epochs_to_target']} | {t['min_ratio_from_60']} | {t['steady']} | {t['bar']} | "
                     + "".join(f"{t[f'quality_{r}']} | " for r in QUALITY_RATIOS) + f"{t['calls_rows']} | "
                     f"{t['extra_samples']} | `{t['settings']}` |")
    return "\n".join(lines)


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else f"{value:{fmt}}"


def runs_markdown(results: list[dict]) -> str:
    """Every run on its own line: row, base (seed and the first 8 hex digits of its transformer's sha256; ``—``
    without ``--base-seed``), RL seed, judge correctness before → after, the smallest per-digit diversity ratio after
    (its digit), time to quality (``epoch; RL s`` per ratio of :data:`QUALITY_RATIOS`), the smallest judge correctness
    and min ratio over the evaluations from epoch :data:`STEADY_FROM` on, whether the run meets the bar
    (:func:`meets_bar`), and its RL seconds."""
    lines = ["| row | base seed | base transformer sha256 | RL seed | judge before → after | min per-digit ratio "
             "after (digit) | " + "".join(f"time to judge >= {QUALITY_JUDGE}, every digit >= {r}: epoch; RL s | "
                                        for r in QUALITY_RATIOS)
             + f"from epoch {STEADY_FROM}: smallest judge / smallest min ratio | meets the bar | RL s |",
             "|" + "---|" * (9 + len(QUALITY_RATIOS))]
    for r in results:
        digest = (r.get("base_sha256") or {}).get("transformer")
        quality = "".join(
            ("— | " if r.get(f"quality_{q}_epoch") is None
             else f"{r[f'quality_{q}_epoch']}; {_num(r.get(f'quality_{q}_rl_seconds'), '.0f')} | ")
            for q in QUALITY_RATIOS)
        bar = meets_bar(r)
        lines.append(
            f"| {r['row']} | {_num(r.get('base_seed'), 'd')} | {'—' if digest is None else f'`{digest[:8]}…`'} | "
            f"{r['seed']} | {_num(r['correctness_before'], '.3f')} → {_num(r['correctness_after'], '.3f')} | "
            f"{r['ratio_min_after']:.3f} ({r.get('ratio_min_digit', '?')}) | {quality}"
            f"{_num(r.get('judge_min_from_60'), '.3f')} / {_num(r.get('min_ratio_from_60'), '.3f')} | "
            f"{'—' if bar is None else ('yes' if bar else 'no')} | {r['rl_seconds']:.0f} |")
    return "\n".join(lines)


def row_data(name: str | None = None) -> dict:
    """The config a row starts from, as a dict: its own config (:data:`ROW_BASES`, with its bases) or the runner's
    default config."""
    from flowgrpo.config.loading import read_yaml
    from flowgrpo.runner import DEFAULT_CONFIG

    if name in ROW_BASES:
        return read_yaml(Path(__file__).resolve().parents[1] / ROW_BASES[name])
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def row_config(overrides: list[str], seed: int, run_dir: Path, name: str | None = None):
    """The config one (row, seed) trains with: the row's starting config (:func:`row_data`), the row's (and shared)
    overrides, then the bench's own. Raises ``flowgrpo.config.ConfigError`` (a ``ValueError``)."""
    from flowgrpo.config import build_config

    data = row_data(name)
    return build_config(data, [*overrides, f"train.seed={seed}", f"output_dir={run_dir}", "logging.progress=false",
                               "logging.overwrite=true"])


@dataclass(frozen=True)
class Base:
    """One ``--base-seed`` base model: its pretraining ``seed``, its pipeline ``folder`` and ``sha256``
    (:func:`flowgrpo.builds.repeatable.weights_digest`: component name -> hex digest of its weights)."""

    seed: int
    folder: Path
    sha256: dict[str, str]


def locate_base(seed: int) -> Base:
    """The digits base of pretraining ``seed`` (:func:`flowgrpo.tasks.digits.model.ensure_digits_model`: built into
    the cache first if absent, minutes) and its weights' sha256."""
    from flowgrpo.builds.repeatable import weights_digest
    from flowgrpo.tasks.digits.model import ensure_digits_model

    folder = Path(ensure_digits_model(seed))
    return Base(seed=seed, folder=folder, sha256=weights_digest(folder))


def run_path(out_root: Path, name: str, seed: int, base_seed: int | None = None) -> Path:
    """The run folder of one (row, [base,] seed): ``out_root/<row>/seed<s>``, or ``out_root/<row>/base<b>/seed<s>``
    for a ``--base-seed`` base; its figures go to the same path with ``.json``."""
    folder = out_root / name if base_seed is None else out_root / name / f"base{base_seed}"
    return folder / f"seed{seed}"


def base_override(base: Base | None) -> list[str]:
    """The override that points a run at ``base`` (none without one)."""
    return [] if base is None else [f"model.pretrained={base.folder}"]


def run_one(name: str, overrides: list[str], seed: int, out_root: Path, base: Base | None = None) -> dict:
    """Trains one (row, [base,] seed) into :func:`run_path` and writes its figures next to it as JSON (with the
    base's seed and sha256 when a ``base`` is given)."""
    from flowgrpo.runner import run

    run_dir = run_path(out_root, name, seed, None if base is None else base.seed)
    cfg = row_config([*overrides, *base_override(base)], seed, run_dir, name)
    start = time.perf_counter()
    run(cfg)
    result = {"row": name, "seed": seed, "overrides": overrides, "process_seconds": time.perf_counter() - start,
              **({} if base is None else {"base_seed": base.seed, "base_sha256": base.sha256}),
              **seed_figures(run_dir)}
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
    path = run_dir.with_suffix(".json")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(clean, indent=1))
    tmp.replace(path)
    return clean


def load_finished(path: Path, overrides: list[str], base: Base | None = None) -> dict | None:
    """A finished run's figures, or None if not run yet. Raises ``ValueError`` when it was run with other
    overrides, or from another base (another base seed, or a base of the same seed whose weights have other
    bytes, e.g. built on another CPU): choose another ``--out`` or delete the file."""
    if not path.exists():
        return None
    got = json.loads(path.read_text())
    if got["overrides"] != overrides:
        raise ValueError(f"{path} was run with overrides {got['overrides']}, not {overrides}; use another --out or "
                         "delete it to re-run")
    want = (None, None) if base is None else (base.seed, base.sha256)
    if (got.get("base_seed"), got.get("base_sha256")) != want:
        raise ValueError(f"{path} was run from base seed {got.get('base_seed')} with sha256 "
                         f"{got.get('base_sha256')}, not {want[0]} with {want[1]}; use another --out or delete it "
                         "to re-run")
    return got


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed_int(text: str) -> int:
    """An argparse type: an RL seed, an integer from 0 to 2**32 - 1 (what numpy's seeding accepts)."""
    value = int(text)
    if not 0 <= value <= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**32 - 1, got {value}")
    return value


def make_parser() -> argparse.ArgumentParser:
    """The bench's argument parser (the module docstring is its description)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=positive_int, default=None, help="train.num_epochs (>= 1) for every row "
                        "(default: each row's config: digits.yaml's for most, 80 for old_default)")
    parser.add_argument("--seed", type=seed_int, nargs="+", default=[0, 1, 2], help="RL seeds (0 to 2**32 - 1)")
    parser.add_argument("--base-seed", type=seed_int, nargs="+", default=None, metavar="B",
                        help="digits base models by pretraining seed (0 to 2**32 - 1), each built into the cache "
                        "if absent; every row and RL seed runs on each (default: the config's model.pretrained)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--eval-every", type=int, default=5, help="logging.eval_every of every row (epochs to 0.97)")
    parser.add_argument("--out", default="runs/learning", help="run folders and per-(row, seed) JSON files")
    parser.add_argument("--resume", action="store_true", help="skip the (row, seed) pairs whose JSON exists")
    parser.add_argument("--json", help="also write every run's figures here (one list)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --json file when it exists")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                        help="overrides applied to every row after its own (e.g. a smaller budget); may be repeated")
    return parser


def check_rows(parser: argparse.ArgumentParser, args: argparse.Namespace, shared: list[str]) -> None:
    """Builds every (row, seed)'s config as its run will, before any training: a bad one is a parser error (exit
    status 2) naming the row."""
    from flowgrpo.tasks.digits.model import default_model_dir

    bases = [None] if args.base_seed is None else args.base_seed
    for name in args.rows:
        for b in bases:
            point = [] if b is None else [f"model.pretrained={default_model_dir(b)}"]  # built later, if absent
            for seed in args.seed:
                try:
                    row_config([*ROWS[name], *shared, *point], seed, run_path(Path(args.out), name, seed, b), name)
                except ValueError as err:  # flowgrpo.config.ConfigError is a ValueError
                    parser.error(f"row {name!r}: {'; '.join(str(err).splitlines())}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The bench's arguments and the overrides every row shares; every row's config checked (see :func:`check_rows`)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.eval_every < 1:
        parser.error(f"--eval-every must be >= 1 (epochs to {TARGET} needs periodic evaluation), got {args.eval_every}")
    for flag, values in (("--seed", args.seed), ("--base-seed", args.base_seed or [])):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            parser.error(f"{flag} names {', '.join(map(str, repeated))} more than once; each seed runs once")
    if args.base_seed is not None:
        named = [s for s in args.set if s.split("=", 1)[0].strip() == "model.pretrained"]
        if named:
            parser.error(f"--set {named[0]} and --base-seed both choose the base model; give one of them")
    shared = [*args.set, *([f"train.num_epochs={args.epochs}"] if args.epochs is not None else []),
              f"logging.eval_every={args.eval_every}"]
    check_rows(parser, args, shared)
    # flowgrpo's write rule (flowgrpo.writing.outputs): --out empty, absent or this bench's (a folder of an older
    # version holds only row folders: OWN_NAMES); --json replaced only with --overwrite; before any base model or run
    try:
        check_folder(args.out, "--out", "learning bench", own_names=OWN_NAMES)
        if args.json:
            check_file(args.json, "--json", overwrite=args.overwrite)
    except OutputRefused as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return args, shared


def main() -> None:
    args, shared = parse_args()
    out_root = Path(args.out)
    claim_folder(out_root, "learning bench", "--out")  # checked by parse_args
    bases: list[Base | None] = [None]
    if args.base_seed is not None:
        bases = []
        for b in args.base_seed:
            bases.append(locate_base(b))
            print(f"base seed {b}: {bases[-1].folder}, sha256 "
                  + ", ".join(f"{k} {v}" for k, v in bases[-1].sha256.items()), flush=True)
    results = []
    for name in args.rows:
        overrides = [*ROWS[name], *shared]
        for base in bases:
            for seed in args.seed:
                path = run_path(out_root, name, seed, None if base is None else base.seed).with_suffix(".json")
                r = load_finished(path, overrides, base) if args.resume else None
                r = r or run_one(name, overrides, seed, out_root, base)
                results.append(r)
                print(f"{name} {'' if base is None else f'base {base.seed} '}seed {seed}: judge "
                      f"{r['correctness_before']:.3f} -> {r['correctness_after']:.3f}, diversity ratio mean "
                      f"{r['ratio_mean_after']:.2f} min {r['ratio_min_after']:.2f}, RL {r['rl_seconds']:.0f} s, "
                      f"epochs to {TARGET}: {r['epochs_to_target'] or '—'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\nRL seeds {' '.join(map(str, args.seed))}"
          + ("" if args.base_seed is None else f"; base seeds {' '.join(map(str, args.base_seed))} (runs: base/RL)")
          + f"; every row also has: {' '.join(shared)}\ncells: mean over runs (min–max over runs)\n", flush=True)
    print(markdown(aggregate(results)), flush=True)
    print("\n" + runs_markdown(results), flush=True)


if __name__ == "__main__":
    main()
