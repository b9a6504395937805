"""Joining the torch.distributed world (parallel/platform.init_process_group): ranks start
seconds apart, so joining waits for a late rank longer than --timeout-s, which bounds the
collectives once every rank is in (a short --timeout-s must catch a stuck peer, not a rank whose
process started late on a loaded node)."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from mcore_dpo.parallel.ports import free_port
from tests.helpers.ranks import spawn_processes

TIMEOUT_S = 2.0  # the collectives' timeout of the runs below
LATE_S = 5.0  # how much later rank 1 starts joining


def _late_joiner_rank(rank: int, port: int, stuck: bool) -> None:
    from mcore_dpo.parallel import platform as plat

    platform = plat.detect(local_rank=0)
    plat.activate(platform)
    if rank == 1:
        time.sleep(LATE_S)
    start = time.monotonic()
    plat.init_process_group(platform, rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                            timeout_s=TIMEOUT_S)
    assert dist.get_backend() == platform.backend
    if rank == 0:  # waited for rank 1 past the collectives' timeout
        assert time.monotonic() - start >= LATE_S - 1.0
    x = torch.tensor([rank + 1.0])
    dist.all_reduce(x)
    assert x.item() == 3.0
    if stuck:  # joined: now a peer that never answers ends rank 0's wait after TIMEOUT_S
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(RuntimeError):
                dist.recv(torch.empty(1), src=1)
            assert time.monotonic() - start < TIMEOUT_S + 30
            assert dist.distributed_c10d._get_default_store().timeout == datetime.timedelta(seconds=TIMEOUT_S)
        else:
            time.sleep(TIMEOUT_S + 3)
    dist.destroy_process_group()


@pytest.mark.parametrize("stuck", [False, True], ids=["late-rank-joins", "then-a-stuck-peer-times-out"])
def test_a_rank_that_starts_late_joins_and_the_timeout_still_bounds_collectives(stuck):
    spawn_processes(_late_joiner_rank, nprocs=2, args=(free_port(), stuck))
