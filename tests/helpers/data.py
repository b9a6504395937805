"""Preference data for the tests: tokenized pairs with uneven lengths (`make_pairs`), the packing
settings that fit them (`PACKED`), and JSONL files of text pairs for the command line."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mcore_dpo.data.pairs import TokenizedPair
from tests.helpers.models import VOCAB_SIZE

# Packed microbatches (--packing) for make_pairs' data: the smallest budget --max-length 20
# allows (its sequences have at most 18 tokens), so a global batch of 8 pairs takes 6 or 7
# packed rows where micro_batch_size 2 gives 4 padded microbatches.
PACKED = {"packing": True, "max_length": 20, "max_tokens_per_microbatch": 40}


def make_pairs(num_pairs: int, *, seed: int) -> list[TokenizedPair]:
    """BOS + 1-8 prompt tokens, 1-8 completion tokens + EOS on each side, token ids in [3, VOCAB_SIZE)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in torch.randint(3, VOCAB_SIZE, (n,), generator=gen))

    pairs = []
    for i in range(num_pairs):
        lp, lc, lr = (int(x) for x in torch.randint(1, 9, (3,), generator=gen))
        pairs.append(TokenizedPair(prompt_ids=(1,) + ids(lp), chosen_ids=ids(lc) + (2,), rejected_ids=ids(lr) + (2,), source_line=i + 1))
    return pairs


def write_prefs(path: Path, rows: list[dict]) -> Path:
    """A JSONL preference file, one row a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def merging_bpe_tokenizer(*, chat_template: str | None = None):
    """A character BPE with one merge, "a" + "b" -> "ab", built in memory: a prompt ending in "a"
    followed by a completion starting with "b" (no space between) tokenizes differently together
    than apart. `chat_template`: set as the tokenizer's template."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *"abcxy ", "ab"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    backend.add_special_tokens(["<pad>", "<unk>", "<bos>", "<eos>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
