"""docs/GUIDE.md's layout table is the configs' arithmetic: every row's GB per GPU is recomputed
with mcore_dpo.tools.memory_estimate (tests/helpers/config_arithmetic.py, as tests/test_configs.py
recomputes the config headers), and its "fits" column agrees with 80 GB GPUs."""

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
