"""Strategies answer for themselves: no library module outside a strategy's own asks for it by name.

Whatever needs to know what an objective, chunker, policy loss, group filter, advantage estimator or SDE kind does
asks the strategy (an attribute or method of its class or of its settings model), never compares its registered
name; so a plugin's strategy is treated as what it declares. The check parses every module of ``flowgrpo/`` (ast)
and finds each string literal equal to a registered name outside the module that registers it and the module that
declares its registry; what remains is allow-listed below, each with its reason.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from flowgrpo.algo.advantages import ESTIMATORS
from flowgrpo.algo.chunkers import CHUNKERS
from flowgrpo.algo.filters import GROUP_FILTERS
from flowgrpo.algo.objectives import OBJECTIVES
from flowgrpo.algo.policy_losses import POLICY_LOSSES
from flowgrpo.sampling.sde import SDE_KINDS

ROOT = Path(__file__).resolve().parent.parent
#: each registry and the module that declares it (its settings' defaults live there)
REGISTRIES = {
    OBJECTIVES: "flowgrpo/algo/objectives/base.py",
    CHUNKERS: "flowgrpo/algo/chunkers/base.py",
    POLICY_LOSSES: "flowgrpo/algo/policy_losses/base.py",
    GROUP_FILTERS: "flowgrpo/algo/filters.py",
    ESTIMATORS: "flowgrpo/algo/advantages.py",
    SDE_KINDS: "flowgrpo/sampling/sde.py",
}
#: names left out of the search: ``none`` (the group filter that keeps every sample) is also the off value of
#: unrelated settings (model.compile, sampling.cache, parallel.sharding, parallel.offload); a registry's aliases
#: (``grpo``, ``flow_grpo``, ``flowgrpo`` for sde_ratio) are spellings for users, and collide with the advantage
#: estimator ``grpo``, the KL form ``flow_grpo`` and the package's name
NOT_SEARCHED = {"none"}
#: (module, name) -> why the literal is there
ALLOWED = {
    # the config's declarations: defaults and the migration of old keys
    ("flowgrpo/sampling/config.py", "flow_sde"): "SamplingConfig.sde_kind's default",
    ("flowgrpo/config/schema.py", "grpo"): "AdvantageConfig.name's default",
    ("flowgrpo/config/loading.py", "sapo"): "MOVED_KEYS: the old algo.sapo_* keys move into the sapo loss section",
    ("flowgrpo/config/loading.py", "dual_clip"): "MOVED_KEYS: algo.dual_clip_c moves into the dual_clip section",
    ("flowgrpo/config/loading.py", "clipped"): "algo.policy_loss's default, where the loader reads an unset one",
    # a metric key, not the policy loss
    ("flowgrpo/algo/objectives/awm.py", "clipped"): "the metric objective/clipped (fraction of clipped ratios)",
    ("flowgrpo/algo/objectives/dgpo.py", "clipped"): "the metric objective/clipped (fraction of clipped ratios)",
    ("flowgrpo/algo/objectives/sde_ratio.py", "clipped"): "the metric policy/clipped (fraction of clipped pairs)",
    # another registry's declaration of the same word
    ("flowgrpo/algo/objectives/sde_ratio.py", "grpo"): "registers the objective alias grpo (not the estimator)",
    # a strategy choosing the SDE step it runs (a use of the registry, as a config's sde_kind is), not a question
    # about what a kind does
    ("flowgrpo/sampling/rollout.py", "ode"): "the sampler's deterministic steps and the evaluation's ODE sampler",
    ("flowgrpo/algo/chunkers/entropy_merge.py", "ode"): "E-GRPO's ODE continuations run the ode step",
    ("flowgrpo/algo/objectives/paths.py", "ode"): "a path rollout without noise runs the ode step",
    ("flowgrpo/algo/objectives/paths.py", "flow_sde"): "a path rollout with noise a runs flow_sde (the releases')",
    ("flowgrpo/algo/objectives/opd.py", "ode"): "OPD's student rolls out with Euler steps at noise 0",
    ("flowgrpo/algo/objectives/opd.py", "flow_sde"): "OPD's student rolls out with flow_sde at objective.noise_level",
    # entropy_merge's refusal names the kinds its entropy threshold cannot run on, one reason each (the text of
    # its one-line error)
    ("flowgrpo/algo/chunkers/entropy_merge.py", "cps"): "the refusal's reason for cps (entropy falls with a jump)",
}
#: folders whose modules name strategies to run them, as tests do
EXEMPT = ("flowgrpo/testing/",)


def _owners() -> dict[str, set[str]]:
    """Registered name -> the modules allowed to write it: the one that registers it and its registry's."""
    out: dict[str, set[str]] = {}
    for registry, declared in REGISTRIES.items():
        for name in registry.names():
            module = Path(inspect.getsourcefile(registry.get(name))).resolve().relative_to(ROOT).as_posix()
            out.setdefault(name, set()).update({module, declared})
    for name in NOT_SEARCHED:
        out.pop(name, None)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of ``tree`` (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _name_literals(owners: dict[str, set[str]]) -> list[tuple[str, int, str]]:
    """(module, line, name) of each string literal that is a registered name outside the modules it may be in."""
    found = []
    for path in sorted((ROOT / "flowgrpo").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module.startswith(EXEMPT):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owners
                    and id(node) not in docs and module not in owners[node.value]):
                found.append((module, node.lineno, node.value))
    return found


def test_no_strategy_is_asked_for_by_name_outside_its_own_module():
    owners = _owners()
    assert {"sde_ratio", "nft", "window", "per_step", "clipped", "gfpo", "rloo", "cps"} <= set(owners)
    bad = [f"{m}:{line}: {name!r}" for m, line, name in _name_literals(owners) if (m, name) not in ALLOWED]
    assert not bad, "a strategy's name outside its own module (ask the strategy instead):\n" + "\n".join(bad)


def test_every_allowed_name_is_still_there():
    """An allow-list entry whose literal is gone is removed with it (the list says only what is true)."""
    seen = {(m, name) for m, _, name in _name_literals(_owners())}
    assert not sorted(set(ALLOWED) - seen)
