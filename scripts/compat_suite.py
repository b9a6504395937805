"""Parity layouts for scripts/compat_check.sh: the engine against the single-process Hugging Face
reference at (tp, pp, dp) = (2, 2, 1) and (1, 2, 2), with the jobs and checks of
tests/test_parity.py (tests/helpers/parity.py).

Not collected by the default suite (it lives outside tests/); run it by path:
    python -m pytest -q scripts/compat_suite.py
"""

from __future__ import annotations

import pytest

from tests.helpers.models import write_models
from tests.helpers.parity import FAMILIES, check_job, layout_jobs
from tests.helpers.ranks import run_ranks

COMPAT_LAYOUTS = [(2, 2, 1), (1, 2, 2)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_models")
    return {family: write_models(family, root) for family in FAMILIES}


@pytest.mark.parametrize("layout", COMPAT_LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_parity_compat(layout, models, tmp_path):
    jobs = layout_jobs(layout, models)
    run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs, out_dir=tmp_path)
    for j, job in enumerate(jobs):
        check_job(tmp_path, j, job, layout)
