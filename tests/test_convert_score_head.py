"""Reward models (`*ForSequenceClassification`) through the converter: the causal LM's body plus a
score head `score.weight` [num_labels, h], held whole on every tp rank of the last pipeline stage
(no output_layer, tied embeddings or not), and back to an HF directory that
AutoModelForSequenceClassification loads with the source's config and logits. Tiny models built
here with transformers' own classes and save_pretrained (nothing downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config,
    Qwen2ForSequenceClassification,
)  # fmt: skip

from checkpoint_convert.__main__ import main
from checkpoint_convert.families import FAMILY_MODULES, SCORE_ARCHITECTURES, spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.gather import mcore_to_hf
from checkpoint_convert.mapping import hf_tensor_shapes, hf_to_mcore_shard, mcore_shard_shapes
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.score_head import score_head_from_causal
from tests.helpers import deepseek, gemma, gpt_oss
from tests.helpers.cli import run_python
from tests.helpers.models import PAD, TINY_FAMILIES, _COMMON, _init, hub_tensors, save_pretrained_with_tokenizer
from tests.helpers.round_trips import assert_round_trips, assert_same, tensors_of

# Right-padded with PAD: the head reads each row's last non-pad token.
TOKENS = torch.tensor([[5, 17, 42, 7, PAD, PAD], [9, 10, 11, 12, 13, 99]])


def llama_reward(num_labels: int = 1) -> LlamaForSequenceClassification:
    config = LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                         num_labels=num_labels, pad_token_id=PAD)
    return _init(LlamaForSequenceClassification(config))


def qwen2_reward_tied() -> Qwen2ForSequenceClassification:
    """tie_word_embeddings true, as in a reward model made from a small Qwen2.5: nothing is tied."""
    config = Qwen2Config(**_COMMON, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                         num_labels=1, pad_token_id=PAD)
    return _init(Qwen2ForSequenceClassification(config))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model = llama_reward()
    return model, save_pretrained_with_tokenizer(model, tmp_path_factory.mktemp("llama_rm") / "hf")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    model = qwen2_reward_tied()
    return model, save_pretrained_with_tokenizer(model, tmp_path_factory.mktemp("qwen2_rm") / "hf")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    model = llama_reward(num_labels=3)
    return model, save_pretrained_with_tokenizer(model, tmp_path_factory.mktemp("llama3_rm") / "hf")


def assert_head_placement(out: Path, head: torch.Tensor, *, tp: int, pp: int) -> None:
    """score.weight whole and unchanged on every tp rank of the last stage, on no other stage; no
    output_layer anywhere; the embedding on stage 0 only."""
    for p in range(pp):
        for t in range(tp):
            shard = load_file(str(out / f"tp{t}_pp{p}" / "model.safetensors"))
            where = f"tp{t}_pp{p}"
            assert "output_layer.weight" not in shard, where
            assert ("embedding.word_embeddings.weight" in shard) == (p == 0), where
            if p == pp - 1:
                assert shard["score.weight"].shape == head.shape, where
                assert torch.equal(shard["score.weight"], head), where
            else:
                assert "score.weight" not in shard, where


def assert_loads_with_same_logits(model: torch.nn.Module, exported: Path) -> None:
    """AutoModelForSequenceClassification loads `exported` as `model`'s class, no missing,
    unexpected or mismatched keys, the same num_labels and pad_token_id, the same logits."""
    loaded, info = AutoModelForSequenceClassification.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(loaded) is type(model)
    assert (loaded.config.num_labels, loaded.config.pad_token_id) == (model.config.num_labels, model.config.pad_token_id)
    with torch.no_grad():
        expected, got = model.eval()(input_ids=TOKENS).logits, loaded.eval()(input_ids=TOKENS).logits
    assert got.shape == (2, model.config.num_labels)
    assert torch.equal(got, expected)


def test_llama_reward_model_round_trips_at_every_layout(llama, tmp_path):
    """(tp, pp) = (1, 1), (2, 2), (1, 2): every rank file is the key map's shard, the head is
    where it belongs, each export equals the source bit for bit and gives its logits."""
    model, hf_dir = llama
    source = assert_round_trips(hf_dir, tmp_path, ((1, 1, 1), (2, 2, 1), (1, 2, 1)), what="llama reward model")
    assert "score.weight" in source and "lm_head.weight" not in source
    for tp, pp in ((1, 1), (2, 2), (1, 2)):
        assert_head_placement(tmp_path / f"m{tp}{pp}1", source["score.weight"], tp=tp, pp=pp)
        config = json.loads((tmp_path / f"hf{tp}{pp}1" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForSequenceClassification"]
        assert_loads_with_same_logits(model, tmp_path / f"hf{tp}{pp}1")
    spec = open_mcore_dir(tmp_path / "m221").meta.spec
    assert (spec.architecture, spec.num_labels, spec.tie_word_embeddings) == ("LlamaForSequenceClassification", 1, False)


def test_tied_qwen2_reward_model_through_the_command_line(qwen2, tmp_path):
    """`python -m checkpoint_convert` hf-to-mcore at tp 2 pp 2 and mcore-to-hf: tie_word_embeddings
    true makes no output layer (nor a copy of the embedding on the last stage); the export keeps
    config.json as it was and loads with the source's logits. A reshard to tp 1 pp 2 too."""
    model, hf_dir = qwen2
    source = tensors_of(hf_dir)
    done = run_python(["-m", "checkpoint_convert", "hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "m"),
                       "--tp", "2", "--pp", "2"])
    assert done.returncode == 0, done.stderr
    assert_head_placement(tmp_path / "m", source["score.weight"], tp=2, pp=2)
    done = run_python(["-m", "checkpoint_convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "m"),
                       "--out", str(tmp_path / "hf")])
    assert done.returncode == 0, done.stderr
    assert_same(tmp_path / "hf", source, "qwen2 reward model through the command line")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert_loads_with_same_logits(model, tmp_path / "hf")
    assert main(["reshard", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "r12"), "--tp", "1", "--pp", "2"]) == 0
    assert_head_placement(tmp_path / "r12", source["score.weight"], tp=1, pp=2)
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "r12"), "--out", str(tmp_path / "hf_r")]) == 0
    assert_same(tmp_path / "hf_r", source, "qwen2 reward model resharded")


def test_three_labels_convert_like_one(llama3, tmp_path):
    """num_labels 3 (config.json's id2label): a head [3, h], still whole on each last-stage rank;
    also through torch_dist and back."""
    model, hf_dir = llama3
    source = assert_round_trips(hf_dir, tmp_path, ((2, 2, 1),), what="three labels")
    assert source["score.weight"].shape == (3, 32)
    assert_head_placement(tmp_path / "m221", source["score.weight"], tp=2, pp=2)
    assert_loads_with_same_logits(model, tmp_path / "hf221")
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "td"), "--tp", "2", "--pp", "2",
                 "--format", "torch_dist"]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "td"), "--out", str(tmp_path / "hf_td")]) == 0
    assert_same(tmp_path / "hf_td", source, "three labels through torch_dist")


# ------------------------------------------------------------------------------- bad input
def _copy(hf_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_dir, tmp_path / "bad"))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_weights(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _bad_empty_id2label(d: Path) -> str:
    _edit_config(d, id2label={}, label2id={})
    return f"{d / 'config.json'}: field 'id2label' is {{}}; a score head needs at least one label"


def _bad_head_rows(d: Path) -> str:
    _edit_weights(d / "model.safetensors", lambda t: t.update({"score.weight": torch.zeros(2, 32)}))
    return f"{d / 'model.safetensors'}: tensor 'score.weight' has shape [2, 32], expected [1, 32]"


def _bad_transposed_head(d: Path) -> str:
    _edit_weights(d / "model.safetensors", lambda t: t.update({"score.weight": t["score.weight"].t().contiguous()}))
    return f"{d / 'model.safetensors'}: tensor 'score.weight' has shape [32, 1], expected [1, 32]"


def _bad_lm_head_instead(d: Path) -> str:
    def swap(tensors: dict) -> None:
        tensors["lm_head.weight"] = torch.zeros(100, 32)
        del tensors["score.weight"]

    _edit_weights(d / "model.safetensors", swap)
    return f"{d}: tensor 'score.weight' is missing"


def _bad_score_on_a_causal_lm(d: Path) -> str:
    _edit_config(d, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    return f"{d / 'model.safetensors'}: unexpected tensor 'score.weight' for LlamaForCausalLM"


def _bad_no_such_class(d: Path) -> str:
    _edit_config(d, architectures=["Glm4MoeForSequenceClassification"])
    return f"{d / 'config.json'}: field 'architectures' is 'Glm4MoeForSequenceClassification'; supported: "


@pytest.mark.parametrize("breaker", [_bad_empty_id2label, _bad_head_rows, _bad_transposed_head, _bad_lm_head_instead,
                                     _bad_score_on_a_causal_lm, _bad_no_such_class])
def test_bad_reward_model_is_one_line_and_exit_2(llama, tmp_path, capsys, breaker):
    bad = _copy(llama[1], tmp_path)
    expected = breaker(bad)
    code = main(["hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {expected}"), err
    assert not (tmp_path / "m").exists()


def test_megatron_shard_without_its_head_is_refused(llama, tmp_path, capsys):
    """A last-stage rank file that lost score.weight: mcore-to-hf names the file and the tensor."""
    assert main(["hf-to-mcore", "--hf-dir", str(llama[1]), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    rank_file = tmp_path / "m" / "tp1_pp1" / "model.safetensors"
    _edit_weights(rank_file, lambda t: t.pop("score.weight"))
    capsys.readouterr()
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {rank_file}: tensor 'score.weight' is missing", err


def test_verify_refuses_a_reward_model_in_one_line(llama, tmp_path, capsys):
    assert main(["verify", "--hf-dir", str(llama[1]), "--mcore-dir", str(tmp_path / "unused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {llama[1] / 'config.json'}: field 'architectures' is 'LlamaForSequenceClassification', "
                   "a reward model; verify compares a causal LM's logits"), err


# ------------------------------------------------------------------------------- pure
@pytest.mark.parametrize("fields", [{}, {"id2label": {"0": "good"}}, {"num_labels": 3},
                                    {"id2label": {"0": "a", "1": "b"}, "num_labels": 3}])
def test_num_labels_is_read_as_transformers_reads_it(fields):
    config = {**LlamaConfig(**_COMMON, num_attention_heads=8).to_dict(), "architectures": ["LlamaForSequenceClassification"]}
    for key in ("num_labels", "id2label", "label2id"):
        config.pop(key, None)
    config.update(fields)
    assert spec_from_hf_config(config).num_labels == LlamaConfig.from_dict(config).num_labels


FAMILIES = {**TINY_FAMILIES, **deepseek.TINY, **gemma.TINY, **gpt_oss.TINY}


def test_every_family_with_a_sequence_classification_class_names_it():
    assert set(SCORE_ARCHITECTURES.values()) == set(FAMILIES)
    assert not hasattr(FAMILY_MODULES["glm4_moe"], "SCORE_ARCHITECTURE")
    assert not hasattr(transformers, "Glm4MoeForSequenceClassification")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_key_map_covers_each_family_reward_model(family):
    """transformers' own `SCORE_ARCHITECTURE` class of a tiny model of the family: what
    save_pretrained writes = hf_tensor_shapes (body + score.weight, no lm_head); tp 2 pp 2
    shards hold the head on the last stage only and give every tensor back bit for bit."""
    torch.manual_seed(0)
    architecture = FAMILY_MODULES[family].SCORE_ARCHITECTURE
    config = FAMILIES[family]().config
    config.num_labels = 1
    model = getattr(transformers, architecture)(config)
    spec = spec_from_hf_config({**model.config.to_dict(), "architectures": [architecture]})
    assert (spec.family, spec.architecture, spec.num_labels, spec.tie_word_embeddings) == (family, architecture, 1, False)
    hub = hub_tensors(model)
    assert {n: tuple(t.shape) for n, t in hub.items()} == hf_tensor_shapes(spec)
    shards = {(t, p): hf_to_mcore_shard(spec, tp=2, tp_rank=t, pp=2, pp_rank=p, get=hub.__getitem__)
              for t in range(2) for p in range(2)}
    for (t, p), shard in shards.items():
        assert {n: tuple(v.shape) for n, v in shard.items()} == mcore_shard_shapes(spec, tp=2, pp=2, pp_rank=p)
        assert ("score.weight" in shard) == (p == 1) and "output_layer.weight" not in shard
    back = dict(mcore_to_hf(spec, tp=2, pp=2, get_shard=lambda t, p: shards[(t, p)]))
    assert set(back) == set(hub) and all(torch.equal(back[n], hub[n]) for n in hub)


def test_score_head_from_causal_makes_a_reward_model_the_converter_reads(tmp_path):
    """A causal LM's config and body + score_head_from_causal's config and head: an HF directory
    that AutoModelForSequenceClassification loads whole and the converter round-trips."""
    causal = _init(LlamaForCausalLM(LlamaConfig(**_COMMON, num_attention_heads=8, num_key_value_heads=4,
                                                pad_token_id=PAD)))
    causal_config = {**causal.config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    config, head = score_head_from_causal(causal_config, seed=3)
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == PAD
    assert head.shape == (1, 32) and head.dtype == torch.float32 and 0 < head.std() < 0.1
    assert torch.equal(score_head_from_causal(causal_config, seed=3)[1], head)
    hf_dir = tmp_path / "rm"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    body = {n: t.detach().contiguous() for n, t in causal.state_dict().items() if n.startswith("model.")}
    save_file({**body, "score.weight": head}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    model, info = AutoModelForSequenceClassification.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(model.score.weight, head) and model.config.num_labels == 1
    assert_round_trips(hf_dir, tmp_path, ((2, 2, 1),), what="fresh reward model")
    two, _ = score_head_from_causal(causal_config, num_labels=2)
    assert spec_from_hf_config(two).num_labels == 2
    with pytest.raises(ConversionError, match=r"^c: field 'pad_token_id' is None; a reward model needs a token id"):
        score_head_from_causal({**causal_config, "pad_token_id": None}, source="c")
    with pytest.raises(ConversionError, match=r"^c: field 'architectures' is 'LlamaForSequenceClassification', already"):
        score_head_from_causal(config, source="c")
