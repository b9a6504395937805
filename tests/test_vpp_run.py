"""`--vpp N` (virtual pipeline stages) run by the ranks and through the command line.

- What it refuses, each in one line, before any worker starts (config.py's
  `_validate_virtual_pipeline` and `check_virtual_pipeline`; the plans are tests/test_vpp_plan.py's).
- Parity of real gloo ranks with --vpp 2 (two model chunks per rank, one layer each,
  megatron-core's interleaved 1F1B) against the single-process HF reference
  (tests/helpers/parity.py): every metric and gradient of every step, the weights after the last,
  the eval metrics after it (forward-only passes round the ring of chunks); at (1, 2, 1) for 3
  steps in every colocated reference mode and reference-free, beside the same run at --vpp 1
  (which the --vpp 2 run equals within 1e-6: metrics of every step, weights after 3 steps);
  at (2, 2, 1) with and without sequence parallelism; at (1, 4, 1) over 8-layer models. Ranks name their parameters `chunks.<c>.<name>`; the
  expected shard of chunk c of stage s is that of stage c*pp + s of a plain pp*vpp pipeline
  (model/chunks.py).
- Through the command line (the real parser and driver on the session's Ray cluster): one step
  at (1, 2, 1) with --vpp 2 equals the HF reference within 1e-5 (step-1 metrics, the exported
  weights); the run's checkpoint (one file per chunk, a plain pp*vpp-stage directory) resumes
  at --vpp 1 for step 2, which equals the reference's step 2 as well; and the other way round; and
  with --save-format torch_dist, whose --vpp 2 checkpoint megatron-core's own loader reads (at
  tp 2 x pp 1) and converts to HF with the same logits.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from checkpoint_convert.gather import mcore_to_hf
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mapping import hf_to_mcore_shard
from mcore_dpo.command_line import resolve
from mcore_dpo.config import ConfigError
from mcore_dpo.driver.defaults import DEFAULT_TRAIN_DATA
from mcore_dpo.model.chunks import rank_shard
from mcore_dpo.parallel.mesh import Layout
from tests.helpers.cli import train_input_error
from tests.helpers.data import PACKED
from mcore_dpo.data.pairs import load_pairs
from tests.helpers.parity import METRICS, REF_GROUP, cached_reference, check_metrics, jobs_for, parity_job
from tests.helpers.preference_runs import ADAM_EPS, CLIP, LR, WD, run_argv, text_pairs
from tests.helpers.ranks import check_ran_packed, load_rank_tensors, run_ranks
from tests.helpers.ray_runs import main_in_process
from tests.helpers.reference import assert_close, assert_exported_weights, reference_run
from tests.helpers.trl_parity import Run, check_run


@pytest.mark.parametrize("argv,expected", [
    (["--vpp", "0"], "vpp: must be a positive integer, got 0"),
    (["--vpp", "2"], "vpp: --vpp 2 needs pipeline parallelism (pp >= 2), got pp 1"),
    (["--vpp", "2", "--pp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
     "vpp: the microbatch count per dp rank (3 = global_batch_size 6 / (dp 1 x micro_batch_size 2)) must be a "
     "multiple of pp (2): megatron-core's interleaved 1F1B runs microbatches in groups of pp"),
], ids=["zero", "no-pipeline", "microbatches"])
def test_bad_values_are_one_line(capsys, argv, expected, tmp_path):
    assert expected in train_input_error(capsys, [*argv, "--output-dir", str(tmp_path / "out")])
    with pytest.raises((ConfigError, SystemExit)):
        resolve(argv)
    assert not (tmp_path / "out").exists()


def test_the_layer_count_must_divide_into_chunks(capsys, hf_llama, tmp_path):
    """The test Llama has 4 layers: pp 2 x vpp 3 does not divide them."""
    err = train_input_error(capsys, ["--model", str(hf_llama), "--data", DEFAULT_TRAIN_DATA, "--pp", "2", "--vpp", "3",
                                     "--global-batch-size", "8", "--micro-batch-size", "2",
                                     "--output-dir", str(tmp_path / "out")])
    assert err.endswith("has 4 layers, not a multiple of pp x vpp = 2 x 3 = 6 (every model chunk holds as many "
                        "layers)"), err
    assert err.startswith("error: vpp: "), err
    assert not (tmp_path / "out").exists()


def _expected_shard(spec, tensors, *, layout: Layout, tp_rank: int, pp_rank: int) -> dict:
    """What rank (tp_rank, pp_rank) of `layout` holds of the HF-named `tensors`, chunk by chunk."""
    return rank_shard(lambda pp, stage: hf_to_mcore_shard(spec, tp=layout.tp, tp_rank=tp_rank, pp=pp, pp_rank=stage,
                                                          get=tensors.__getitem__),
                      layout=layout, pp_rank=pp_rank)


def _check_job(out_dir: Path, j: int, job: dict, layout: Layout) -> None:
    """Job j of a run_ranks launch against the HF reference: every metric and every rank's
    gradient of every step, the weights after the last, the eval metrics after it, within 1e-5."""
    family, mode, loss = job["key"]
    steps, cfg = len(job["batches"]), job["config"]
    ref = cached_reference(cfg["model"], cfg["ref_model"], loss, mode, steps)
    spec, dims = open_hf_dir(cfg["model"]).spec, (layout.tp, layout.pp, layout.dp)
    what = (f"{family}/{mode} --vpp {layout.vpp} at tp{layout.tp} pp{layout.pp} dp{layout.dp}"
            + (" sequence-parallel" if cfg.get("sequence_parallel") else ""))
    for step, ref_grads in enumerate(ref["grads"], start=1):
        for (t, p, d), shard in load_rank_tensors(out_dir, j, f"grads{step}", layout=dims).items():
            expected = _expected_shard(spec, ref_grads, layout=layout, tp_rank=t, pp_rank=p)
            assert set(expected) == set(shard), what
            assert layout.vpp == 1 or all(name.startswith("chunks.") for name in shard), what
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"{what} step {step} grad {name} (tp{t} pp{p})")
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=dims).items():
        expected = _expected_shard(spec, ref["weights"], layout=layout, tp_rank=t, pp_rank=p)
        assert set(expected) == set(shard), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what} weight {name} after {steps} steps (tp{t} pp{p})")
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    assert len(ours) == steps + 1, what
    free = mode == "none"
    for step, (m_ours, m_ref) in enumerate(zip(ours[:steps], ref["metrics"]), start=1):
        check_metrics(m_ours, m_ref, names=METRICS, prefix="", what=f"{what} step {step}", rtol=1e-5,
                      reference_free=free)
    check_metrics(ours[steps], ref["eval"], names=tuple(n for n in METRICS if n != "grad_norm"), prefix="eval/",
                  what=f"{what} eval", rtol=1e-5, reference_free=free)


def _with(job: dict, **config) -> dict:
    return {**job, "config": {**job["config"], **config}}


def _check_same_run(out_dir: Path, chunked: int, plain: int, job: dict, *, tp: int, pp: int, rtol: float = 1e-6) -> None:
    """Job `chunked` (--vpp 2) against job `plain` (--vpp 1) of the same launch, data and
    models: every step's metrics, and the weights after the last step gathered to HF names
    from the plain run and sharded again as the chunked run holds them, within `rtol`."""
    spec = open_hf_dir(job["config"]["model"]).spec
    what = f"--vpp 2 against --vpp 1 at tp{tp} pp{pp}"
    ours, theirs = (json.loads((out_dir / f"job{j}_metrics.json").read_text()) for j in (chunked, plain))
    assert len(ours) == len(theirs) == len(job["batches"]) + 1, what
    for step, (m_ours, m_theirs) in enumerate(zip(ours, theirs), start=1):
        names = [name for name in m_theirs if name.removeprefix("eval/") in METRICS]
        assert len(names) >= 5, what
        for name in names:
            value = m_theirs[name]
            assert abs(m_ours[name] - value) <= rtol * max(abs(value), 1e-3), f"{what} step {step} {name}"
    plain_shards = load_rank_tensors(out_dir, plain, "weights", layout=(tp, pp, 1))
    hf = dict(mcore_to_hf(spec, tp=tp, pp=pp, get_shard=lambda t, p: plain_shards[(t, p, 0)]))
    for (t, p, d), shard in load_rank_tensors(out_dir, chunked, "weights", layout=(tp, pp, 1)).items():
        expected = _expected_shard(spec, hf, layout=Layout(tp=tp, pp=pp, dp=1, vpp=2), tp_rank=t, pp_rank=p)
        assert set(expected) == set(shard), what
        for name, value in expected.items():
            assert_close(shard[name], value, what=f"{what}: weight {name} (tp{t} pp{p})", rtol=rtol)


def test_two_chunks_per_rank_match_the_reference_at_pp2(parity_models, tmp_path):
    """(1, 2, 1), 3 steps, --vpp 2 in every colocated reference mode (the Llama untied, the Qwen2
    with tied embeddings: chunk 0 of stage 0 and the last chunk of the last stage share them),
    reference-free, the same Llama run at --vpp 1 in the same launch, with --prefix-sharing, and packed.
    The interleaved runs carry reference forwards across steps (pipeline/interleaved.py), at --vpp 2
    as at --vpp 1: steps 1 and 2 keep an activation for the next (their memory count sees it), and
    the Llama run at --vpp 2 equals the one at --vpp 1 (every metric of every step, the weights after
    the last) within 1e-6, as both equal the HF reference."""
    tp, pp, dp = 1, 2, 1
    jobs = [_with(job, vpp=2) for job in jobs_for((tp, pp, dp), parity_models, all_losses=False, steps=3,
                                                   losses=("sigmoid",))]
    qwen2 = next(job for job in jobs if job["key"] == ("qwen2", "interleaved", "sigmoid"))
    jobs.append({**_with(qwen2, ref_mode="none"), "key": ("qwen2", "none", "sigmoid")})
    llama = next(job for job in jobs if job["key"] == ("llama", "interleaved", "sigmoid"))
    plain = len(jobs)
    jobs += [_with(llama, vpp=1), _with(llama, prefix_sharing=True),  # shared-prompt rows through the chunks
             _with(llama, **PACKED)]  # packed rows, a multiple of pp microbatches per step
    assert len(jobs) == 10
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    check_ran_packed(tmp_path, padded=jobs.index(llama), packed=len(jobs) - 1)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, Layout(tp=tp, pp=pp, dp=dp, vpp=job["config"]["vpp"]))
    metrics = [json.loads((tmp_path / f"job{j}_metrics.json").read_text()) for j in range(len(jobs))]
    for j, job in enumerate(jobs):
        if job["config"]["ref_mode"] == "interleaved":  # steps 1 and 2 count memory, and carry out
            assert all(step["memory/carried_peak_bytes"] > 0 for step in metrics[j][:2]), (job["key"], metrics[j][:2])
    _check_same_run(tmp_path, jobs.index(llama), plain, llama, tp=tp, pp=pp)


def test_two_chunks_per_rank_match_the_reference_at_tp2_pp2(parity_models, tmp_path):
    """(2, 2, 1), 2 steps, --vpp 2: vocab-parallel logits on the last chunk, with and without
    sequence parallelism; and --ref-mode separate (the reference group at tp 2 without chunks)."""
    tp, pp, dp = 2, 2, 1
    policy, reference = parity_models["llama"]
    jobs = [parity_job((tp, pp, dp), policy, reference, name="llama", vpp=2),
            parity_job((tp, pp, dp), policy, reference, name="llama", vpp=2, sequence_parallel=True),
            {**_with(parity_job((tp, pp, dp), policy, reference, name="llama", vpp=2), ref_mode="separate",
                     **REF_GROUP), "key": ("llama", "separate", "sigmoid")}]
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, Layout(tp=tp, pp=pp, dp=dp, vpp=2))


def test_two_chunks_per_rank_with_context_parallelism(parity_models, tmp_path):
    """(1, 2, 1) x cp 2, 2 steps, --vpp 2: each chunk's attention over its cp rank's positions."""
    tp, pp, dp, cp = 1, 2, 1, 2
    policy, reference = parity_models["llama"]
    jobs = [parity_job((tp, pp, dp, cp), policy, reference, name="llama", vpp=2, cp=cp)]
    run_ranks(world_size=tp * pp * dp * cp, jobs=jobs, out_dir=tmp_path)
    _check_job(tmp_path, 0, jobs[0], Layout(tp=tp, pp=pp, dp=dp, cp=cp, vpp=2))


def test_gemma3_with_six_chunks_matches_the_reference(tmp_path):
    """Gemma 3 (its own block spec: sandwich norms, local/global layers by layer number) over 6
    layers at (1, 2, 1) with --vpp 3: one layer per chunk, 2 steps."""
    from tests.helpers.gemma import gemma3
    from tests.helpers.models import save_hf

    tp, pp, dp = 1, 2, 1
    policy, reference = (save_hf(gemma3(seed=seed), tmp_path / name) for seed, name in ((1, "policy"), (2, "ref")))
    jobs = [parity_job((tp, pp, dp), policy, reference, name="gemma3", vpp=3)]
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path / "out")
    _check_job(tmp_path / "out", 0, jobs[0], Layout(tp=tp, pp=pp, dp=dp, vpp=3))


@pytest.fixture(scope="module")
def eight_layer_models(tmp_path_factory) -> dict:
    """The parity models with 8 layers (pp 4 x vpp 2 chunks of one layer): policy and reference dirs by family."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.helpers.models import PAD, VOCAB_SIZE, save_hf, small_init

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    root = tmp_path_factory.mktemp("eight_layers")
    made = {"llama": lambda: LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)),
            "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))}
    return {family: tuple(save_hf(small_init(make(), seed).float(), root / f"{family}_{role}")
                          for role, seed in (("policy", 1), ("ref", 2)))
            for family, make in made.items()}


def test_two_chunks_per_rank_match_the_reference_at_pp4(eight_layer_models, tmp_path):
    """(1, 4, 1), 2 steps, --vpp 2 over 8 layers: the wrap-around link from stage 3 to stage 0, the
    untied Llama with the interleaved reference, the tied Qwen2 with the sequential one."""
    tp, pp, dp = 1, 4, 1
    jobs = [parity_job((tp, pp, dp), *eight_layer_models["llama"], name="llama", vpp=2),
            {**_with(parity_job((tp, pp, dp), *eight_layer_models["qwen2"], name="qwen2", vpp=2), ref_mode="sequential"),
             "key": ("qwen2", "sequential", "sigmoid")}]
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, Layout(tp=tp, pp=pp, dp=dp, vpp=2))


def _megatron_reads(iteration: Path, save_dir: Path, tmp_path: Path) -> None:
    """megatron-core's own dist_checkpointing.load reads the model and optimizer state of a
    torch_dist checkpoint at tp 2 x pp 1 (tests/helpers/megatron_ranks.py: divisor 64 keeps the
    writer's padded vocabulary) and gets this project's reader's tensors, and its logits are those
    of `checkpoint_convert mcore-to-hf` of the save directory."""
    from safetensors.torch import load_file, save_file

    from mcore_dpo.checkpoint.torch_dist import open_part
    from mcore_dpo.model.builder import open_weights
    from tests.helpers.megatron_ranks import spawn, training_consumer_rank
    from tests.helpers.models import exported_logits

    tp, pp, divisor = 2, 1, 64
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    job = {"checkpoint": str(iteration), "tp": tp, "pp": pp, "divisor": divisor,
           "tokens": str(tmp_path / "tokens.safetensors"), "logits": str(tmp_path / "logits.safetensors"),
           "state": str(tmp_path / "state_rank{rank}.safetensors")}
    spawn(training_consumer_rank, world_size=tp * pp, job=job)
    model_view = open_weights(str(iteration))
    parts = {"model": model_view, "fp32_param": open_part(iteration, "model"),
             "exp_avg": open_part(iteration, "exp_avg"), "exp_avg_sq": open_part(iteration, "exp_avg_sq")}
    for rank in range(tp):
        loaded = load_file(job["state"].format(rank=rank))
        for part, view in parts.items():
            expected = hf_to_mcore_shard(model_view.spec, tp=tp, tp_rank=rank, pp=pp, pp_rank=0, get=view.get,
                                         divisor=divisor)
            for name, tensor in expected.items():
                assert torch.equal(loaded[f"{part}/{name}"], tensor), (rank, part, name)
    reference = exported_logits(save_dir, tmp_path / "hf_from_torch_dist", tokens)
    assert (load_file(job["logits"])["logits"][..., :100] - reference).abs().max().item() <= 1e-5


CLI_BATCH, CLI_MICRO, CLI_MAX_LENGTH, CLI_BETA = 8, 2, 20, 0.5


@pytest.mark.parametrize("first, then, fmt", [(2, 1, "safetensors"), (1, 2, "safetensors"), (2, 1, "torch_dist")],
                         ids=["vpp2-then-vpp1", "vpp1-then-vpp2", "torch_dist-vpp2-then-vpp1"])
def test_through_the_command_line_and_resumed_at_another_vpp(first, then, fmt, parity_models, ray_cluster, tmp_path):
    policy, reference = parity_models["llama"]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(2 * CLI_BATCH, seed=5)))
    pairs, stats = load_pairs(str(data), tokenizer=AutoTokenizer.from_pretrained(str(policy)),
                              max_length=CLI_MAX_LENGTH)
    assert len(pairs) == 2 * CLI_BATCH and stats.num_truncated_pairs == 0
    batches = [pairs[:CLI_BATCH], pairs[CLI_BATCH:]]
    expected = {steps: reference_run(policy_dir=Path(policy), ref_dir=Path(reference), batches=batches[:steps],
                                     loss_type="sigmoid", beta=CLI_BETA, label_smoothing=0.0, reference_free=False,
                                     lr=LR, clip_grad=CLIP, weight_decay=WD, adam_eps=ADAM_EPS)
                for steps in (1, 2)}
    out = tmp_path / "run"
    for steps, vpp in ((1, first), (2, then)):
        argv = run_argv(model=policy, data=data, out=out, objective="dpo", layout=(1, 2, 1), steps=steps,
                        global_batch=CLI_BATCH, micro_batch=CLI_MICRO)
        argv += ["--ref-model", str(reference), "--beta", str(CLI_BETA), "--max-length", str(CLI_MAX_LENGTH),
                 "--no-packing", "--vpp", str(vpp), "--save-format", fmt]
        result = main_in_process(argv, cluster=ray_cluster)
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        resolved = yaml.safe_load((out / "config.yaml").read_text())
        assert (resolved["pp"], resolved["vpp"], resolved["ref_mode"]) == (2, vpp, "interleaved"), resolved
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, steps + 1)), rows
        what = f"--vpp {vpp} step {steps}" + (f" (resumed from --vpp {first})" if steps == 2 else "")
        check_metrics(rows[-1], expected[steps]["metrics"][-1], names=METRICS, prefix="", what=what, rtol=1e-5)
        assert_exported_weights(out / "hf", expected[steps]["weights"], initial=Path(policy), what=what, rtol=1e-5)
        if steps == 1 and fmt == "torch_dist":  # the chunks' tensors by global key; args name the chunks
            from checkpoint_convert.dcp import DcpReader
            from checkpoint_convert.torch_dist import read_common_state

            iteration = out / "checkpoints" / "iter_0000001"
            common, _ = read_common_state(iteration, DcpReader(iteration))
            assert common["args"].virtual_pipeline_model_parallel_size == (vpp if vpp > 1 else None)
            _megatron_reads(iteration, out / "checkpoints", tmp_path)
        elif steps == 1:  # a --vpp v run's checkpoint: one rank file per chunk, as pp x v stages
            model_dir = out / "checkpoints" / "step_00000001" / "model"
            files = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*.safetensors"))
            assert files == [f"tp0_pp{p}/model.safetensors" for p in range(2 * vpp)], files
    assert "resuming from" in result.stdout, result.stdout[-3000:]


def test_the_memory_estimate_counts_chunk_forwards_in_flight():
    """Policy-only 1F1B at pp 4, m 8 over 8 layers: the first stage holds 4 microbatches of 2
    layers (8 layers' worth); with --vpp 2 it holds 2(p-1) + (v-1)p + 1 = 11 chunk forwards of
    1 layer (11 layers' worth), the most of any stage (pipeline/memory.py)."""
    from mcore_dpo.tools.memory_estimate import LayerShape, layer_activation_bytes, plan_activation_bytes

    shape = LayerShape(hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1024)
    kw = dict(seq_len=128, rows=2, tp=2, sequence_parallel=True, attention="flash", dtype_bytes=2)
    one_layer = layer_activation_bytes(shape, **kw)
    plain, chunked = (plan_activation_bytes(shape, layers=8, pp=4, num_microbatches=8, ref_mode="none", vpp=vpp, **kw)
                      for vpp in (1, 2))
    assert chunked - plain == pytest.approx(3 * one_layer, rel=1e-12)
    for mode in ("interleaved", "sequential"):  # every reference mode builds its plans with chunks
        assert plan_activation_bytes(shape, layers=8, pp=4, num_microbatches=8, ref_mode=mode, vpp=2, **kw) >= chunked
    # MoE: the same count of chunk forwards, each of one MoE layer; with the first 4 layers dense
    # (chunk 0 of every stage), a stage's unit is its larger chunk's
    moe = LayerShape(hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512, vocab=1024, experts=8, topk=2, moe_ffn=128)
    one_moe = layer_activation_bytes(moe, **kw)
    moe_plain, moe_chunked = (plan_activation_bytes(moe, layers=8, pp=4, num_microbatches=8, ref_mode="none", vpp=vpp,
                                                    **kw) for vpp in (1, 2))
    assert moe_chunked - moe_plain == pytest.approx(3 * one_moe, rel=1e-12)
    first_dense = plan_activation_bytes(dataclasses.replace(moe, dense_layers=4), layers=8, pp=4, num_microbatches=8,
                                        ref_mode="none", vpp=2, **kw)
    assert one_layer != one_moe
    assert first_dense == pytest.approx(moe_chunked + 11 * (max(one_layer, one_moe) - one_moe), rel=1e-12)


@pytest.mark.parametrize("objective, options", [("cpo", {"loss_type": "simpo", "simpo_gamma": 0.7, "beta": 2.0}),
                                                ("orpo", {"beta": 0.5})], ids=["simpo", "orpo"])
def test_reference_free_objectives_with_chunks_match_trl(objective, options, trl_parity, tmp_path):
    """The reference-free objectives, where virtual stages pay most (the bubbles are empty), at
    (1, 2, 1) with --vpp 2 through the command line against TRL (tests/helpers/trl_parity.py)."""
    check_run(objective, f"{objective}-vpp2-tp1pp2dp1", Run((1, 2, 1), options, engine={"vpp": 2}),
              setup=trl_parity, tmp_path=tmp_path)


def test_a_reward_model_with_chunks_matches_trl(parity_models, ray_cluster, tmp_path):
    """--objective reward (the score head on the last chunk of the last stage) at (1, 2, 1) with
    --vpp 2, 2 steps through the command line, against TRL's RewardTrainer
    (tests/helpers/trl_reward.py): the loss, accuracy and grad norm of each step and the exported
    weights, score head included, within 1e-5."""
    from checkpoint_convert.score_head import score_head_from_causal
    from tests.helpers.reference import exported_weights
    from tests.helpers.trl_reward import reward_model, reward_reference_run

    policy = parity_models["llama"][0]
    pad = 2  # the parity tokenizer's EOS pads (it has no pad token), as in tests/test_reward_parity.py
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(2 * CLI_BATCH, seed=9)))
    pairs, _ = load_pairs(str(data), tokenizer=AutoTokenizer.from_pretrained(str(policy)), max_length=CLI_MAX_LENGTH)
    out = tmp_path / "run"
    argv = run_argv(model=policy, data=data, out=out, objective="reward", layout=(1, 2, 1), steps=2,
                    global_batch=CLI_BATCH, micro_batch=CLI_MICRO) + ["--max-length", str(CLI_MAX_LENGTH), "--vpp", "2"]
    result = main_in_process(argv, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["vpp"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _, score = score_head_from_causal(json.loads((Path(policy) / "config.json").read_text()), pad_token_id=pad,
                                      seed=1234)  # --seed's default draws the run's head
    ref = reward_reference_run(model=reward_model(policy, score=score, pad_token_id=pad),
                               batches=[pairs[:CLI_BATCH], pairs[CLI_BATCH:]], center_rewards_coefficient=None,
                               lr=LR, clip_grad=CLIP, weight_decay=WD, adam_eps=ADAM_EPS, pad_token_id=pad)
    for step, (ours, theirs) in enumerate(zip(rows, ref["metrics"]), start=1):
        for key in ("loss", "accuracy", "margin", "grad_norm"):
            assert_close(torch.tensor(ours[key], dtype=torch.float64), torch.tensor(theirs[key], dtype=torch.float64),
                         what=f"reward --vpp 2 step {step} {key}", rtol=1e-5)
    trained = exported_weights(out / "hf")
    assert set(trained) == set(ref["weights"]) and "score.weight" in trained
    for key, expected in ref["weights"].items():
        assert_close(trained[key], expected, what=f"reward --vpp 2 weights {key}", rtol=1e-5)


def test_packed_microbatches_come_in_multiples_of_pp():
    """--vpp with packing: a dp rank's packed microbatch count is a multiple of pp (the fewest that
    fits the budget), or the step is refused in one line."""
    from mcore_dpo.data.packing import split_microbatches

    costs = [30, 5, 17, 22, 9, 40, 12, 8, 26, 3, 19, 33]
    plain = split_microbatches(costs, list(range(12)), max_tokens=64)
    for multiple in (2, 3, 4):
        cut = split_microbatches(costs, list(range(12)), max_tokens=64, count_multiple=multiple)
        assert len(cut) % multiple == 0 and len(cut) >= len(plain), (multiple, cut)
        assert len(cut) - multiple < len(plain) or len(plain) % multiple == 0
        assert sorted(i for mb in cut for i in mb) == list(range(12))
        assert all(sum(costs[i] for i in mb) <= 64 for mb in cut)
    with pytest.raises(ValueError, match="do not fill a multiple of 4 packed microbatches"):
        split_microbatches([60, 60, 60], [0, 1, 2], max_tokens=64, count_multiple=4)


def test_a_moe_model_with_chunks_and_the_load_balancing_loss_matches_the_reference(tmp_path):
    """A 4-layer Qwen3-MoE (layer 1 dense) at (1, 2, 1) with --vpp 2 and the routers'
    load-balancing loss (tests/helpers/moe_parity.py): the counts ride on each chunk's act and
    grad round the ring; every gradient of 2 steps, the metrics and the router metrics against HF +
    TRL's sum with the aux term."""
    from tests.helpers import moe_parity
    from tests.helpers.models import qwen3_moe, save_hf

    tp, pp, dp = 1, 2, 1
    policy, reference = (save_hf(qwen3_moe(seed=seed, num_layers=4), tmp_path / name)
                         for seed, name in ((1, "policy"), (2, "ref")))
    job = _with(moe_parity.aux_job((tp, pp, dp, 1), policy, reference), vpp=2)
    run_ranks(world_size=tp * pp * dp, jobs=[job], out_dir=tmp_path / "out")
    ref = moe_parity.with_hub_names(moe_parity.aux_reference(str(policy), str(reference), job["batches"],
                                                             groups=moe_parity.engine_groups(dp=dp), steps=2), policy)
    layout, spec = Layout(tp=tp, pp=pp, dp=dp, vpp=2), open_hf_dir(str(policy)).spec
    for step, ref_grads in enumerate(ref["grads"], start=1):
        for (t, p, d), shard in load_rank_tensors(tmp_path / "out", 0, f"grads{step}", layout=(tp, pp, dp)).items():
            expected = _expected_shard(spec, ref_grads, layout=layout, tp_rank=t, pp_rank=p)
            assert set(expected) == set(shard)
            for name, value in expected.items():
                assert_close(shard[name], value, what=f"moe --vpp 2 step {step} grad {name} (pp{p})")
    ours = json.loads((tmp_path / "out" / "job0_metrics.json").read_text())
    for step, (m_ours, m_ref) in enumerate(zip(ours, ref["metrics"]), start=1):
        check_metrics(m_ours, m_ref, names=METRICS, prefix="", what=f"moe --vpp 2 step {step}", rtol=1e-5)
        # The reference numbers the MoE layers in order (layer 1 is dense), the engine by HF layer.
        by_layer = {re.sub(r"layer(\d+)$", lambda m: f"layer{spec.moe_layers[int(m.group(1))]}", key): value
                    for key, value in m_ref["router"].items()}
        moe_parity.check_router_metrics(m_ours, by_layer, what=f"moe --vpp 2 step {step}")


def test_lora_through_the_command_line_across_vpp(parity_models, ray_cluster, tmp_path):
    """A LoRA run through the command line at (1, 2, 1): one step at --vpp 2 (its adapter shards,
    one per chunk, joined into the checkpoint's PEFT files) resumed at --vpp 1 for step 2 equals
    two steps at --vpp 1: every metric and the exported adapter within 1e-6."""
    from safetensors.torch import load_file

    policy, reference = parity_models["llama"]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(2 * CLI_BATCH, seed=5)))
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.0", "--lora-targets", "qkv,proj,fc1,fc2"]
    runs = {}
    for name, plan in (("chunked", ((1, 2), (2, 1))), ("plain", ((2, 1),))):
        out = tmp_path / name
        for steps, vpp in plan:
            argv = run_argv(model=policy, data=data, out=out, objective="dpo", layout=(1, 2, 1), steps=steps,
                            global_batch=CLI_BATCH, micro_batch=CLI_MICRO) + lora
            argv += ["--beta", str(CLI_BETA), "--max-length", str(CLI_MAX_LENGTH), "--no-packing", "--vpp", str(vpp)]
            result = main_in_process(argv, cluster=ray_cluster)
            assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        runs[name] = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                      load_file(str(out / "adapter" / "adapter_model.safetensors")))
    (rows, adapter), (plain_rows, plain_adapter) = runs["chunked"], runs["plain"]
    assert len(rows) == len(plain_rows) == 2
    for step, (ours, theirs) in enumerate(zip(rows, plain_rows), start=1):
        check_metrics(ours, theirs, names=METRICS, prefix="", what=f"LoRA --vpp 2 then 1, step {step}", rtol=1e-6)
    assert set(adapter) == set(plain_adapter)
    for name, tensor in plain_adapter.items():
        assert_close(adapter[name], tensor, what=f"LoRA adapter {name}", rtol=1e-6)


def test_expert_parallel_moe_through_the_command_line_across_vpp(ray_cluster, tmp_path):
    """A 4-layer Qwen3-MoE at (1, 2, 2) with --ep 2 through the command line: one step at --vpp 2
    (its expert-parallel checkpoint files written chunk by chunk, as pp x vpp stages) resumed at
    --vpp 1 for step 2 equals two steps at --vpp 1: every metric and the exported weights within
    1e-6."""
    from tests.helpers.models import qwen3_moe, save_hf
    from tests.helpers.reference import exported_weights

    policy = save_hf(qwen3_moe(seed=1, num_layers=4), tmp_path / "policy")
    reference = save_hf(qwen3_moe(seed=2, num_layers=4), tmp_path / "reference")
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in text_pairs(2 * CLI_BATCH, seed=5)))
    runs = {}
    for name, plan in (("chunked", ((1, 2), (2, 1))), ("plain", ((2, 1),))):
        out = tmp_path / name
        for steps, vpp in plan:
            argv = run_argv(model=policy, data=data, out=out, objective="dpo", layout=(1, 2, 2), steps=steps,
                            global_batch=2 * CLI_BATCH, micro_batch=CLI_MICRO)
            argv += ["--ref-model", str(reference), "--ep", "2", "--beta", str(CLI_BETA), "--max-length",
                     str(CLI_MAX_LENGTH), "--no-packing", "--vpp", str(vpp)]
            result = main_in_process(argv, cluster=ray_cluster)
            assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
            if name == "chunked" and steps == 1:  # the ep layout's files of 2 x 2 (virtual) stages
                model_dir = out / "checkpoints" / "step_00000001" / "model"
                files = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*.safetensors"))
                assert files == [f"tp0_pp{p}_ep{e}/model.safetensors" for p in range(4) for e in range(2)], files
        runs[name] = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                      exported_weights(out / "hf"))
    (rows, weights), (plain_rows, plain_weights) = runs["chunked"], runs["plain"]
    assert len(rows) == len(plain_rows) == 2
    for step, (ours, theirs) in enumerate(zip(rows, plain_rows), start=1):
        check_metrics(ours, theirs, names=METRICS, prefix="", what=f"MoE ep 2 --vpp 2 then 1, step {step}", rtol=1e-6)
        for key in (k for k in theirs if k.startswith(("aux_loss", "moe/"))):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6), key
    assert set(weights) == set(plain_weights)
    for name, tensor in plain_weights.items():
        assert_close(weights[name], tensor, what=f"MoE ep 2 weights {name}", rtol=1e-6)
