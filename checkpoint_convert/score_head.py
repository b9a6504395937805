"""A fresh reward model from a causal LM, for a trainer that starts one from a causal LM's weights.

Pure: no file I/O. `score_head_from_causal(config)` returns the reward model's config.json (the
family's SCORE_ARCHITECTURE, `*ForSequenceClassification`, with id2label/label2id for num_labels
labels and a pad_token_id, which transformers' head needs to find each sequence's last token) and a
new `score.weight` [num_labels, hidden] drawn as transformers initialises a linear layer (normal,
std `initializer_range`). The reward model's other tensors are the causal LM's `model.*`
unchanged; its lm_head.weight is left out. Written as an HF directory, the result converts like
any reward model (families/__init__.py, mapping.py: `score.weight` on the last stage).
"""

from __future__ import annotations

import torch

from checkpoint_convert.families import family_of_config, spec_from_hf_config
from checkpoint_convert.families.base import DTYPES, ConversionError


def score_head_from_causal(
    config: dict, *, num_labels: int = 1, pad_token_id: int | None = None, seed: int = 0, source: str = "config.json"
) -> tuple[dict, torch.Tensor]:
    """(reward model config.json, fresh score.weight in the config's dtype) for the causal LM of
    `config`; pad_token_id: the config's own when None (one line when neither is set)."""
    spec = spec_from_hf_config(config, source=source)
    if spec.num_labels:
        raise ConversionError(f"{source}: field 'architectures' is {spec.architecture!r}, already a reward model")
    architecture = getattr(family_of_config(config, source=source), "SCORE_ARCHITECTURE", None)
    if architecture is None:
        raise ConversionError(f"{source}: field 'architectures' is {spec.architecture!r}; transformers has no "
                              "*ForSequenceClassification variant of it")
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ConversionError(f"num_labels: must be a positive integer, got {num_labels!r}")
    pad = config.get("pad_token_id") if pad_token_id is None else pad_token_id
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < spec.vocab_size:
        raise ConversionError(f"{source}: field 'pad_token_id' is {pad!r}; a reward model needs a token id below "
                              f"vocab_size ({spec.vocab_size}) to find each sequence's last token")
    labels = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    reward = {**config, "architectures": [architecture], "id2label": labels,
              "label2id": {name: int(i) for i, name in labels.items()}, "pad_token_id": pad}
    reward.pop("num_labels", None)  # id2label says it, as transformers writes it
    std = float(config.get("initializer_range") or 0.02)
    weight = torch.randn((num_labels, spec.hidden_size), generator=torch.Generator().manual_seed(seed)) * std
    return reward, weight.to(DTYPES[spec.torch_dtype])
