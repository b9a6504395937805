"""Token stores built on worker processes (data/tokenize.py's spawned pool): the only way tests
build one with workers > 1, so that tests/helpers/tiers.py tiers them."""

from __future__ import annotations

from tests.helpers.tiers import launches


@launches("ranks")
def build_with_workers(sources, *, workers: int = 2, **kwargs):
    """mcore_dpo.data.store.open_or_build on `workers` spawned tokenizer processes."""
    from mcore_dpo.data.store import open_or_build

    return open_or_build(sources, workers=workers, **kwargs)


@launches("ranks")
def prepare_run(config, **kwargs):
    """mcore_dpo.driver.run.prepare, whose token store may be built on spawned tokenizer processes
    (--data-workers)."""
    from mcore_dpo.driver.run import prepare

    return prepare(config, **kwargs)
