"""The objectives a run can train, by name (--objective). Free of torch: the command line
checks a name, and whether the objective trains against a reference model, before the slow
imports; `build` imports the objective's module."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    module: str
    """The module whose `from_config(config)` builds the objective (objective/contract.py)."""
    reference: bool
    """Whether it trains against a frozen reference model (its `needs_reference` when one runs)."""


OBJECTIVES: dict[str, Entry] = {
    "dpo": Entry("mcore_dpo.objective.dpo", reference=True),
    "cpo": Entry("mcore_dpo.objective.cpo", reference=False),
    "orpo": Entry("mcore_dpo.objective.orpo", reference=False),
}


def spec_of(config):
    """The configured objective's hyper-parameters (its module's `spec_of`), to validate."""
    return importlib.import_module(OBJECTIVES[config.objective].module).spec_of(config)


def build(config):
    """The configured objective (`config.objective`, DPO by default)."""
    name = getattr(config, "objective", "dpo")
    if name not in OBJECTIVES:
        raise ValueError(f"objective: unknown {name!r}; choose from {', '.join(OBJECTIVES)}")
    return importlib.import_module(OBJECTIVES[name].module).from_config(config)
