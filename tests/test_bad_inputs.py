"""The bad-input corpus: every malformed input ends `python -m mcore_dpo.train` with exit code 2
and one `error:` line on stderr that names the file (and the line, for data rows) and the
problem; no traceback, no Ray started, no output directory left behind.

Data and config cases are static files in tests/bad_inputs/ (see its README.md); model and
checkpoint cases are built here from a tiny HF Llama and corrupted copies of it. `main(argv)`
runs in-process, so the whole corpus takes seconds.

Every case runs with the default global_batch_size (64), larger than the 40 rows of
tests/bad_inputs/valid_prefs.jsonl: an input that slipped through every check would still end
in an error before Ray starts, and the case would fail on the message instead of training.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from mcore_dpo.train import main
from tests.helpers.models import llama_gqa_untied, mistral_mha, save_hf

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
REMOTE_CODE_MARKER = "remote_code_ran"  # written (beside the models) by the custom tokenizer's code if it ever runs

# Assistant turns start with a marker token, and the generation prompt is that marker, so a
# rendered prompt is a prefix of the rendered conversation (what data/pairs.py requires).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w50 {% endif %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w50 {% endif %}"
)


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    """Arguments; `{name}` is replaced by a path: corpus, valid, model, plain_model or a model variant."""
    where: str | None
    """The file (and `:line:`) the message must name, same placeholders; None for command-line flags."""
    fragment: str
    """The problem, as the message words it."""
    xfail: str | None = None
    """Why the product does not give its one clear line today (strict xfail)."""


def _data(name: str, line: int | None, fragment: str, *, xfail: str | None = None) -> Case:
    path = "{corpus}/data/" + name
    where = f"{path}:{line}:" if line is not None else path
    return Case(name, ("--model", "{model}", "--data", path), where, fragment, xfail)


def _model(variant: str, where: str, fragment: str) -> Case:
    return Case(variant, ("--model", "{" + variant + "}", "--data", "{valid}"), where, fragment)


def _yaml(name: str, where: str | None, fragment: str, *, xfail: str | None = None) -> Case:
    argv = ("--model", "{model}", "--data", "{valid}", "--config", "{corpus}/config/" + name)
    return Case(name, argv, where, fragment, xfail)


def _flags(case_id: str, flags: tuple[str, ...], where: str | None, fragment: str) -> Case:
    return Case(case_id, ("--model", "{model}", "--data", "{valid}", *flags), where, fragment)


DATA_CASES = [
    _data("missing_chosen.jsonl", 3, "missing key 'chosen'"),
    _data("missing_prompt_after_first_row.jsonl", 2, "missing key 'prompt'"),
    _data("chosen_wrong_type.jsonl", 3, "'chosen' must be a string or a list of messages, got int"),
    _data("prompt_empty_string.jsonl", 3, "'prompt' is an empty string"),
    _data("chosen_whitespace_only.jsonl", 2, "'chosen' is an empty string"),
    _data("rejected_null.jsonl", 4, "'rejected' is null"),
    _data("blank_line_then_null_chosen.jsonl", 4, "'chosen' is null"),
    _data("chosen_equals_rejected.jsonl", 3, "'chosen' and 'rejected' are identical"),
    _data("invalid_utf8.jsonl", 3, "invalid UTF-8 (byte 0xff)"),
    _data("lone_surrogate.jsonl", 3, "lone surrogate"),
    _data("broken_json_line.jsonl", 3, "broken JSON"),
    _data("row_not_an_object.jsonl", 2, "row must be an object, got list"),
    _data("conversation_unknown_role.jsonl", 2, "'prompt' message 1 has unknown role 'bot'"),
    _data("conversation_completion_from_user.jsonl", 3, "completions must come from 'assistant'"),
    _data("conversation_message_without_content.jsonl", 2, "'rejected' message 1 is not a {\"role\", \"content\"} object"),
    _data("conversation_content_not_string.jsonl", 2, "'chosen' message 1 content must be a string, got list"),
    _data("mixed_string_and_conversation.jsonl", 2, "mixed formats"),
    _data("mixed_texts_and_conversations.jsonl", None,
          "mixes plain-text rows (first on line 1) and conversational rows (first on line 3)"),
    _data("broken_json_control_character.jsonl", 2, "broken JSON (Invalid control character at column 16)"),
    _data("array_broken.json", 4, "broken JSON"),
    _data("array_identical_pair.json", 12, "'chosen' and 'rejected' are identical"),
    _data("empty.jsonl", None, "contains no rows"),
    _data("prefs.csv", None, "unknown file type '.csv'"),
    _data("not_parquet.parquet", None, "cannot read Parquet file"),
    Case("conversation_without_chat_template.jsonl",
         ("--model", "{plain_model}", "--data", "{corpus}/data/conversation_without_chat_template.jsonl"),
         "{corpus}/data/conversation_without_chat_template.jsonl:1:", "the tokenizer has no chat_template"),
    Case("eval_data_rejected_null.jsonl",
         ("--model", "{model}", "--data", "{valid}", "--eval-data", "{corpus}/data/rejected_null.jsonl",
          "--global-batch-size", "8", "--micro-batch-size", "8"),
         "{corpus}/data/rejected_null.jsonl:4:", "'rejected' is null"),
    Case("data_file_missing", ("--model", "{model}", "--data", "{corpus}/data/no_such_file.jsonl"),
         "{corpus}/data/no_such_file.jsonl", "does not exist"),
    Case("data_flag_missing", ("--model", "{model}"), None, "--data is required when --model is given"),
]  # fmt: skip

CONFIG_CASES = [
    _yaml("unknown_key.yaml", "{corpus}/config/unknown_key.yaml", "unknown key 'bogus_key'"),
    _yaml("tp_not_int.yaml", "{corpus}/config/tp_not_int.yaml", "tp: expected int, got 'two'"),
    _yaml("bool_as_string.yaml", "{corpus}/config/bool_as_string.yaml", "no_shuffle: expected true/false, got 'yes'"),
    _yaml("lr_list.yaml", "{corpus}/config/lr_list.yaml", "lr: expected float, got [0.1]"),
    _yaml("top_level_list.yaml", "{corpus}/config/top_level_list.yaml", "expected a mapping of config fields"),
    _yaml("broken_yaml.yaml", "{corpus}/config/broken_yaml.yaml", "not valid YAML"),
    _yaml("no_such_config.yaml", "{corpus}/config/no_such_config.yaml", "config file not found"),
    _yaml("tp_not_dividing_heads.yaml", "{model}/config.json", "field 'num_attention_heads' (8) is not divisible by tp=3"),
    _yaml("max_steps_negative.yaml", "{corpus}/config/max_steps_negative.yaml", "max_steps: must be a positive integer, got -5"),
    _yaml("micro_batch_zero.yaml", "{corpus}/config/micro_batch_zero.yaml", "micro_batch_size: must be a positive integer, got 0"),
    _yaml("global_batch_not_divisible.yaml", "{corpus}/config/global_batch_not_divisible.yaml",
          "global_batch_size: 12 is not a multiple of dp*micro_batch_size = 2*4"),
    _yaml("adam_beta1_out_of_range.yaml", "{corpus}/config/adam_beta1_out_of_range.yaml",
          "adam_beta1: must be in [0, 1), got 1.5"),
    _yaml("unknown_loss_type.yaml", "{corpus}/config/unknown_loss_type.yaml", "loss_type: unknown 'bogus'"),
    _yaml("global_batch_larger_than_data.yaml", "{valid}", "40 usable pairs, fewer than global_batch_size 64"),
    _flags("flag_tp_zero", ("--tp", "0"), None, "tp: must be a positive integer, got 0"),
    _flags("flag_global_batch_negative", ("--global-batch-size", "-8"), None,
           "global_batch_size: must be a positive integer, got -8"),
    _flags("flag_lr_negative", ("--lr", "-1"), None, "lr: must be positive, got -1.0"),
    # the rules of padded microbatches (packing splits a global batch by tokens)
    _flags("flag_global_batch_not_divisible", ("--global-batch-size", "10", "--micro-batch-size", "4", "--no-packing"), None,
           "global_batch_size: 10 is not a multiple of dp*micro_batch_size = 1*4"),
    _flags("flag_dp_times_micro_batch_exceeds_global", ("--dp", "4", "--micro-batch-size", "8", "--global-batch-size", "16",
                                                        "--no-packing"),
           None, "global_batch_size: 16 is not a multiple of dp*micro_batch_size = 4*8"),
    _flags("flag_tp_not_dividing_heads", ("--tp", "3"), "{model}/config.json",
           "field 'num_attention_heads' (8) is not divisible by tp=3"),
    _flags("flag_tp_not_dividing_query_groups", ("--tp", "8"), "{model}/config.json",
           "field 'num_key_value_heads' (4) is not divisible by tp=8"),
    _flags("flag_pp_more_than_layers", ("--pp", "5"), "{model}/config.json",
           "field 'num_hidden_layers' (4) is smaller than pp=5"),
    _flags("flag_tp_not_int", ("--tp", "two"), None, "command line: argument --tp: invalid int value: 'two'"),
    _flags("flag_unknown", ("--no-such-flag", "1"), None, "command line: unrecognized arguments: --no-such-flag 1"),
    _flags("flag_ref_mode_unknown", ("--ref-mode", "sideways"), None, "ref_mode: 'sideways' is not one of"),
    _flags("flag_on_bad_row_unknown", ("--on-bad-row", "ignore"), None, "on_bad_row: 'ignore' is not error or skip"),
    _flags("flag_max_length_one", ("--max-length", "1"), None, "max_length: must be an integer >= 2, got 1"),
    _flags("flag_dtype_unknown", ("--dtype", "int8"), None, "dtype: 'int8' is not float32, bfloat16 or float16"),
    _flags("flag_loss_weights_not_numbers", ("--loss-type", "sigmoid,sft", "--loss-weights", "1,x"), None,
           "loss_weights: '1,x' is not a comma list of numbers"),
]  # fmt: skip

MODEL_CASES = [
    _model("truncated_safetensors", "{truncated_safetensors}/model.safetensors", "not a readable safetensors file"),
    _model("safetensors_header_cut", "{safetensors_header_cut}/model.safetensors", "not a readable safetensors file"),
    _model("missing_shard", "{missing_shard}/model.safetensors.index.json",
           "shard 'model-00002-of-00002.safetensors' named in the index is missing"),
    _model("mismatched_shape", "{mismatched_shape}/model.safetensors",
           "tensor 'model.layers.1.mlp.down_proj.weight' has shape [64, 32], expected [32, 64]"),
    _model("missing_tensor", "{missing_tensor}", "tensor 'model.norm.weight' is missing"),
    _model("weight_map_parent_dir", "{weight_map_parent_dir}/model.safetensors.index.json",
           "field 'weight_map' names '../outside.safetensors', which is not a file name inside the model directory"),
    _model("weight_map_absolute_path", "{weight_map_absolute_path}/model.safetensors.index.json",
           "which is not a file name inside the model directory"),
    _model("unexpected_tensor", "{unexpected_tensor}/model.safetensors", "unexpected tensor 'model.extra_head.weight'"),
    _model("other_architecture", "{other_architecture}/config.json",
           "field 'architectures' is 'Gemma2ForCausalLM'; supported:"),
    _model("reward_model", "{reward_model}/config.json",
           "field 'architectures' is 'LlamaForSequenceClassification', a reward model (score head)"),
    _model("config_broken_json", "{config_broken_json}/config.json", "invalid JSON"),
    _model("config_missing_hidden_size", "{config_missing_hidden_size}/config.json", "field 'hidden_size' is missing"),
    _model("pickle_weights_only", "{pickle_weights_only}", "no model.safetensors or model.safetensors.index.json"),
    _model("no_tokenizer", "{no_tokenizer}", "cannot load the tokenizer"),
    _model("tokenizer_needs_remote_code", "{tokenizer_needs_remote_code}", "cannot load the tokenizer"),
    _model("tokenizer_larger_than_vocab", "{tokenizer_larger_than_vocab}",
           "tokenizer has 100 tokens, more than the model's vocab_size 64"),
    _model("mcore_meta_broken_json", "{mcore_meta_broken_json}/mcore_checkpoint.json", "invalid JSON"),
    _model("mcore_meta_tp_zero", "{mcore_meta_tp_zero}/mcore_checkpoint.json", "field 'tp' must be a positive integer"),
    _model("mcore_meta_future_version", "{mcore_meta_future_version}/mcore_checkpoint.json",
           "field 'format_version' is 99, expected 1"),
    _model("mcore_meta_other_architecture", "{mcore_meta_other_architecture}/mcore_checkpoint.json: hf_config",
           "field 'architectures' is 'GPT2LMHeadModel'"),
    _model("mcore_meta_tp_disagrees_with_shards", "{mcore_meta_tp_disagrees_with_shards}/tp0_pp0/model.safetensors",
           "has shape"),
    _model("mcore_missing_stage_shard", "{mcore_missing_stage_shard}/tp0_pp1/model.safetensors", "file is missing"),
    Case("ref_model_other_shape", ("--model", "{model}", "--ref-model", "{ref_other_shape}", "--data", "{valid}"),
         "{ref_other_shape}", "has a different architecture than"),
    Case("model_hub_name", ("--model", "Qwen/Qwen2.5-0.5B", "--data", "{valid}"),
         "model: Qwen/Qwen2.5-0.5B does not exist",
         "a local model directory is needed, not a hub name (nothing is downloaded): get one with "
         "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir Qwen2.5-0.5B"),
]  # fmt: skip

ALL_CASES = DATA_CASES + CONFIG_CASES + MODEL_CASES


# ----------------------------------------------------------------------------- fixtures


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))


def _rewrite_state(model_dir: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    state = edit(load_file(str(path)))
    save_file(state, str(path), metadata={"format": "pt"})


def _build_hf_variants(root: Path, plain: Path, model: Path) -> dict[str, Path]:
    import torch

    out: dict[str, Path] = {}
    weights = (plain / "model.safetensors").read_bytes()
    out["truncated_safetensors"] = _copy(plain, root / "truncated_safetensors")
    (out["truncated_safetensors"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    out["safetensors_header_cut"] = _copy(plain, root / "safetensors_header_cut")
    (out["safetensors_header_cut"] / "model.safetensors").write_bytes(weights[:5])

    out["missing_shard"] = save_hf(llama_gqa_untied(), root / "missing_shard", num_shards=2)
    (out["missing_shard"] / "model-00002-of-00002.safetensors").unlink()

    # An index whose weight_map reaches outside the model directory (a real shard lies there, so
    # only the name check can stop it).
    for name, target in (("weight_map_parent_dir", "../outside.safetensors"), ("weight_map_absolute_path", None)):
        out[name] = save_hf(llama_gqa_untied(), root / name, num_shards=2)
        index_path = out[name] / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        moved = root / f"{name}_outside.safetensors"
        shutil.copy(out[name] / "model-00002-of-00002.safetensors", moved)
        if target is None:
            target = str(moved)
        else:
            shutil.copy(moved, out[name] / target)
        index["weight_map"] = {k: (target if v == "model-00002-of-00002.safetensors" else v)
                               for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index))

    down = "model.layers.1.mlp.down_proj.weight"
    out["mismatched_shape"] = _copy(plain, root / "mismatched_shape")
    _rewrite_state(out["mismatched_shape"], lambda s: {**s, down: s[down].t().contiguous()})
    out["missing_tensor"] = _copy(plain, root / "missing_tensor")
    _rewrite_state(out["missing_tensor"], lambda s: {k: v for k, v in s.items() if k != "model.norm.weight"})
    out["unexpected_tensor"] = _copy(plain, root / "unexpected_tensor")
    _rewrite_state(out["unexpected_tensor"], lambda s: {**s, "model.extra_head.weight": torch.zeros(4, 32)})

    out["other_architecture"] = _copy(plain, root / "other_architecture")
    _edit_json(out["other_architecture"] / "config.json", architectures=["Gemma2ForCausalLM"], model_type="gemma2")
    # The converter reads a reward model (the body + score.weight); the trainer refuses it.
    out["reward_model"] = _copy(plain, root / "reward_model")
    _edit_json(out["reward_model"] / "config.json", architectures=["LlamaForSequenceClassification"],
               id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    _rewrite_state(out["reward_model"], lambda s: {**{k: v for k, v in s.items() if k != "lm_head.weight"},
                                                   "score.weight": torch.zeros(1, 32)})
    out["config_broken_json"] = _copy(plain, root / "config_broken_json")
    config_text = (plain / "config.json").read_text()
    (out["config_broken_json"] / "config.json").write_text(config_text[: len(config_text) // 2])
    out["config_missing_hidden_size"] = _copy(plain, root / "config_missing_hidden_size")
    config = json.loads(config_text)
    del config["hidden_size"]
    (out["config_missing_hidden_size"] / "config.json").write_text(json.dumps(config))

    # A pickle checkpoint is never loaded (it could run code); only safetensors is read.
    out["pickle_weights_only"] = _copy(plain, root / "pickle_weights_only")
    (out["pickle_weights_only"] / "model.safetensors").rename(out["pickle_weights_only"] / "pytorch_model.bin")
    out["no_tokenizer"] = _copy(plain, root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out["no_tokenizer"] / name).unlink(missing_ok=True)

    # A tokenizer class from the model directory: its code must not run without --trust-remote-code.
    out["tokenizer_needs_remote_code"] = _copy(plain, root / "tokenizer_needs_remote_code")
    (out["tokenizer_needs_remote_code"] / "tokenization_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(root / REMOTE_CODE_MARKER)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    _edit_json(
        out["tokenizer_needs_remote_code"] / "tokenizer_config.json",
        tokenizer_class="CustomTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]},
    )

    # The 100-token tokenizer stays; the model keeps only 64 rows of its vocabulary.
    small_vocab = 64
    out["tokenizer_larger_than_vocab"] = _copy(model, root / "tokenizer_larger_than_vocab")
    vocab_tensors = ("model.embed_tokens.weight", "lm_head.weight")
    _rewrite_state(
        out["tokenizer_larger_than_vocab"],
        lambda s: {k: (v[:small_vocab].clone() if k in vocab_tensors else v) for k, v in s.items()},
    )
    _edit_json(out["tokenizer_larger_than_vocab"] / "config.json", vocab_size=small_vocab)
    # Same family, another shape (4 heads of 8 instead of 8 of 4): unusable as the reference.
    out["ref_other_shape"] = save_hf(mistral_mha(), root / "ref_other_shape")
    return out


def _build_mcore_variants(root: Path, plain: Path) -> dict[str, Path]:
    from checkpoint_convert.convert import hf_to_mcore

    good = root / "mcore_good"
    hf_to_mcore(plain, good, tp=1, pp=2, log=lambda _message: None)
    meta_text = (good / "mcore_checkpoint.json").read_text()
    out: dict[str, Path] = {}
    out["mcore_meta_broken_json"] = _copy(good, root / "mcore_meta_broken_json")
    (out["mcore_meta_broken_json"] / "mcore_checkpoint.json").write_text(meta_text[: len(meta_text) // 3])
    for name, changes in (
        ("mcore_meta_tp_zero", {"tp": 0}),
        ("mcore_meta_future_version", {"format_version": 99}),
        ("mcore_meta_tp_disagrees_with_shards", {"tp": 2}),
    ):
        out[name] = _copy(good, root / name)
        _edit_json(out[name] / "mcore_checkpoint.json", **changes)
    out["mcore_meta_other_architecture"] = _copy(good, root / "mcore_meta_other_architecture")
    meta = json.loads(meta_text)
    meta["hf_config"] = {**meta["hf_config"], "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (out["mcore_meta_other_architecture"] / "mcore_checkpoint.json").write_text(json.dumps(meta))
    out["mcore_missing_stage_shard"] = _copy(good, root / "mcore_missing_stage_shard")
    (out["mcore_missing_stage_shard"] / "tp0_pp1" / "model.safetensors").unlink()
    return out


@pytest.fixture(scope="session")
def paths(tmp_path_factory) -> dict[str, str]:
    """Placeholder -> path for every case: the corpus, a valid data file, the models."""
    root = tmp_path_factory.mktemp("bad_input_models")
    plain = save_hf(llama_gqa_untied(), root / "plain_model")  # 8 heads, 4 query groups, 4 layers, vocab 100
    model = _copy(plain, root / "model")
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    found = {"corpus": CORPUS, "valid": CORPUS / "valid_prefs.jsonl", "model": model, "plain_model": plain}
    found.update(_build_hf_variants(root, plain, model))
    found.update(_build_mcore_variants(root, plain))
    found["models_root"] = root
    return {name: str(path) for name, path in found.items()}


# ----------------------------------------------------------------------------- the corpus


def _run_bad(capsys, argv: list[str]) -> str:
    import ray

    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, f"exit code {code}; stderr: {err}"
    assert "Traceback" not in captured.err + captured.out
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    assert not ray.is_initialized(), "Ray was started before the input was checked"
    return err


def _params(cases: list[Case]) -> list:
    return [
        pytest.param(case, id=case.id, marks=[pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else [])
        for case in cases
    ]


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_bad_input_gives_one_line_and_exit_2(case: Case, paths, capsys, tmp_path):
    out = tmp_path / "out"
    argv = [arg.format_map(paths) for arg in case.argv] + ["--output-dir", str(out)]
    err = _run_bad(capsys, argv)
    if case.where is not None:
        assert case.where.format_map(paths) in err, err
    assert case.fragment in err, err
    assert not out.exists(), f"partial output left behind: {sorted(p.name for p in out.iterdir())}"


def test_corpus_has_at_least_25_cases_and_readme_lists_each():
    assert len(ALL_CASES) >= 25
    ids = [case.id for case in ALL_CASES]
    assert len(set(ids)) == len(ids), "case ids must be unique"
    readme = (CORPUS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE))
    assert listed == set(ids), f"README only: {sorted(listed - set(ids))}; tests only: {sorted(set(ids) - listed)}"
    for case in DATA_CASES + CONFIG_CASES:
        for arg in case.argv:
            if arg.startswith("{corpus}/") and "no_such" not in arg:
                assert (CORPUS / arg.removeprefix("{corpus}/")).is_file(), arg


def test_remote_code_never_runs_without_the_flag(paths, capsys, tmp_path):
    argv = ["--model", paths["tokenizer_needs_remote_code"], "--data", paths["valid"], "--output-dir", str(tmp_path / "o")]
    assert "contains custom code" in _run_bad(capsys, argv)
    assert not (Path(paths["models_root"]) / REMOTE_CODE_MARKER).exists()


# ----------------------------------------------------------------------------- --on-bad-row


SOME_BAD_ROWS = CORPUS / "data" / "some_bad_rows.jsonl"
SOME_BAD_LINES = (3, 7, 8, 20)  # missing key, broken JSON, identical pair, empty prompt; 40 rows in all


def test_on_bad_row_skip_counts_and_records_the_first_lines(paths):
    from mcore_dpo.config import TrainConfig
    from mcore_dpo.driver.run import prepare

    config = TrainConfig(model=paths["model"], data=str(SOME_BAD_ROWS), on_bad_row="skip",
                         global_batch_size=8, micro_batch_size=8)  # fmt: skip
    prep = prepare(config)
    assert prep.train_data.stats[0].num_rows == 40
    assert prep.train_data.stats[0].num_bad_rows_skipped == len(SOME_BAD_LINES)
    assert prep.train_data.stats[0].first_bad_lines == SOME_BAD_LINES
    assert len(prep.train_data) == 40 - len(SOME_BAD_LINES)
    assert not {pair.source_line for pair in prep.train_data} & set(SOME_BAD_LINES)


def test_on_bad_row_skip_gets_past_data_loading(paths, capsys, tmp_path):
    """With skip, the run reaches the check after loading (too few pairs for the batch); with
    the default (error), it stops at the first bad line."""
    out = tmp_path / "out"
    base = ["--model", paths["model"], "--data", str(SOME_BAD_ROWS), "--output-dir", str(out)]
    err = _run_bad(capsys, base + ["--on-bad-row", "skip"])
    assert f"{SOME_BAD_ROWS}: 36 usable pairs, fewer than global_batch_size 64" in err, err
    err = _run_bad(capsys, base)
    assert f"{SOME_BAD_ROWS}:3: missing key 'chosen'" in err, err
    assert not out.exists()
