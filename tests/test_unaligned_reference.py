"""Reference log-probs over data that does not fill whole microbatches, at pp 2: 41 pairs
with micro_batch_size 4 leave every rank a chunk whose last microbatch holds fewer pairs, so the
later stage must size each receive by that microbatch. Both users of the forward-only pass
run: the "ref" worker group of --ref-mode separate (also with ref_dp 2 while the policy's dp
is 1) and the policy group's --ref-mode precomputed table.

The reference side is a single-process Hugging Face forward written here from the definition
(sum of log p(token | prefix) over the completion tokens), not the engine's own functions.

The same Ray session also checks how the driver finds ranks that do not share its output
directory (each rank reads a token file the driver wrote).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.ray_runs import joined

NUM_PAIRS = 41


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, ray_cluster):
    """The driver's preparation of a pp-2 run on 41 pairs; this module's tests are a driver of the
    session's Ray cluster (the default model comes from the session's MCORE_DPO_CACHE)."""
    from mcore_dpo import defaults
    from mcore_dpo.config import TrainConfig
    from mcore_dpo.run import prepare

    root = tmp_path_factory.mktemp("unaligned")
    data = root / "prefs41.jsonl"
    data.write_text("".join(Path(defaults.DEFAULT_TRAIN_DATA).read_text().splitlines(keepends=True)[:NUM_PAIRS]))
    config = TrainConfig(data=str(data), global_batch_size=16, micro_batch_size=4, dp=1, pp=2, ref_mode="separate",
                         ref_pp=2, ref_dp=1, output_dir=str(root / "out"), timeout_s=60)
    prep = prepare(config)
    assert len(prep.train_pairs) == NUM_PAIRS
    with joined(ray_cluster):
        yield prep


def _hf_reference_logps(model_dir: str, pairs) -> torch.Tensor:
    """[pairs, 2]: summed log-probs of the chosen and the rejected completion given the prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    with torch.no_grad():
        for i, pair in enumerate(pairs):
            for column, completion in enumerate((pair.chosen_ids, pair.rejected_ids)):
                ids = torch.tensor([list(pair.prompt_ids) + list(completion)])
                logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
                prompt_len = len(pair.prompt_ids)
                table[i, column] = sum(logp[t - 1, ids[0, t]] for t in range(prompt_len, ids.shape[1]))
    return table


def _start(role: str, factory, prep, *, pp: int, dp: int):
    """A worker group of `factory` ranks at tp 1 (what the driver starts for a role)."""
    from mcore_dpo import ray_workers

    return ray_workers.create_group(
        role=role, world_size=pp * dp, tp=1, pp=pp, dp=dp, factory=factory,
        kwargs_of_rank=lambda rank, addr, port: dict(config=prep.config, spec=prep.spec, pad_token_id=prep.pad_token_id,
                                                     rank=rank, master_addr=addr, master_port=port),
        use_gpus=False, placement_timeout_s=300,
    )  # fmt: skip


def _one(results):
    found = [r for r in results if r is not None]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("ref_dp", [1, 2])
def test_separate_reference_group_at_pp2_on_unaligned_data(prepared, ref_dp):
    from dataclasses import replace

    from mcore_dpo.run import Prepared
    from mcore_dpo.worker import ReferenceWorker

    config = replace(prepared.config, ref_dp=ref_dp)
    prep = Prepared(**{**prepared.__dict__, "config": config})
    group = _start("ref", ReferenceWorker, prep, pp=2, dp=ref_dp)
    try:
        table = _one(group.call("reference_logps", prep.train_pairs, timeout_s=300))
    finally:
        group.stop()
    expected = _hf_reference_logps(config.model, prep.train_pairs)
    assert table.shape == (NUM_PAIRS, 2)
    err = (table.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), err


def test_precomputed_reference_at_pp2_on_unaligned_data(prepared):
    """The policy group's one-off reference pass over 41 pairs (train and held-out) at pp 2.
    Policy and reference start as the same weights, so every reward of an evaluation against
    the precomputed table is zero: a row of the table that belonged to another pair would not be."""
    from dataclasses import replace

    from mcore_dpo.run import Prepared
    from mcore_dpo.worker import PolicyWorker

    config = replace(prepared.config, ref_mode="precomputed")
    prep = Prepared(**{**prepared.__dict__, "config": config})
    group = _start("policy", PolicyWorker, prep, pp=2, dp=1)
    try:
        group.call("precompute_reference", prep.train_pairs, prep.train_pairs, timeout_s=300)
        metrics = _one(group.call("evaluate", prep.train_pairs, timeout_s=300))
    finally:
        group.stop()
    scale = config.beta * max(abs(metrics["eval/logps/chosen"]), abs(metrics["eval/logps/rejected"]))
    for key in ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins"):
        assert abs(metrics[key]) <= 1e-5 * scale, (key, metrics[key], scale)


def test_ranks_read_the_drivers_token_file(prepared, tmp_path):
    from mcore_dpo import ray_workers

    group = ray_workers.create_group(role="probe", world_size=2, tp=1, pp=1, dp=2, factory=dict,
                                     kwargs_of_rank=lambda rank, addr, port: {}, use_gpus=False,
                                     placement_timeout_s=120)
    try:
        token = tmp_path / ".output-dir-token"
        token.write_text("abc\n")
        assert ray_workers.ranks_not_seeing(group, path=str(token), text="abc\n") == []
        # what a rank on a node without this directory reports: another text, or none
        missing = ray_workers.ranks_not_seeing(group, path=str(token), text="xyz\n")
        assert [name for name, _ in missing] == group.names
        assert all(node == group.processes[i]["node_ip"] for i, (_, node) in enumerate(missing))
        assert len(ray_workers.ranks_not_seeing(group, path=str(tmp_path / "absent"), text="abc\n")) == 2
    finally:
        group.stop()
