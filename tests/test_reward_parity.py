"""`--objective reward` through the command line against TRL 1.16's RewardTrainer (tests/helpers/trl_reward.py).

Each run is the real command line in this process on the session's Ray cluster
(`main_in_process`): the Llama parity policy (a causal LM: the run starts its score head as
`model/score_head.py` draws it from --seed), a JSONL of text pairs written here, file order
(--no-shuffle), 2 steps of 8 pairs in microbatches of 2, fp32, the parity tests' learning rate,
Adam epsilon, clipping and weight decay, the export to OUTPUT/hf. The reference tokenizes the same
file with the engine's loader (`load_pairs`), builds TRL's reward batches from those ids and trains
the HF `AutoModelForSequenceClassification` (same body, same starting head) with TRL's own
`compute_loss`, torch's clip_grad_norm_ and AdamW, one global batch per step.

Compared at steps 1 and 2 within RTOL (relative): loss, accuracy, margin, min/mean/max_reward,
num_tokens (the step's own: TRL's is cumulative) and grad_norm; then every tensor of OUTPUT/hf
(score.weight included) against the reference's weights after step 2, within RTOL of the tensor's
largest entry; then the rewards OUTPUT/hf, loaded by AutoModelForSequenceClassification, gives
the pairs against the reference model's, within ATOL.

Runs: plain Bradley-Terry at (1,1,1) with context parallelism (--cp 2: the scores of each cp
rank's positions gathered whole) and shared prompts (--prefix-sharing: each pair's prompt once,
the rejected sequence scored through it) in two invocations, --max-steps 1 and then 2, the
second resuming from the first's checkpoint (the head and its optimizer state included); then, on a file
with TRL's "margin" column, reward centering with the margins at tp 2 x pp 2 with sequence
parallelism (the score head gathers the sequence), started from a reward model directory
(`LlamaForSequenceClassification`, its own score head, which the run loads), and packed at
pp 2 x dp 2 (min/max_reward over dp ranks); the margins on the Qwen3-MoE parity model
(`Qwen3MoeForSequenceClassification` from its causal LM) at dp 2 x ep 2, the experts split over
the ranks, its exported experts compared one tensor each under their hub names; and LoRA (the
parity runs' adapter flags and Adam epsilon, tests/helpers/trl_parity.py) with the margins and
reward centering at tp 2, in two invocations as the first run, against RewardTrainer with PEFT's
LoraConfig(task_type="SEQ_CLS") (the same fresh adapter, the score head trained whole): the
merged export (the trained head in it) against PEFT's merge_and_unload, and OUTPUT/adapter
(the head under PEFT's saved name) loaded by PeftModel.from_pretrained, scoring as the trained
model.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.score_head import score_head_from_causal
from mcore_dpo.data.pairs import load_pairs
from tests.helpers.cli import train_input_error
from tests.helpers.preference_runs import ADAM_EPS, CLIP, LR, WD, run_argv, text_pairs
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, exported_weights
from tests.helpers.trl_parity import LORA, LORA_ADAM_EPS, hub_weights
from tests.helpers.trl_reward import pair_rewards, reward_model, reward_reference_run

RTOL, ATOL = 1e-5, 1e-5
STEPS, GLOBAL_BATCH, MICRO_BATCH = 2, 8, 2
MAX_LENGTH = 20  # the rows have at most 1 + 8 + 8 + 1 tokens
SEED = 1234  # --seed's default: the score head's draw
PAD_ID = 2  # the parity tokenizer's EOS, which pads (it has no pad token)
METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm")

@dataclasses.dataclass(frozen=True)
class Run:
    layout: tuple[int, ...]  # (tp, pp, dp) or (tp, pp, dp, ep)
    coefficient: float | None = None  # center_rewards_coefficient
    margin: bool = False  # the data's "margin" column
    start: str = "causal"  # from a "causal" LM, a "reward" model directory, or "resume" at step 1
    model: str = "llama"  # the parity model
    packed: bool = False
    extra: tuple[str, ...] = ()  # more flags
    lora: bool = False  # a fresh adapter on every target (trl_parity's LORA), against PEFT


RUNS = {
    "plain-shared-prompts-resumed-cp2-tp1pp1dp1": Run((1, 1, 1), start="resume", extra=("--prefix-sharing", "--cp", "2")),
    "margin-centered-from-reward-dir-sp-tp2pp2dp1": Run((2, 2, 1), 0.01, margin=True, start="reward",
                                                        extra=("--sequence-parallel",)),
    "margin-centered-packed-tp1pp2dp2": Run((1, 2, 2), 0.5, margin=True, packed=True),
    "moe-margin-tp1pp1dp2ep2": Run((1, 1, 2, 2), margin=True, model="qwen3_moe"),
    "lora-margin-centered-resumed-tp2pp1dp1": Run((2, 1, 1), 0.01, margin=True, start="resume", lora=True),
}
PACKED = ["--packing", "--max-tokens-per-microbatch", "40"]  # a step's 8 pairs in several packed rows


@pytest.fixture(scope="module")
def data(parity_models, tmp_path_factory) -> dict:
    """With and without a "margin" column (by True, False): the JSONL of STEPS global batches and its pairs as the
    engine tokenizes them, one list per step."""
    tokenizer = AutoTokenizer.from_pretrained(str(parity_models["llama"][0]))
    # No pad token: the run pads with the EOS, as TRL does, and a row's reward is read before its EOS.
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id == PAD_ID
    rows = text_pairs(STEPS * GLOBAL_BATCH, seed=9)
    rng = random.Random(4)
    files = {}
    for with_margin in (False, True):
        path = tmp_path_factory.mktemp("reward_data") / "prefs.jsonl"
        path.write_text("".join(json.dumps({**row, "margin": round(rng.uniform(-0.5, 1.5), 3)} if with_margin else row)
                                + "\n" for row in rows))
        pairs, stats = load_pairs(str(path), tokenizer=tokenizer, max_length=MAX_LENGTH, whole_rows=True)  # as the run
        assert len(pairs) == STEPS * GLOBAL_BATCH and stats.num_dropped_too_long == 0
        assert all((p.margin is not None) == with_margin for p in pairs)
        files[with_margin] = {"path": path,
                              "batches": [pairs[k * GLOBAL_BATCH:(k + 1) * GLOBAL_BATCH] for k in range(STEPS)]}
    return files


def _argv(model: Path, data_path: Path, out: Path, layout, coefficient: float | None, *, steps: int,
          lora: bool = False) -> list[str]:
    argv = run_argv(model=model, data=data_path, out=out, objective="reward", layout=layout, steps=steps,
                    global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, adam_eps=LORA_ADAM_EPS if lora else ADAM_EPS)
    argv += ["--max-length", str(MAX_LENGTH), *(LORA if lora else [])]
    if coefficient is not None:
        argv += ["--center-rewards-coefficient", str(coefficient)]
    return argv


def _check_adapter(adapter: Path, model_dir: Path, score: torch.Tensor, *, pairs, rewards: torch.Tensor) -> float:
    """OUTPUT/adapter of a reward LoRA run is what PEFT saves for TRL's LoraConfig(task_type="SEQ_CLS"):
    the adapters and the trained score head under PEFT's name of a modules_to_save module. PEFT loads it
    onto the causal LM as AutoModelForSequenceClassification, and the model scores the pairs as the
    trained one. Returns the largest difference of the rewards."""
    from peft import PeftModel
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("SEQ_CLS", ["score"]), config
    assert torch.equal(load_file(str(adapter / "adapter_model.safetensors"))["base_model.model.score.weight"], score)
    base = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32,
                                                              pad_token_id=PAD_ID)
    loaded = PeftModel.from_pretrained(base, str(adapter))
    difference = (pair_rewards(loaded, pairs, pad_token_id=PAD_ID) - rewards).abs().max().item()
    assert difference <= ATOL, difference
    return difference


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _reward_dir(model_dir: Path, *, score: torch.Tensor, out: Path) -> Path:
    """The causal LM at `model_dir` saved as an HF reward model with the score head `score`, and its tokenizer."""
    reward_model(model_dir, score=score, pad_token_id=PAD_ID).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, out / name)
    return out


@pytest.mark.parametrize("name", RUNS)
def test_reward_through_the_command_line_matches_trl(name, parity_models, moe_models, data, ray_cluster, tmp_path):
    run = RUNS[name]
    layout, coefficient, start = run.layout, run.coefficient, run.start
    data = data[run.margin]
    model_dir = {**parity_models, **moe_models}[run.model][0]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    _, score = score_head_from_causal(config, pad_token_id=PAD_ID, seed=SEED)
    if start == "reward":  # the same starting point, as a reward model with a score head of its own
        score = 0.5 * score.flip(-1)
        run_from = _reward_dir(model_dir, score=score, out=tmp_path / "reward_model")
    else:
        run_from = model_dir
    out = tmp_path / "run"
    for steps in (1, STEPS) if start == "resume" else (STEPS,):
        argv = [*_argv(run_from, data["path"], out, layout, coefficient, steps=steps, lora=run.lora),
                *(PACKED if run.packed else []), *run.extra]
        result = main_in_process(argv, cluster=ray_cluster)
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert ("resuming from" in result.stdout) == (start == "resume"), result.stdout[-3000:]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert (resolved["objective"], resolved["ref_mode"], resolved["packing"], resolved["tp"], resolved["pp"],
            resolved["dp"], resolved["ep"]) == ("reward", "none", run.packed, *layout, *([] if len(layout) == 4 else [1]))
    assert (resolved["lora_rank"] is not None) is run.lora, resolved
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))

    reference = reward_model(model_dir, score=score, pad_token_id=PAD_ID, lora=run.lora)
    ref = reward_reference_run(model=reference, batches=data["batches"], center_rewards_coefficient=coefficient,
                               lr=LR, clip_grad=CLIP, weight_decay=WD,
                               adam_eps=LORA_ADAM_EPS if run.lora else ADAM_EPS, pad_token_id=PAD_ID)
    if run.lora:  # what save_pretrained of the merged model writes: the base + B·A, and the trained head
        reference = reference.merge_and_unload()
    worst: dict[str, float] = {}
    tokens_before = 0
    for step, (ours, theirs) in enumerate(zip(rows, ref["metrics"]), start=1):
        assert ours["memory/reference_params_peak_bytes"] == 0, ours
        # TRL counts the tokens of every step so far; the engine logs the step's own.
        assert ours["num_tokens"] == theirs["num_tokens"] - tokens_before, (ours, theirs)
        tokens_before = theirs["num_tokens"]
        for key in METRICS:
            what = f"{name} step {step} {key}: ours {ours[key]!r}, TRL {theirs[key]!r}"
            assert_close(_scalar(ours[key]), _scalar(theirs[key]), what=what, rtol=RTOL)
            worst[key] = max(worst.get(key, 0.0), abs(ours[key] - theirs[key]) / max(abs(theirs[key]), 1e-300))
    assert 0 < rows[0]["accuracy"] < 1, rows[0]  # not degenerate: both outcomes occur

    trained = exported_weights(out / "hf")
    expected_weights = hub_weights(reference, spec=open_hf_dir(model_dir).spec)  # each expert's tensors apart
    assert set(trained) == set(expected_weights) and "score.weight" in trained
    for key, expected in expected_weights.items():
        scale = expected.abs().max().item()
        assert_close(trained[key], expected, what=f"{name} weights {key}", rtol=RTOL)
        worst["weights"] = max(worst.get("weights", 0.0),
                               (trained[key].double() - expected.double()).abs().max().item() / scale)
    moved = (expected_weights["score.weight"] - score).abs().max().item() / score.abs().max().item()
    assert moved > 100 * RTOL, moved  # the head trained, far beyond the tolerance
    if run.lora:  # and the adapters merged into the body moved it far beyond the tolerance too
        start_weights = exported_weights(model_dir)
        body = max((expected_weights[k] - start_weights[k]).abs().max().item() / start_weights[k].abs().max().item()
                   for k in expected_weights if k in start_weights and k.endswith("q_proj.weight"))
        assert body > 100 * RTOL, body

    # OUTPUT/hf is a reward model transformers loads, and it scores the pairs as the trained one.
    exported = AutoModelForSequenceClassification.from_pretrained(str(out / "hf"), dtype=torch.float32)
    assert exported.config.pad_token_id == PAD_ID and exported.config.num_labels == 1
    pairs = [p for batch in data["batches"] for p in batch]
    ours_rewards = pair_rewards(exported, pairs, pad_token_id=PAD_ID)
    theirs_rewards = pair_rewards(reference, pairs, pad_token_id=PAD_ID)
    worst["exported rewards (abs)"] = (ours_rewards - theirs_rewards).abs().max().item()
    assert worst["exported rewards (abs)"] <= ATOL, worst
    if run.lora:
        worst["adapter rewards (abs)"] = _check_adapter(out / "adapter", model_dir, trained["score.weight"],
                                                        pairs=pairs, rewards=theirs_rewards)
    print(f"\n{name}: largest relative differences " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_the_command_lines_reward_data_are_whole_sequences(tmp_path):
    """--objective reward reads its data as TRL's RewardTrainer: implicit-prompt rows that share no
    text are scored whole, a pair with a sequence over --max-length is dropped (data_stats'
    num_dropped_too_long, a note), never cut; the same file under dpo is refused for the row
    without a shared prompt."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.data.pairs import data_notes
    from mcore_dpo.data.sources import DataError
    from tests.helpers.token_store import prepare_run

    rows = [{"chosen": f"w{i} w{i + 1}", "rejected": f"x{i}"} for i in range(8)]
    rows.append({"chosen": " ".join(f"w{i}" for i in range(40)), "rejected": "x"})  # over --max-length 16
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--data", str(data), "--max-length", "16", "--global-batch-size", "8", "--data-cache", str(tmp_path / "c")]
    config, _ = resolve(["--objective", "reward", *argv])
    prep = prepare_run(config, log=lambda line: None)
    pairs, stats = list(prep.train_data), prep.train_data.stats[0]
    assert (len(pairs), stats.num_dropped_too_long, stats.num_truncated_pairs) == (8, 1, 0)
    assert all(not p.prompt_ids or p.prompt_ids == pairs[0].prompt_ids for p in pairs)  # nothing shared but a BOS
    assert f"{data}: dropped 1 pairs with a sequence longer than --max-length 16" in " ".join(
        data_notes(str(data), stats, max_length=16))
    config, _ = resolve(argv)
    with pytest.raises(DataError, match=r"prefs.jsonl:1: 'chosen' and 'rejected' share no leading text"):
        prepare_run(config, log=lambda line: None)


@pytest.mark.parametrize("argv, expected", [
    (["--objective", "reward", "--beta", "0.5"], "beta: not an option of --objective reward"),
    (["--objective", "reward", "--ref-mode", "precomputed"], "ref_mode: reward is reference-free"),
    (["--center-rewards-coefficient", "0.01"], "center_rewards_coefficient: an option of --objective reward, not of dpo"),
    (["--objective", "reward", "--center-rewards-coefficient", "-1"],
     "center_rewards_coefficient: must be a finite number >= 0"),
], ids=["beta", "ref-mode", "coefficient-with-dpo", "negative-coefficient"])
def test_options_that_do_not_fit_are_refused_in_one_line(argv, expected, capsys, tmp_path):
    err = train_input_error(capsys, [*argv, "--output-dir", str(tmp_path / "out")])
    assert expected in err, err
    assert not (tmp_path / "out").exists()
