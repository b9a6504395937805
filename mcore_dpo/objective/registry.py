"""The objectives a run can train, by name (--objective). Free of torch: the command line
checks a name before the slow imports; `build` imports the objective's module."""

from __future__ import annotations

import importlib

# name -> the module whose `from_config(config)` builds it (objective/contract.py)
MODULES: dict[str, str] = {
    "dpo": "mcore_dpo.objective.dpo",
}


def build(config):
    """The configured objective (`config.objective`, DPO by default)."""
    name = getattr(config, "objective", "dpo")
    if name not in MODULES:
        raise ValueError(f"objective: unknown {name!r}; choose from {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name]).from_config(config)
