"""`--vpp N` (virtual pipeline stages) through the command line: what it refuses, each in one
line, before any worker starts (config.py's `_validate_virtual_pipeline` and
`check_virtual_pipeline`; the plans are tests/test_vpp_plan.py's)."""

from __future__ import annotations

import pytest

from mcore_dpo.command_line import resolve
from mcore_dpo.config import ConfigError
from mcore_dpo.driver.defaults import DEFAULT_TRAIN_DATA
from tests.helpers.cli import train_input_error


@pytest.mark.parametrize("argv,expected", [
    (["--vpp", "0"], "vpp: must be a positive integer, got 0"),
    (["--vpp", "2"], "vpp: --vpp 2 needs pipeline parallelism (pp >= 2), got pp 1"),
    (["--vpp", "2", "--pp", "2", "--global-batch-size", "6", "--micro-batch-size", "2"],
     "vpp: the microbatch count per dp rank (3 = global_batch_size 6 / (dp 1 x micro_batch_size 2)) must be a "
     "multiple of pp (2): megatron-core's interleaved 1F1B runs microbatches in groups of pp"),
    (["--vpp", "2", "--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--packing"],
     "packing: cannot serve --vpp 2"),
    (["--vpp", "2", "--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--ref-mode", "separate"],
     "vpp: model chunks are not built with --ref-mode separate yet (use --vpp 1)"),
    (["--vpp", "2", "--pp", "2", "--global-batch-size", "8", "--micro-batch-size", "2", "--lora-rank", "4"],
     "vpp: model chunks are not built with LoRA yet (use --vpp 1)"),
], ids=["zero", "no-pipeline", "microbatches", "packing", "separate", "lora"])
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
