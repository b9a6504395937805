"""Which losses a run optimises: the loss names and their validated hyper-parameters.

Free of torch, so the command line can parse and check a configuration (and say what it is
about to do) before the slow imports; `mcore_dpo.objective.loss` holds the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_TYPES: tuple[str, ...] = (
    "sigmoid",
    "cdpo",
    "hinge",
    "ipo",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
    "sft",
    "aot",
    "aot_unpaired",
)

# Types that sort over the whole global batch (they need a BatchSort).
SORTED_TYPES: frozenset[str] = frozenset({"aot", "aot_unpaired"})

F_DIVERGENCE_TYPES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

# Types built on the chosen-rejected score difference: the ones a non-default f-divergence may
# change (TRL 1.16's `DPOTrainer.__init__` list, plus this engine's cdpo; sft reads no score).
_F_DIVERGENCE_TYPES_OK: frozenset[str] = frozenset(
    {"sigmoid", "cdpo", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)

# Types whose formula reads label_smoothing; for the others it would be silently ignored.
_SMOOTHED_TYPES: frozenset[str] = frozenset({"cdpo", "robust", "exo_pair", "aot", "aot_unpaired"})

# The EXO paper's ε for exo_pair, which TRL 1.16's `DPOTrainer.__init__` error message recommends.
_EXO_PAIR_DEFAULT_EPS = 1e-3

@dataclass(frozen=True)
class LossSpec:
    """Which losses to optimise and their hyper-parameters."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    """One or more names from LOSS_TYPES; the loss is the weighted sum of their per-pair losses."""
    loss_weights: tuple[float, ...] = (1.0,)
    """One non-negative weight per entry of loss_types."""
    beta: float = 0.1
    """Inverse temperature β of the implicit reward β·(log π - log π_ref)."""
    label_smoothing: float = 0.0
    """ε in [0, 0.5): assumed probability that a preference label is flipped (cdpo, robust, exo_pair)."""
    reference_free: bool = False
    """Treat the reference log-probs as 0 (no reference model)."""
    discopop_tau: float = 0.05
    """Temperature τ of the discopop mixing gate σ(βΔ/τ)."""
    f_divergence_type: str = "reverse_kl"
    """Score f'(u) read by the difference-based losses: one of F_DIVERGENCE_TYPES."""
    f_alpha_divergence_coef: float = 0.5
    """α of alpha_divergence."""
    use_weighting: bool = False
    """Multiply each per-pair loss by the WPO weight w+·w- (PairLogps must carry the log-weights)."""

    def validate(self) -> None:
        """Raise ValueError (one line, naming the field) if the spec cannot be trained."""
        types = tuple(self.loss_types)
        if not types:
            raise ValueError("loss_types: at least one loss type is required")
        for name in types:
            if name not in LOSS_TYPES:
                raise ValueError(f"loss_types: unknown loss type {name!r}; choose from {', '.join(LOSS_TYPES)}")
        duplicates = sorted({name for name in types if types.count(name) > 1})
        if duplicates:
            raise ValueError(f"loss_types: {', '.join(duplicates)} listed more than once; merge their weights")
        weights = tuple(self.loss_weights)
        if len(weights) != len(types):
            raise ValueError(
                f"loss_weights: has {len(weights)} entries but loss_types has {len(types)}; give one weight per type"
            )
        for name, weight in zip(types, weights):
            if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                raise ValueError(f"loss_weights: weight {weight!r} for {name!r} must be a finite number >= 0")
        if sum(weights) <= 0:
            raise ValueError("loss_weights: all weights are 0; at least one must be positive")
        if not math.isfinite(self.beta) or self.beta <= 0:
            raise ValueError(f"beta: must be a finite number > 0, got {self.beta!r}")
        eps = self.label_smoothing
        if not math.isfinite(eps) or not 0.0 <= eps < 0.5:
            raise ValueError(f"label_smoothing: must be in [0, 0.5) (0.5 makes the labels pure noise), got {eps!r}")
        if "exo_pair" in types and eps <= 0:
            raise ValueError(
                f"label_smoothing: exo_pair needs label_smoothing > 0 (its loss has a log ε term); "
                f"the EXO paper recommends {_EXO_PAIR_DEFAULT_EPS:g}"
            )
        if eps > 0 and not _SMOOTHED_TYPES.intersection(types):
            raise ValueError(
                f"label_smoothing: {eps!r} has no effect on loss types {', '.join(types)}; it is used by "
                f"{', '.join(sorted(_SMOOTHED_TYPES))} (use cdpo for label-smoothed sigmoid)"
            )
        if not math.isfinite(self.discopop_tau) or self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau: must be a finite number > 0, got {self.discopop_tau!r}")
        if self.f_divergence_type not in F_DIVERGENCE_TYPES:
            raise ValueError(
                f"f_divergence_type: unknown {self.f_divergence_type!r}; choose from {', '.join(F_DIVERGENCE_TYPES)}"
            )
        if self.f_divergence_type != "reverse_kl":
            unsupported = [name for name in types if name not in _F_DIVERGENCE_TYPES_OK]
            if unsupported:
                raise ValueError(
                    f"f_divergence_type: {self.f_divergence_type} is not defined for {', '.join(unsupported)} "
                    f"(no f-divergence form, as in TRL 1.16); use reverse_kl or choose from "
                    f"{', '.join(sorted(_F_DIVERGENCE_TYPES_OK))}"
                )
        if not math.isfinite(self.f_alpha_divergence_coef):
            raise ValueError(f"f_alpha_divergence_coef: must be a finite number, got {self.f_alpha_divergence_coef!r}")
        if self.use_weighting:
            refused = [name for name in types if name in SORTED_TYPES or name == "sft"]
            if refused:
                raise ValueError(
                    f"use_weighting: not defined for {', '.join(refused)} (aot types sort pairs, which would "
                    f"misalign per-pair weights; TRL 1.16 fails on sft with weighting)"
                )

    @property
    def needs_reference(self) -> bool:
        """Whether the engine runs a reference forward: always unless reference-free. sft alone
        does not read it, but the rewards/* metrics do (TRL 1.16 runs the reference for them too)."""
        return not self.reference_free

    @property
    def needs_batch_sort(self) -> bool:
        """Whether the loss sorts over the global batch (aot, aot_unpaired)."""
        return bool(SORTED_TYPES.intersection(self.loss_types))
