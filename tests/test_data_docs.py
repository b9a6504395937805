"""docs/DATA.md's worked example and minimal chat template run as written: the conversion of a
preference set in ultrafeedback_binarized's published column layout gives rows that load, and
the template renders conversations for a tokenizer without one."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from transformers import AutoTokenizer

from mcore_dpo.driver import defaults, run
from mcore_dpo.data.pairs import load_pairs

DOC = (Path(__file__).resolve().parents[1] / "docs" / "DATA.md").read_text(encoding="utf-8")


def _conversation(prompt: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def test_the_worked_example_converts_the_published_layout(tmp_path, monkeypatch):
    import datasets

    code = re.search(r"## Worked example.*?```python\n(.*?)```", DOC, re.S).group(1)
    published = [  # the published columns; two usable pairs, one with another prompt, one tie
        ("name two animals .", "sure : sheep and rabbit .", "name two animals .", "sure : saw and hammer ."),
        ("name two colors .", "sure : purple and brown .", "name two colors .", "sure : tiger and hammer ."),
        ("name two fruits .", "apple and pear .", "name two tools .", "saw and hammer ."),
        ("name two tools .", "saw and hammer .", "name two tools .", "saw and hammer ."),
    ]
    table = datasets.Dataset.from_list([
        {"prompt": p, "prompt_id": str(i), "chosen": _conversation(p, c), "rejected": _conversation(rp, r),
         "messages": _conversation(p, c), "score_chosen": 8.0, "score_rejected": 3.0}
        for i, (p, c, rp, r) in enumerate(published)
    ])
    (tmp_path / "ultrafeedback" / "data").mkdir(parents=True)
    table.to_parquet(str(tmp_path / "ultrafeedback" / "data" / "train_prefs-00000-of-00001.parquet"))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/DATA.md", "exec"), {})
    tokenizer = AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    pairs, stats = load_pairs(str(tmp_path / "prefs.jsonl"), tokenizer=tokenizer, max_length=64)
    assert stats.num_rows == 2 and len(pairs) == 2
    assert tokenizer.decode(pairs[0].chosen_ids, skip_special_tokens=True).strip() == "sure : sheep and rabbit ."


def test_the_minimal_template_renders_for_a_tokenizer_without_one(tmp_path):
    template = re.search(r"A minimal template.*?\n\n((?:    [^\n]*\n)+)", DOC, re.S).group(1)
    (tmp_path / "t.jinja").write_text("".join(line[4:] + "\n" for line in template.splitlines()))
    bare = tmp_path / "tok"
    shutil.copytree(defaults.DEFAULT_TOKENIZER_DIR, bare)
    (bare / "chat_template.jinja").unlink()
    tokenizer = AutoTokenizer.from_pretrained(str(bare))
    run._use_chat_template(tokenizer, str(tmp_path / "t.jinja"))
    rendered = tokenizer.apply_chat_template(_conversation("hi", "yo"), tokenize=False)
    assert rendered == "<|user|>\nhi<eos>\n<|assistant|>\nyo<eos>\n"
    row = '{"prompt": [{"role": "user", "content": "name two animals ."}], ' \
          '"chosen": [{"role": "assistant", "content": "sheep"}], "rejected": [{"role": "assistant", "content": "saw"}]}'
    (tmp_path / "d.jsonl").write_text(row + "\n")
    pairs, _ = load_pairs(str(tmp_path / "d.jsonl"), tokenizer=tokenizer, max_length=64)
    assert tokenizer.eos_token_id in pairs[0].chosen_ids[-2:]  # the turn ends with the EOS (then a newline, if any)
