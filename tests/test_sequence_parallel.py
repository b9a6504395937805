"""Sequence parallelism (megatron-core `sequence_parallel`): parity with the single-process
Hugging Face reference at tp 2 and tp 2 x pp 2, through the same harness and tolerance as
test_parity.py; the stage model's shapes; the default and the flag through the real parser."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from parity import free_port, make_pairs, run_ranks, write_models  # noqa: E402
from test_parity import _check_job, _jobs_for  # noqa: E402

from mcore_dpo import platform as plat  # noqa: E402
from mcore_dpo.config import ConfigError, resolve  # noqa: E402
from mcore_dpo.data import collate, padded_seq_len, seq_len_multiple  # noqa: E402

# Untied Llama with GQA and tied Qwen2 with qkv bias; the three colocated reference modes.
KEYS = {(2, 1, 1): [("llama", "interleaved", "sigmoid"), ("qwen2", "sequential", "ipo"),
                    ("qwen2", "precomputed", "sigmoid")],
        (2, 2, 1): [("llama", "interleaved", "sigmoid"), ("qwen2", "interleaved", "ipo")]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_models")
    return {family: write_models(family, root) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("layout", list(KEYS), ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_sequence_parallel_parity(layout, models, tmp_path):
    jobs = [job for job in _jobs_for(layout, models, all_losses=False) if job["key"] in KEYS[layout]]
    assert len(jobs) == len(KEYS[layout])
    for job in jobs:
        job["config"]["sequence_parallel"] = True
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        _check_job(tmp_path, j, job, layout)
