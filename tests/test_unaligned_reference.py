"""Reference log-probs over data that does not fill whole microbatches, at pp 2: 41 pairs
with micro_batch_size 4 leave every rank a chunk whose last microbatch holds fewer pairs, so the
later stage must size each receive by that microbatch. Both users of the forward-only pass
run: the "ref" worker group of --ref-mode separate (also with ref_dp 2 while the policy's dp
is 1) and the policy group's --ref-mode precomputed table.

The reference side is a single-process Hugging Face forward written here from the definition
(sum of log p(token | prefix) over the completion tokens), not the engine's own functions.

The workers run as real gloo ranks (tests/helpers/ranks.py), built as the driver's worker group
builds them. A Ray worker group on the session's cluster checks how the driver finds ranks that
do not share its output directory (each rank reads a token file the driver wrote).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.ray_runs import joined

NUM_PAIRS = 41


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The driver's preparation of a pp-2 run on 41 pairs (the default model comes from the
    session's MCORE_DPO_CACHE)."""
    from mcore_dpo.driver import defaults
    from mcore_dpo.config import TrainConfig
    from mcore_dpo.driver.run import prepare

    root = tmp_path_factory.mktemp("unaligned")
    data = root / "prefs41.jsonl"
    data.write_text("".join(Path(defaults.DEFAULT_TRAIN_DATA).read_text().splitlines(keepends=True)[:NUM_PAIRS]))
    config = TrainConfig(data=str(data), global_batch_size=16, micro_batch_size=4, dp=1, pp=2, ref_mode="separate",
                         ref_pp=2, ref_dp=1, output_dir=str(root / "out"), timeout_s=60)
    prep = prepare(config)
    assert len(list(prep.train_data)) == NUM_PAIRS
    return prep


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


def _worker_rank(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    """One rank of the worker group of `job["role"]` (what the driver starts for a role): the
    reference's table of the pairs, or the policy's precomputed table and an evaluation against
    it; a rank with a result writes it."""
    (job,) = jobs
    try:
        from safetensors.torch import save_file

        from mcore_dpo.rank.worker import PolicyWorker, ReferenceWorker

        factory = {"ref": ReferenceWorker, "policy": PolicyWorker}[job["role"]]
        worker = factory(config=job["config"], spec=job["spec"], pad_token_id=job["pad_token_id"], rank=rank,
                         master_addr="127.0.0.1", master_port=port)
        if job["role"] == "ref":
            table = worker.reference_logps(job["pairs"])
            if table is not None:
                save_file({"table": table.contiguous()}, str(Path(out_dir, f"result_rank{rank}.safetensors")))
        else:
            worker.precompute_reference(job["pairs"], job["pairs"])
            metrics = worker.evaluate(job["pairs"])
            if metrics is not None:
                Path(out_dir, f"result_rank{rank}.json").write_text(json.dumps(metrics))
        worker.shutdown()
    except BaseException:
        Path(out_dir, f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _run_group(role: str, prep, out_dir: Path, *, pp: int, dp: int) -> Path:
    """The group's ranks at tp 1; the one result file (exactly one rank returns a result)."""
    job = {"role": role, "config": prep.config, "spec": prep.spec, "pad_token_id": prep.pad_token_id,
           "pairs": list(prep.train_data)}
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_worker_rank, world_size=pp * dp, jobs=[job], out_dir=out_dir)
    (found,) = sorted(out_dir.glob("result_rank*"))
    return found


@pytest.mark.parametrize("ref_dp", [1, 2])
def test_separate_reference_group_at_pp2_on_unaligned_data(prepared, ref_dp, tmp_path):
    from dataclasses import replace

    from safetensors.torch import load_file

    from mcore_dpo.driver.run import Prepared

    config = replace(prepared.config, ref_dp=ref_dp)
    prep = Prepared(**{**prepared.__dict__, "config": config})
    table = load_file(str(_run_group("ref", prep, tmp_path, pp=2, dp=ref_dp)))["table"]
    expected = _hf_reference_logps(config.model, list(prep.train_data))
    assert table.shape == (NUM_PAIRS, 2)
    err = (table.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), err


def test_precomputed_reference_at_pp2_on_unaligned_data(prepared, tmp_path):
    """The policy group's one-off reference pass over 41 pairs (train and held-out) at pp 2.
    Policy and reference start as the same weights, so every reward of an evaluation against
    the precomputed table is zero: a row of the table that belonged to another pair would not be."""
    from dataclasses import replace

    from mcore_dpo.driver.run import Prepared

    config = replace(prepared.config, ref_mode="precomputed")
    prep = Prepared(**{**prepared.__dict__, "config": config})
    metrics = json.loads(_run_group("policy", prep, tmp_path, pp=2, dp=1).read_text())
    scale = config.beta * max(abs(metrics["eval/logps/chosen"]), abs(metrics["eval/logps/rejected"]))
    for key in ("eval/rewards/chosen", "eval/rewards/rejected", "eval/rewards/margins"):
        assert abs(metrics[key]) <= 1e-5 * scale, (key, metrics[key], scale)


def test_ranks_read_the_drivers_token_file(ray_cluster, tmp_path):
    from mcore_dpo.driver import ray_workers

    with joined(ray_cluster):
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
