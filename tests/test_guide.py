"""docs/GUIDE.md's layout table is the configs' arithmetic: every row's GB per GPU is recomputed
with mcore_dpo.tools.memory_estimate (tests/helpers/config_arithmetic.py, as tests/test_configs.py
recomputes the config headers), and its "fits" column agrees with 80 GB GPUs; so is the activation
recompute section's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mcore_dpo.config import TrainConfig
from tests.helpers.config_arithmetic import CONFIG_DIR, header_values, key_values, memory_gb_per_gpu

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "GUIDE.md"
CONFIG_OF = {"Llama-3-8B": "llama3_8b.yaml", "Llama-3-70B": "llama3_70b.yaml"}
ROW = re.compile(r"^\| (Llama-3-\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \| (.+) \|$", re.M)


def _rows() -> list[tuple]:
    return ROW.findall(GUIDE.read_text(encoding="utf-8"))


def test_the_table_covers_8b_and_70b():
    models = {row[0] for row in _rows()}
    assert models == set(CONFIG_OF) and len(_rows()) >= 6


@pytest.mark.parametrize("row", _rows(), ids=lambda r: "-".join(r[:5]))
def test_every_row_is_the_arithmetic(row):
    model, tp, pp, dp, micro_batch, gb, fits = row
    arch = key_values(header_values(CONFIG_DIR / CONFIG_OF[model])["arch"])
    config = TrainConfig(tp=int(tp), pp=int(pp), dp=int(dp), micro_batch_size=int(micro_batch),
                         global_batch_size=64, max_length=2048)
    computed = memory_gb_per_gpu(arch=arch, config=config, attention="flash")
    assert computed == pytest.approx(float(gb), abs=0.05)
    on_one_node = int(tp) * int(pp) * int(dp) <= 8
    assert fits.startswith("yes") == (computed < 80 and on_one_node)


RECOMPUTE_ROW = re.compile(r"^\| (none|selective|full)(?:, `--recompute-num-layers (\d+)`)? \| ([\d.]+) \| ([\d.]+) \|$", re.M)


def test_the_recompute_table_is_the_arithmetic():
    """The activation recompute section's GB per GPU: configs/llama3_8b.yaml's layout under each
    --recompute, with flash attention and with the local layer spec."""
    import dataclasses

    from mcore_dpo.command_line import load_yaml

    rows = RECOMPUTE_ROW.findall(GUIDE.read_text(encoding="utf-8"))
    assert {row[0] for row in rows} == {"none", "selective", "full"}, rows
    path = CONFIG_DIR / CONFIG_OF["Llama-3-8B"]
    arch = key_values(header_values(path)["arch"])
    values = {k: v for k, v in load_yaml(str(path)).items() if k not in ("model", "ref_model", "data", "eval_data")}
    for recompute, group, flash, local in rows:
        config = dataclasses.replace(TrainConfig(**values), recompute=recompute,
                                     recompute_num_layers=int(group) if group else None)
        for attention, stated in (("flash", flash), ("local", local)):
            computed = memory_gb_per_gpu(arch=arch, config=config, attention=attention)
            assert computed == pytest.approx(float(stated), abs=0.05), (recompute, group, attention)
