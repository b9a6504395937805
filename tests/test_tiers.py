"""The tiers' own rules (tests/helpers/tiers.py): which run gets the fast tier's worker processes."""

import pytest

from tests.helpers.tiers import FAST_TIER_WORKERS, workers_for


def test_the_fast_tier_runs_on_its_workers():
    assert workers_for(markexpr="fast", numprocesses=None, collect_only=False, in_worker=False) == FAST_TIER_WORKERS


@pytest.mark.parametrize("markexpr,numprocesses,collect_only,in_worker", [
    ("", None, False, False),            # the whole suite stays in one process
    ("not ray", None, False, False),     # so does any other selection
    ("fast", 0, False, False),           # -n 0: one process
    ("fast", 4, False, False),           # -n 4: as given
    ("fast", "absent", False, False),    # pytest-xdist not installed
    ("fast", None, True, False),         # --collect-only
    ("fast", None, False, True),         # inside a worker
])
def test_every_other_run_is_left_as_it_is(markexpr, numprocesses, collect_only, in_worker):
    assert workers_for(markexpr=markexpr, numprocesses=numprocesses, collect_only=collect_only,
                       in_worker=in_worker) is None
