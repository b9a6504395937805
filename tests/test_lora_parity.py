"""LoRA parity: the parallel engine's LoRA DPO against Hugging Face + PEFT in one process.

Adapters on all four targets (q/k/v, o, gate/up, down), two steps, (tp, pp, dp) = (1,1,1),
(2,2,1), (1,2,2). Two starts per layout:
- a fresh adapter (PEFT's init: A Kaiming-uniform, B zero); the reference is PEFT's
  `disable_adapter()`. Step 1 moves B off zero, so step 2 is a real test of A's gradients.
- a non-zero PEFT adapter (--init-adapter); the reference is a frozen copy of it (TRL 1.16),
  which step 2 compares where policy != reference.
Compared within RTOL: every metric of both steps, every adapter gradient of both steps (every
rank's piece), the merged weights after step 2 against PEFT's `merge_and_unload()`, and the
eval metrics over held-out pairs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.peft_adapter import adapter_config, adapter_entries, initial_adapter, write_adapter_dir
from tests.helpers.data import make_pairs
from tests.helpers.lora_parity import (EVAL_PAIRS, GLOBAL_BATCH, SHAPE, STEPS, check_lora_job, lora_job, peft_model,
                                       peft_reference, random_adapter, saved_name)
from tests.helpers.models import make_model, save_hf, write_models
from tests.helpers.ranks import run_ranks

LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parity")
    found = {"pairs": make_pairs(STEPS * GLOBAL_BATCH + EVAL_PAIRS, seed=11)}
    for family in ("llama", "qwen2"):  # qwen2: q/k/v biases and tied embeddings (frozen under LoRA)
        base, _ = write_models(family, root)
        spec = open_hf_dir(base).spec
        init_dir = root / f"{family}_init_adapter"
        write_adapter_dir(init_dir, random_adapter(spec, SHAPE, seed=5), adapter_config(SHAPE, spec=spec, dropout=0.0, base_model=None))
        found[family] = {"base": base, "spec": spec, "init_dir": init_dir}
    return found


def _jobs(layout, setup) -> list[dict]:
    jobs = []
    # (1,1,1) also runs the sequential reference slot; (2,2,1) Qwen2 (q/k/v biases, tied embeddings).
    # The replicated optimizer (--no-distributed-optimizer) is covered by tests/test_lora_cli.py.
    # (1,2,2) also runs --prefix-sharing: the reference as the adapter-off view over shared rows.
    variants = [("llama", "fresh", "interleaved", True, False), ("llama", "init", "interleaved", True, False)]
    variants += [("llama", "init", "sequential", True, False)] if layout == (1, 1, 1) else []
    variants += [("qwen2", "init", "interleaved", True, False)] if layout == (2, 2, 1) else []
    variants += [("llama", "fresh", "interleaved", True, True)] if layout == (1, 2, 2) else []
    for family, start, mode, sharded, shared in variants:
        jobs.append(lora_job(layout, key=(family, start, mode, sharded, shared), base_dir=setup[family]["base"],
                             init_dir=setup[family]["init_dir"] if start == "init" else None, pairs=setup["pairs"],
                             ref_mode=mode, distributed_optimizer=sharded, prefix_sharing=shared))
    return jobs


_REFERENCES: dict = {}


def _reference(setup, family: str, start: str) -> dict:
    if (family, start) not in _REFERENCES:
        model = setup[family]
        _REFERENCES[(family, start)] = peft_reference(base_dir=model["base"], spec=model["spec"],
                                                      init_dir=model["init_dir"] if start == "init" else None,
                                                      pairs=setup["pairs"])
    return _REFERENCES[(family, start)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_lora_parity_with_peft(layout, setup, tmp_path):
    tp, pp, dp = layout
    jobs = _jobs(layout, setup)
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        family, start = job["key"][:2]
        check_lora_job(tmp_path, j, job, layout, ref=_reference(setup, family, start), spec=setup[family]["spec"],
                       what=f"{job['key']} at tp{tp} pp{pp} dp{dp}")


def test_adapter_names_cover_every_peft_module():
    """The key map names PEFT's own parameters: a PEFT model on the same base has exactly them."""
    import tempfile

    spec_entries = None
    with tempfile.TemporaryDirectory() as d:
        base = save_hf(make_model("llama", seed=1), Path(d) / "m")
        spec = open_hf_dir(base).spec
        model = peft_model(base, initial_adapter(spec, SHAPE, seed=0), SHAPE)
        spec_entries = {peft for _, peft, _, _, _ in adapter_entries(spec, SHAPE, pp=1, pp_rank=0)}
        assert spec_entries == {saved_name(n) for n, p in model.named_parameters() if p.requires_grad}


def test_lora_parity_with_model_chunks(setup, tmp_path):
    """(1, 2, 1) with --vpp 2: the adapters of both chunks of each rank, the adapter-off (fresh)
    and frozen-copy (--init-adapter) reference views chunk by chunk, the tied Qwen2 too."""
    tp, pp, dp = layout = (1, 2, 1)
    jobs = [lora_job(layout, key=(family, start), base_dir=setup[family]["base"],
                     init_dir=setup[family]["init_dir"] if start == "init" else None, pairs=setup["pairs"], vpp=2)
            for family, start in (("llama", "fresh"), ("llama", "init"), ("qwen2", "init"))]
    run_ranks(world_size=tp * pp * dp, jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        family, start = job["key"]
        check_lora_job(tmp_path, j, job, layout, ref=_reference(setup, family, start), spec=setup[family]["spec"],
                       what=f"{job['key']} --vpp 2 at tp{tp} pp{pp} dp{dp}", vpp=2)
