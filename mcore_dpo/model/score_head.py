"""The scalar score head of a reward model (`--objective reward`, objective/reward.py).

A reward model is the causal transformer with `score` [num_labels, h] (no bias) in place of the
LM head, as transformers' `*ForSequenceClassification` has it. On the last pipeline stage the
head is a module `score` of the GPTModel, whole and identical on every tp rank (a few rows: the
final norm's output is whole on every tp rank, so each computes the same gradient), under the name
the converter's shards use (`score.weight`, checkpoint_convert/mapping.py). megatron-core's
GPTModel calls its `output_layer` after the final norm; that becomes a parameterless call of
`score`, so the stage's output is [rows, s, num_labels] scores instead of vocab-parallel logits.

Where the run starts from a causal LM, the head is new: `reward_config` turns the source's
config.json into the reward model's (`checkpoint_convert.score_head.score_head_from_causal`,
which also draws the fresh weight as transformers initialises it: normal, std
initializer_range, here seeded by --seed). A `*ForSequenceClassification` source brings its own.
"""

from __future__ import annotations

import torch


class _ScoreOutput:
    """GPTModel's `output_layer` on a reward model: (score(hidden), None), holding no parameters
    of its own (the head is the model's `score`). With sequence parallelism the final norm's
    output is this tp rank's slice of the sequence [s/tp, b, h]: it is gathered whole first, as
    megatron-core's column-parallel output layer gathers it. Every tp rank then scores the same
    whole rows, so the gather's backward keeps this rank's slice of the (identical) gradient
    rather than summing the tp copies (tensor_parallel_output_grad=False)."""

    def __init__(self, score: torch.nn.Linear, *, sequence_parallel: bool):
        self.score, self.sequence_parallel = score, sequence_parallel

    def __call__(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return self.score(hidden_states), None


def attach_score_head(model: torch.nn.Module, *, num_labels: int, hidden_size: int, dtype: torch.dtype) -> None:
    """Replace the last stage's LM head of `model` (a GPTModel) by a `score` head [num_labels, h]."""
    del model.output_layer
    device = next(model.parameters()).device
    model.score = torch.nn.Linear(hidden_size, num_labels, bias=False, dtype=dtype, device=device)
    # Not a submodule: the head's parameters are named once, as score.weight.
    model.output_layer = _ScoreOutput(model.score, sequence_parallel=model.config.sequence_parallel)


def source_config(path: str) -> dict:
    """The HF config.json of a model directory: an HF directory's own, a converted one's source."""
    from checkpoint_convert.io import open_hf_dir
    from checkpoint_convert.mcore_dir import is_mcore_dir, open_mcore_dir

    return open_mcore_dir(path).meta.hf_config if is_mcore_dir(path) else open_hf_dir(path).config


def reward_config(hf_config: dict, *, pad_token_id: int, seed: int) -> tuple[dict, torch.Tensor | None]:
    """(the reward model's config.json, its fresh score.weight) for a run that trains one from a
    model of `hf_config`: a reward model's own config (with the run's pad) and None; a causal LM's turned into one
    (its architecture's *ForSequenceClassification, one label, pad_token_id: the run's pad, which
    marks where each row ends) and a new head drawn from `seed`."""
    from checkpoint_convert.families import spec_from_hf_config
    from checkpoint_convert.score_head import score_head_from_causal

    if spec_from_hf_config(hf_config).num_labels:
        return {**hf_config, "pad_token_id": pad_token_id}, None
    return score_head_from_causal(hf_config, num_labels=1, pad_token_id=pad_token_id, seed=seed)


class WithFreshScore:
    """HF-named weights (open_weights' `get` / `get_part`) with `score.weight` added: a causal
    LM's, for a reward model started from it."""

    def __init__(self, weights, score: torch.Tensor):
        self.weights, self.score = weights, score

    def get(self, name: str) -> torch.Tensor:
        return self.score if name == "score.weight" else self.weights.get(name)

    def get_part(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name == "score.weight":
            return self.score.narrow(dim, start, stop - start)
        return self.weights.get_part(name, dim, start, stop)
