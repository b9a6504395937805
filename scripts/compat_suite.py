"""Parity layouts for scripts/compat_check.sh: the engine against the single-process Hugging Face
reference at (tp, pp, dp) = (2, 2, 1) and (1, 2, 2), with the checks of tests/test_parity.py.

Not collected by the default suite (it lives outside tests/); run it by path:
    python -m pytest -q scripts/compat_suite.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_parity import models  # noqa: E402,F401  (module-scoped fixture: the tiny HF models)
from test_parity import test_parity as _parity  # noqa: E402

COMPAT_LAYOUTS = [(2, 2, 1), (1, 2, 2)]


@pytest.mark.parametrize("layout", COMPAT_LAYOUTS, ids=lambda l: f"tp{l[0]}-pp{l[1]}-dp{l[2]}")
def test_parity_compat(layout, models, tmp_path):  # noqa: F811
    _parity(layout, models, tmp_path)
