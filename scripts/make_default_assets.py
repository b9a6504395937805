"""Build the default assets shipped in mcore_dpo/assets/ (no downloads).

    python scripts/make_default_assets.py            # rewrites mcore_dpo/assets/

Writes:
  - tokenizer/          a small word-level fast tokenizer in Hugging Face format, with
                        <pad>, <unk>, <bos>, <eos>, role markers and a chat template;
  - prefs_train.jsonl   2000 preference pairs in the standard (prompt/chosen/rejected) format;
  - prefs_eval.jsonl    200 held-out pairs drawn from a disjoint set of (prompt, answer) cases.

The task: the prompt asks for two things of one category ("name two fruits"); the
chosen answer names two distinct members of that category, the rejected answer puts
at least one member of another category in. A tiny model learns this from a few
hundred DPO steps and the rule carries over to the held-out pairs.

The output is deterministic: running the script twice gives identical files.
"""
from __future__ import annotations

import argparse
import json
import os
import random

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mcore_dpo", "assets")
SEED = 1234
NUM_TRAIN_PAIRS = 2000
NUM_EVAL_PAIRS = 200

CATEGORIES: dict[str, list[str]] = {
    "animals": ["cat", "dog", "horse", "mouse", "tiger", "rabbit", "sheep", "goat", "lion", "bear"],
    "fruits": ["apple", "pear", "plum", "mango", "grape", "lemon", "cherry", "peach", "banana", "melon"],
    "colors": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"],
    "tools": ["hammer", "saw", "drill", "wrench", "chisel", "shovel", "rake", "axe", "pliers", "ladder"],
}
PROMPT_TEMPLATES = [
    "name two {category} .",
    "please name two {category} .",
    "can you list two {category} ?",
    "tell me two {category} please .",
    "give me two {category} .",
    "which two {category} do you like ?",
]
ANSWER_TEMPLATES = [
    "{a} and {b} .",
    "sure : {a} and {b} .",
    "i would say {a} and {b} .",
    "how about {a} and {b} ?",
]
# Words every tokenizer user will want besides the data set's own vocabulary.
EXTRA_WORDS = [
    "the", "a", "an", "is", "are", "was", "yes", "no", "not", "it", "this", "that", "to", "of", "in",
    "on", "for", "with", "what", "why", "how", "who", "good", "bad", "hello", "hi", "thanks", "ok",
    "one", "three", "four", "five", "question", "answer", "user", "assistant", "system",
    ",", ".", "?", "!", ":", ";", "'", "\"", "(", ")", "-",
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
]
SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
# Each message is "<|role|> content <eos>"; the generation prompt opens the assistant turn,
# so the rendered prompt is a text prefix of the rendered full conversation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _make_pair(rng: random.Random, *, category: str, template: str) -> dict[str, str]:
    members = CATEGORIES[category]
    others = [word for name, words in CATEGORIES.items() if name != category for word in words]
    a, b = rng.sample(members, 2)
    answer = rng.choice(ANSWER_TEMPLATES)
    # Half the rejected answers are entirely wrong, half keep one right word, so the
    # model must judge each word, not just the first one.
    if rng.random() < 0.5:
        wrong_a, wrong_b = rng.sample(others, 2)
    else:
        wrong_a, wrong_b = (a, rng.choice(others)) if rng.random() < 0.5 else (rng.choice(others), b)
    return {
        "prompt": template.format(category=category),
        "chosen": answer.format(a=a, b=b),
        "rejected": answer.format(a=wrong_a, b=wrong_b),
    }


def make_pairs() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Train and eval pairs; no (prompt, chosen) of the eval set occurs in the train set."""
    rng = random.Random(SEED)
    train: list[dict[str, str]] = []
    eval_pairs: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    categories = sorted(CATEGORIES)
    while len(eval_pairs) < NUM_EVAL_PAIRS:
        pair = _make_pair(rng, category=rng.choice(categories), template=rng.choice(PROMPT_TEMPLATES))
        key = (pair["prompt"], pair["chosen"])
        if key not in seen:
            seen.add(key)
            eval_pairs.append(pair)
    while len(train) < NUM_TRAIN_PAIRS:
        pair = _make_pair(rng, category=rng.choice(categories), template=rng.choice(PROMPT_TEMPLATES))
        if (pair["prompt"], pair["chosen"]) not in seen:
            train.append(pair)
    return train, eval_pairs


def _vocabulary(pairs: list[dict[str, str]]) -> list[str]:
    words: set[str] = set(EXTRA_WORDS)
    for pair in pairs:
        for text in pair.values():
            words.update(text.split())
    return SPECIAL_TOKENS + sorted(words)


def make_tokenizer(vocabulary: list[str]) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(vocabulary)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    # BOS is added on request (add_special_tokens=True); EOS is the data pipeline's job.
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_jsonl(path: str, rows: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=ASSETS_DIR, help="where to write the assets")
    args = parser.parse_args()
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    train, eval_pairs = make_pairs()
    _write_jsonl(os.path.join(out_dir, "prefs_train.jsonl"), train)
    _write_jsonl(os.path.join(out_dir, "prefs_eval.jsonl"), eval_pairs)
    tokenizer = make_tokenizer(_vocabulary(train + eval_pairs))
    tokenizer.save_pretrained(os.path.join(out_dir, "tokenizer"))
    print(f"wrote {len(train)} train pairs, {len(eval_pairs)} eval pairs, vocabulary {len(tokenizer)} to {out_dir}")


if __name__ == "__main__":
    main()
