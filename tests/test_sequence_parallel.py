"""Sequence parallelism (megatron-core `sequence_parallel`): the stage model's shapes; the
default and the flag through the real parser. Its parity with the single-process Hugging Face
reference at tp 2 and tp 2 x pp 2 runs in tests/test_parity.py (SEQUENCE_PARALLEL), in the same
launch as those layouts' other jobs."""

from __future__ import annotations

import pytest
import torch

from mcore_dpo.parallel import platform as plat
from mcore_dpo.command_line import resolve
from mcore_dpo.config import ConfigError
from mcore_dpo.data.pairs import collate, padded_seq_len, seq_len_multiple
from tests.helpers.data import make_pairs


def test_flag_through_the_parser_both_polarities(tmp_path):
    base = ["--tp", "2", "--output-dir", str(tmp_path / "o")]
    assert resolve(base)[0].sequence_parallel is None  # unset: the platform decides
    assert resolve(base + ["--sequence-parallel"])[0].sequence_parallel is True
    assert resolve(base + ["--no-sequence-parallel"])[0].sequence_parallel is False
    config_file = tmp_path / "c.yaml"
    config_file.write_text("tp: 2\nsequence_parallel: true\n")
    assert resolve(["--config", str(config_file)])[0].sequence_parallel is True
    assert resolve(["--config", str(config_file), "--no-sequence-parallel"])[0].sequence_parallel is False


def test_flag_needs_tensor_parallelism(capsys, tmp_path):
    from mcore_dpo.train import main

    code = main(["--sequence-parallel", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "sequence_parallel" in err and "tp" in err, err
    with pytest.raises(ConfigError, match="sequence_parallel"):
        resolve(["--sequence-parallel", "--tp", "1"])
    assert resolve(["--no-sequence-parallel", "--tp", "1"])[0].sequence_parallel is False


def test_default_is_on_for_tp_above_1_on_gpus_only():
    gpu = plat.Platform(device=torch.device("cuda", 0), backend="nccl")
    cpu = plat.Platform(device=torch.device("cpu"), backend="gloo")
    assert plat.use_sequence_parallel(gpu, requested=None, tp=2)
    assert not plat.use_sequence_parallel(gpu, requested=None, tp=1)
    assert not plat.use_sequence_parallel(gpu, requested=False, tp=8)
    assert not plat.use_sequence_parallel(cpu, requested=None, tp=2)
    assert plat.use_sequence_parallel(cpu, requested=True, tp=2)
    assert not plat.use_sequence_parallel(cpu, requested=True, tp=1)  # e.g. a tp-1 reference group


def test_sequence_is_padded_to_a_multiple_of_tp():
    assert seq_len_multiple(tp=2, sequence_parallel=True) == 8
    assert seq_len_multiple(tp=3, sequence_parallel=True) == 24
    assert seq_len_multiple(tp=16, sequence_parallel=True) == 16
    assert seq_len_multiple(tp=3, sequence_parallel=False) == 8
    pairs = make_pairs(4, seed=3)
    seq_len = padded_seq_len(pairs, multiple=seq_len_multiple(tp=3, sequence_parallel=True))
    assert seq_len % 24 == 0 and seq_len >= padded_seq_len(pairs)
    # The extra positions are padding: the loss mask is unchanged on the real ones and 0 after.
    short = collate(pairs, pad_token_id=0, seq_len=padded_seq_len(pairs))
    long = collate(pairs, pad_token_id=0, seq_len=seq_len)
    n = short.tokens.shape[1]
    assert torch.equal(long.loss_mask[:, :n], short.loss_mask) and not long.loss_mask[:, n:].any()
    assert torch.equal(long.tokens[:, :n], short.tokens) and not long.tokens[:, n:].any()
