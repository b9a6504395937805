"""Tokenizer sanity at start-up (mcore_dpo/data/tokenizer_check.py): a tokenizer that does not read
a sample of the data back is refused in one line, one with under half the model's vocabulary is
a warning; every tokenizer the project ships or the tests build still passes.

Unit tests on tokenizers built here with the `tokenizers` library, then through the command line:
the embedded tokenizer's files in a Qwen2 model directory (they load as a Qwen2Tokenizer that
reads 'hello cat dog . sheep' as 'a.'), and the vocabulary warning in a one-step run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer

from mcore_dpo.data.tokenizer_check import _matches, check_tokenizer, sample_texts
from mcore_dpo.driver import defaults
from mcore_dpo.data.sources import DataError
from tests.helpers.cli import train_input_error
from tests.helpers.data import write_prefs
from tests.helpers.models import save_hf
from tests.helpers.ray_runs import main_in_process

DATA_DOC = (Path(__file__).resolve().parents[1] / "docs" / "DATA.md").read_text(encoding="utf-8")
ADVICE = "check --tokenizer / the model directory's tokenizer files"
# Rows in the embedded tokenizer's vocabulary (its own data's words).
WORD_ROWS = [{"prompt": "hello cat dog . sheep", "chosen": " sure : sheep and rabbit .",
              "rejected": " sure : saw and hammer ."}] + [
    {"prompt": f"name two animals . {i}", "chosen": " how about bear and lion ?", "rejected": " how about chisel ?"}
    for i in range(7)]  # "0".."6" are outside its vocabulary: an unknown token each, read back as any text
CHAT_ROWS = [{"prompt": [{"role": "user", "content": "name two animals ."}],
              "chosen": [{"role": "assistant", "content": "sure : sheep and rabbit ."}],
              "rejected": [{"role": "assistant", "content": "sure : saw and hammer ."}]}] * 4
# Mixed case, accents, punctuation, digits, a tab and non-Latin text.
TEXT_ROWS = [{"prompt": f"Question {i}:\tWhat does «Café Ñandú» mean? 東京", "chosen": " It's a café.\n",
              "rejected": " No idea — sorry!"} for i in range(6)]
CORPUS = [row[key] for row in TEXT_ROWS for key in ("prompt", "chosen", "rejected")]


def _check(tokenizer, paths, *, vocab_size: int | None = None) -> list[str]:
    warnings: list[str] = []
    check_tokenizer(tokenizer, tokenizer_dir="TOK", data_paths=paths, vocab_size=vocab_size or len(tokenizer),
                    warn=warnings.append)
    return warnings


def _fast(backend, **special_tokens) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def _byte_level_bpe_with_bos() -> PreTrainedTokenizerFast:
    """GPT-2/Llama-3 style: byte-level BPE, a BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<bos>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return _fast(backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _sentencepiece_style_bpe() -> PreTrainedTokenizerFast:
    """Llama-2 style: '▁' for spaces in the normaliser, byte fallback, an unknown token."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    backend.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=specials))
    return _fast(backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _uncased_wordpiece() -> PreTrainedTokenizerFast:
    """BERT-uncased style: the normaliser lowercases and strips accents, '##' pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return _fast(backend, unk_token="[UNK]", bos_token="[CLS]", eos_token="[SEP]", pad_token="[PAD]")


def _char_bpe_without_unknown(alphabet: str) -> PreTrainedTokenizerFast:
    """A BPE with no unknown token: characters outside `alphabet` are dropped without a trace."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate(["<bos>", "<eos>", *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<bos>", "<eos>"])
    return _fast(backend, bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def shipped():
    return AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)


# ----------------------------------------------------------------------------- what passes


def test_the_shipped_tokenizer_reads_the_default_data_back(shipped):
    assert _check(shipped, [defaults.DEFAULT_TRAIN_DATA, defaults.DEFAULT_EVAL_DATA]) == []


def test_conversations_are_read_back_as_the_chat_template_renders_them(shipped, tmp_path):
    path = str(write_prefs(tmp_path / "chat.jsonl", CHAT_ROWS))
    texts = sample_texts(path, shipped)
    prompt = shipped.apply_chat_template(CHAT_ROWS[0]["prompt"], add_generation_prompt=True, tokenize=False)
    whole = shipped.apply_chat_template(CHAT_ROWS[0]["prompt"] + CHAT_ROWS[0]["chosen"], tokenize=False)
    assert [texts[0].text, texts[1].text] == [prompt, whole] and not texts[0].add_special_tokens
    assert _check(shipped, [path]) == []
    with_bos = AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    with_bos.chat_template = "{{ bos_token }}" + shipped.chat_template
    assert _check(with_bos, [path]) == []


def test_text_rows_are_read_back_as_training_tokenizes_them(shipped, tmp_path):
    path = str(write_prefs(tmp_path / "d.jsonl", WORD_ROWS))
    texts = sample_texts(path, shipped)
    row = WORD_ROWS[0]
    assert [t.text for t in texts[:3]] == [row["prompt"], row["prompt"] + row["chosen"] + "<eos>",
                                           row["prompt"] + row["rejected"] + "<eos>"]
    assert all(t.add_special_tokens for t in texts)
    assert _check(shipped, [path]) == []  # one unknown token a row stands for the text it replaced


@pytest.mark.parametrize("make", [_byte_level_bpe_with_bos, _sentencepiece_style_bpe, _uncased_wordpiece])
def test_common_tokenizer_kinds_read_mixed_text_back(make, tmp_path):
    tokenizer = make()
    path = str(write_prefs(tmp_path / "d.jsonl", TEXT_ROWS))
    assert _check(tokenizer, [path]) == []


def test_the_test_suites_word_level_tokenizer_passes_its_data(tmp_path):
    from tests.helpers.models import save_tokenizer

    save_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    valid = Path(__file__).resolve().parent / "bad_inputs" / "valid_prefs.jsonl"
    assert _check(tokenizer, [str(valid)]) == []


def test_rows_training_refuses_and_unreadable_files_are_left_to_load_pairs(shipped, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "cat", "chosen": 5}\n["not", "a", "row"]\n{"prompt": \n')
    chat = str(write_prefs(tmp_path / "chat.jsonl", CHAT_ROWS))
    without_template = AutoTokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    without_template.chat_template = None
    assert sample_texts(str(broken), shipped) == []
    assert sample_texts(str(tmp_path / "missing.jsonl"), shipped) == []
    assert sample_texts(str(tmp_path / "prefs.csv"), shipped) == []
    assert sample_texts(chat, without_template) == []
    assert _check(shipped, [str(broken), None]) == []


def test_the_sample_is_the_first_rows(shipped):
    texts = sample_texts(defaults.DEFAULT_TRAIN_DATA, shipped, num_rows=5)
    with open(defaults.DEFAULT_TRAIN_DATA, encoding="utf-8") as fh:
        first = [json.loads(next(fh)) for _ in range(5)]
    assert [t.text for t in texts[::3]] == [row["prompt"] for row in first]


def test_an_unknown_token_matches_any_text_between_what_surrounds_it():
    assert _matches(["abc"], "abc") and not _matches(["abc"], "abd")
    assert _matches(["ab", "", "ef"], "abcdef") and _matches(["", "c", ""], "abcde")
    assert _matches(["a", "c", "e"], "abcde") and not _matches(["a", "e", "c"], "abcde")
    assert not _matches(["abc", "cde"], "abcde")  # the two ends may not overlap


# ----------------------------------------------------------------------------- what is refused or warned


def test_the_shipped_files_loaded_as_qwen2_are_refused_with_an_example(tmp_path):
    misread = Qwen2Tokenizer.from_pretrained(defaults.DEFAULT_TOKENIZER_DIR)
    assert misread.tokenize("hello cat dog . sheep") == ["a", "."]  # the finding
    path = str(write_prefs(tmp_path / "d.jsonl", WORD_ROWS))
    with pytest.raises(DataError) as caught:
        _check(misread, [path])
    assert str(caught.value) == (
        f"TOK: the tokenizer (Qwen2Tokenizer) does not read the data back: 'hello cat dog . sheep' -> 'a.'; {ADVICE}")


def test_mostly_unknown_tokens_are_refused(tmp_path):
    from tests.helpers.models import save_tokenizer

    save_tokenizer(tmp_path / "tok")  # words w3..w99 only
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    path = str(write_prefs(tmp_path / "d.jsonl", WORD_ROWS))
    with pytest.raises(DataError) as caught:
        _check(tokenizer, [path])
    message = str(caught.value)
    assert message.startswith("TOK: the tokenizer (TokenizersBackend) reads most of the data as its unknown token "
                              "'<unk>' (") and message.endswith(ADVICE), message
    assert "'<unk> <unk>" in message and len(message.splitlines()) == 1


def test_a_few_texts_that_lose_characters_are_a_warning_not_a_refusal(tmp_path):
    rows = [{"prompt": "abc ab", "chosen": " ba", "rejected": " cab"}] * 5 + [
        {"prompt": "abc ab", "chosen": " bä", "rejected": " cab"}]
    tokenizer = _char_bpe_without_unknown("abc ")
    path = str(write_prefs(tmp_path / "d.jsonl", rows))
    assert _check(tokenizer, [path]) == [
        "warning: TOK: the tokenizer (TokenizersBackend) does not read 1 of 18 sampled texts back, "
        "e.g. 'abc ab bä<eos>' -> 'abc ab b'"]
    path = str(write_prefs(tmp_path / "most.jsonl", [{"prompt": "abc ab", "chosen": " bä", "rejected": " cä"}] * 4))
    with pytest.raises(DataError, match="does not read the data back: 'abc ab bä<eos>' -> "):
        _check(tokenizer, [path])  # the prompts come back, the completions do not: 8 of 12 texts


def test_a_tokenizer_with_under_half_the_models_vocabulary_is_a_warning(shipped):
    data = [defaults.DEFAULT_TRAIN_DATA]
    assert _check(shipped, data, vocab_size=254) == []  # exactly half
    assert _check(shipped, data, vocab_size=255) == [
        f"warning: TOK: the tokenizer (TokenizersBackend) has 127 tokens, under half of the model's vocab_size 255; "
        f"{ADVICE}"]


# ----------------------------------------------------------------------------- through the command line


def _model_with_shipped_tokenizer_files(model, directory: Path) -> Path:
    save_hf(model, directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    for path in Path(defaults.DEFAULT_TOKENIZER_DIR).iterdir():
        shutil.copy(path, directory / path.name)
    return directory


def test_the_shipped_tokenizer_in_a_qwen2_directory_is_refused_in_one_line(capsys, tmp_path):
    """The finding through the command line: the files load as a Qwen2Tokenizer (config.json says
    qwen2). 8 rows against the default global batch of 64: without the check, the run would stop
    on 'fewer than global_batch_size' instead."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = _model_with_shipped_tokenizer_files(Qwen2ForCausalLM(config), tmp_path / "qwen2")
    data = str(write_prefs(tmp_path / "d.jsonl", WORD_ROWS))
    argv = ["--model", str(model), "--data", data, "--output-dir", str(tmp_path / "o")]
    err = train_input_error(capsys, argv)
    assert err == (f"error: {model}: the tokenizer (Qwen2Tokenizer) does not read the data back: "
                   f"'hello cat dog . sheep' -> 'a.'; {ADVICE}")
    assert "    " + err.replace(str(model), "MODEL") + "\n" in DATA_DOC  # docs/DATA.md quotes the line
    # The same files as --tokenizer load as what they are and pass: the next check speaks.
    err = train_input_error(capsys, [*argv, "--tokenizer", defaults.DEFAULT_TOKENIZER_DIR])
    assert "8 usable pairs, fewer than global_batch_size 64" in err, err


def test_a_small_tokenizer_for_a_large_vocabulary_warns_in_a_real_run(tmp_path, ray_cluster):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = _model_with_shipped_tokenizer_files(LlamaForCausalLM(config), tmp_path / "llama")
    data = str(write_prefs(tmp_path / "d.jsonl", WORD_ROWS))
    proc = main_in_process(["--model", str(model), "--data", data, "--global-batch-size", "8",
                            "--micro-batch-size", "8", "--max-steps", "1", "--max-length", "16",
                            "--output-dir", str(tmp_path / "o")], cluster=ray_cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = (f"warning: {model}: the tokenizer (TokenizersBackend) has 127 tokens, under half of the model's "
               f"vocab_size 300; {ADVICE}")
    assert warning in proc.stdout.splitlines(), proc.stdout
    assert warning in (tmp_path / "o" / "train.log").read_text().splitlines()  # in the run's log too
