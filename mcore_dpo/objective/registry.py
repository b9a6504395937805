"""The objectives a run can train, by name (--objective). Free of torch: the command line
checks a name, and whether the objective trains against a reference model, before the slow
imports; `build` imports the objective's module."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    module: str
    """The module whose `from_config(config)` builds the objective and whose `spec_of(config)`
    gives its validated hyper-parameters (objective/contract.py)."""
    reference: bool
    """Whether it trains against a frozen reference model (its `needs_reference` when one runs)."""
    options: tuple[str, ...] = ()
    """Its own config fields: refused with another objective, part of its run identity, its --help group."""
    curves: tuple[tuple[str, str, str], ...] = ()
    """Its own metrics to plot, as plot.CURVES lists them (drawn where a run logs them)."""
    default_loss_type: str | None = None
    """The --loss-type it runs when none is given (None: the shared default, DPO's sigmoid)."""
    whole_rows: bool = False
    """Whether a pair longer than --max-length is dropped whole rather than cut (data/pairs.py)."""


OBJECTIVES: dict[str, Entry] = {
    "dpo": Entry("mcore_dpo.objective.dpo", reference=True,
                 options=("loss_weights", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "ld_alpha",
                          "use_weighting", "sync_ref_model", "ref_model"),
                 curves=(("nll_loss", "nll_loss", "NLL of the chosen completions (sft)"),)),
    "cpo": Entry("mcore_dpo.objective.cpo", reference=False, options=("cpo_alpha", "simpo_gamma", "alpha"),
                 curves=(("nll_loss", "nll_loss", "NLL of the chosen completions"),)),
    "orpo": Entry("mcore_dpo.objective.orpo", reference=False,
                  curves=(("nll_loss", "nll_loss", "NLL of the chosen sequences"),
                          ("log_odds_ratio", "log_odds_ratio", "log odds ratio"))),
    "kto": Entry("mcore_dpo.objective.kto", reference=True,
                 options=("desirable_weight", "undesirable_weight", "ref_model"),
                 curves=(("kl", "kl", "KL estimate of the batch"),), default_loss_type="kto"),
    "reward": Entry("mcore_dpo.objective.reward", reference=False, options=("center_rewards_coefficient",),
                    whole_rows=True,  # TRL's RewardTrainer filters, never truncates
                    curves=(("accuracy", "accuracy", "pairs ranked right"), ("margin", "margin", "reward margin"))),
}


def spec_of(config):
    """The configured objective's hyper-parameters (its module's `spec_of`), to validate."""
    return importlib.import_module(OBJECTIVES[config.objective].module).spec_of(config)


def unpaired_data(config):
    """How the token store holds the configured objective's samples: None for preference pairs,
    else its module's `unpaired_data(config)` (data/unpaired.py's Unpaired)."""
    module = importlib.import_module(OBJECTIVES[config.objective].module)
    return module.unpaired_data(config) if hasattr(module, "unpaired_data") else None


def build(config):
    """The configured objective (`config.objective`, DPO by default)."""
    name = getattr(config, "objective", "dpo")
    if name not in OBJECTIVES:
        raise ValueError(f"objective: unknown {name!r}; choose from {', '.join(OBJECTIVES)}")
    return importlib.import_module(OBJECTIVES[name].module).from_config(config)
