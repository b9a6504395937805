"""platform.IntervalClock: what step_time_s and bubble_fraction are measured with."""

import time

import pytest
import torch

from mcore_dpo.parallel import platform as plat


def test_cpu_clock_adds_closed_intervals_only():
    clock = plat.IntervalClock(plat.Platform(device=torch.device("cpu"), backend="gloo"))
    assert clock.total_s() == 0.0
    outside = time.perf_counter()
    clock.start()
    clock.stop()
    first = clock.total_s()
    clock.start()
    clock.stop()
    second = clock.total_s()
    assert 0.0 <= first <= second <= time.perf_counter() - outside
    clock.start()  # an open interval does not count
    time.sleep(0.01)
    assert clock.total_s() == second
    with pytest.raises(RuntimeError, match="without start"):
        plat.IntervalClock(plat.Platform(device=torch.device("cpu"), backend="gloo")).stop()


@pytest.mark.gpu
def test_cuda_clock_counts_device_time_the_host_did_not_wait_for():
    platform = plat.detect()
    plat.activate(platform)
    clock = plat.IntervalClock(platform)
    torch.cuda.synchronize()
    host = time.perf_counter()
    clock.start()
    torch.cuda._sleep(200_000_000)  # the stream is busy; the host returns at once
    clock.stop()
    host = time.perf_counter() - host
    device = clock.total_s()
    assert device > 5 * host and device > 0.01
