"""Model families, one module each: its HF config -> ModelSpec translation (`spec_from_config`),
the TransformerConfig fields that differ by family (`transformer_fields`) and its literal key
map (`layer_keys`). A module names the `ARCHITECTURE` and `MODEL_TYPE` it serves, and the
`QUANT_METHODS` of `quantization_config` it dequantises on import (none when absent: a quantised
checkpoint is then refused in one line, `base.refuse_quantization`).

A family whose transformers class has a `*ForSequenceClassification` variant names it as
`SCORE_ARCHITECTURE`: a config.json whose one `architectures` entry is that class is the family's
reward model. Its weights are the causal LM's body (`model.*`, the same key map) and a score head
`score.weight` [num_labels, h] in place of `lm_head.weight`; its spec has `num_labels` (>= 1,
`base.num_labels_of`) and `tie_word_embeddings` False (there is no LM head to tie), while the
config.json itself (architectures, id2label, pad_token_id, tie_word_embeddings) is carried
verbatim, so an export is the same class. mapping.py places the head (`score.weight`, replicated on
every tp rank of the last pipeline stage).

Every module of this package other than `base` is a family: adding one is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from types import ModuleType

from checkpoint_convert.families.base import ConversionError, ModelSpec, num_labels_of, refuse_quantization

_REQUIRED = ("ARCHITECTURE", "MODEL_TYPE", "spec_from_config", "layer_keys", "transformer_fields")


def _load() -> dict[str, ModuleType]:
    modules = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        missing = [name for name in _REQUIRED if not hasattr(module, name)]
        if missing:
            raise ImportError(f"family module {module.__name__} lacks {', '.join(missing)}")
        modules[module.MODEL_TYPE] = module
    return modules


FAMILY_MODULES: dict[str, ModuleType] = _load()  # model_type -> module
ARCHITECTURES: dict[str, str] = {m.ARCHITECTURE: t for t, m in FAMILY_MODULES.items()}  # architecture -> model_type
SCORE_ARCHITECTURES: dict[str, str] = {  # a family's reward model (`*ForSequenceClassification`) -> model_type
    m.SCORE_ARCHITECTURE: t for t, m in FAMILY_MODULES.items() if hasattr(m, "SCORE_ARCHITECTURE")
}


def supported() -> str:
    return ", ".join(sorted({**ARCHITECTURES, **SCORE_ARCHITECTURES}))


def family_of_config(config: dict, *, source: str) -> ModuleType:
    """The family module of an HF config.json: by its one `architectures` entry (a causal LM or
    the family's reward model), else by `model_type`. An unknown architecture is one line listing
    the supported ones."""
    architectures = config.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or len(architectures) != 1:
            raise ConversionError(f"{source}: field 'architectures' must list exactly one architecture, got {architectures!r}")
        architecture = architectures[0]
        if architecture in SCORE_ARCHITECTURES:
            return FAMILY_MODULES[SCORE_ARCHITECTURES[architecture]]
        if architecture not in ARCHITECTURES:
            raise ConversionError(f"{source}: field 'architectures' is {architecture!r}; supported: {supported()}")
        return FAMILY_MODULES[ARCHITECTURES[architecture]]
    model_type = config.get("model_type")
    if model_type not in FAMILY_MODULES:
        raise ConversionError(f"{source}: field 'architectures' is missing and model_type {model_type!r} is not known; supported: {supported()}")
    return FAMILY_MODULES[model_type]


def family_of(spec: ModelSpec) -> ModuleType:
    return FAMILY_MODULES[spec.family]


def spec_from_hf_config(config: dict, *, source: str = "config.json") -> ModelSpec:
    """Validate an HF config.json (as a dict) and extract what the model needs (a reward model:
    the family's spec with its score head's `num_labels`, nothing tied)."""
    if not isinstance(config, dict):
        raise ConversionError(f"{source}: expected a JSON object")
    family = family_of_config(config, source=source)
    refuse_quantization(config, source=source, readable=getattr(family, "QUANT_METHODS", ()))
    spec = family.spec_from_config(config, source=source)
    if config.get("architectures") == [getattr(family, "SCORE_ARCHITECTURE", None)]:
        spec = replace(spec, architecture=family.SCORE_ARCHITECTURE, num_labels=num_labels_of(config, source=source),
                       tie_word_embeddings=False)
    return spec
