"""The tiers' worker processes (tests/helpers/tiers.py): `pytest -m fast` goes on FAST_WORKERS
processes and the whole suite on SUITE_WORKERS, every other run stays as it is; and the heaviest
files go first."""

import pytest

from tests.helpers.tiers import (FAST_WORKERS, SUITE_WORKERS, dearest_files_first, estimated_cost, seconds_per_file,
                                 workers_for)


@pytest.mark.parametrize("markexpr,whole_suite,workers", [("fast", True, FAST_WORKERS), ("", True, SUITE_WORKERS),
                                                          ("not ray", True, SUITE_WORKERS), ("fast", False, FAST_WORKERS)])
def test_the_fast_tier_and_the_whole_suite_run_on_their_workers(markexpr, whole_suite, workers):
    assert workers_for(markexpr=markexpr, whole_suite=whole_suite, numprocesses=None, collect_only=False,
                       in_worker=False) == workers


@pytest.mark.parametrize("markexpr,whole_suite,numprocesses,collect_only,in_worker", [
    ("", False, None, False, False),         # test paths given: one area, or a GPU check, in one process
    ("ray", False, None, False, False),      # so is any selection of them
    ("", True, 0, False, False),             # -n 0: one process
    ("fast", True, 4, False, False),         # -n 4: as given
    ("fast", True, "absent", False, False),  # pytest-xdist not installed
    ("", True, None, True, False),           # --collect-only
    ("", True, None, False, True),           # inside a worker
])
def test_every_other_run_is_left_as_it_is(markexpr, whole_suite, numprocesses, collect_only, in_worker):
    assert workers_for(markexpr=markexpr, whole_suite=whole_suite, numprocesses=numprocesses,
                       collect_only=collect_only, in_worker=in_worker) is None


def test_a_file_is_estimated_by_the_dearest_kind_of_each_test():
    assert estimated_cost([{"cli", "ray"}, {"ranks"}, set()]) == 25.0 + 10.0 + 0.2
    assert estimated_cost([{"slurm"}]) > estimated_cost([{"cli"}, {"cli"}]) > estimated_cost([set()] * 100)


def test_the_dearest_files_go_first_each_in_its_own_order():
    files = ["a.py", "a.py", "b.py", "c.py", "c.py", "c.py"]
    kinds = [set(), set(), {"cli"}, set(), {"ranks"}, set()]
    assert dearest_files_first(files, kinds, {}) == [2, 3, 4, 5, 0, 1]  # b 25, c 10.4, a 0.4 (estimated)
    assert dearest_files_first(files, kinds, {"a.py": 100.0}) == [0, 1, 2, 3, 4, 5]  # a recorded at 100 s
    assert dearest_files_first(["a.py", "b.py"], [set(), set()], {}) == [0, 1]  # equal costs keep their order


def test_seconds_per_file_sum_a_junit_record(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="t1" time="1.5"/><testcase classname="tests.test_b" name="t2" time="4.0"/>
<testcase classname="tests.test_a" name="t3[x]" time="2.0"><skipped/></testcase>
<testcase classname="tests.helpers.other" name="t4" time="9.0"/></testsuite></testsuites>""")
    assert seconds_per_file(xml) == {"test_b.py": 4.0, "test_a.py": 3.5}
    assert list(seconds_per_file(xml)) == ["test_b.py", "test_a.py"]  # dearest first
