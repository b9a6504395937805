"""Shared set-ups of the suite, and the tiers (tests/helpers/tiers.py says how they are assigned).

Session fixtures, built once per pytest run:
    ray_cluster    the local Ray cluster every in-process run joins (tests/helpers/ray_runs.py)
    parity_models  the dense parity models: family -> (policy dir, reference dir)
    moe_models     the MoE parity models: "qwen3_moe" / "mixtral" -> (policy dir, reference dir)
    qwen3_models   Qwen3 dense, tied (True) and untied (False) -> (policy dir, reference dir)
    hf_llama       the converter's Llama with GQA, untied (8 heads in 4 groups, 4 layers, vocab 100)
    trl_parity     what tests/helpers/trl_parity.py's runs read: the parity models, the pairs, the cluster
MCORE_DPO_CACHE points at one directory of the session, so the embedded default model is built
once per run and never in the user's cache.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

from tests.helpers import devices, tiers

# One torch thread per process: the suite spawns many ranks on a 2-core machine. Tokenizers without
# their thread pool, as the trainer's Ray workers run them (and the session's cluster inherits both).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU suite on the CPU, also on a GPU machine; asking whether CUDA is there initialises none
# (tests/helpers/devices.py). A `gpu` test gets the GPU back (`_device_of_the_test`).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ[devices.FORCE_CPU] = "1"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-m fast` on FAST_WORKERS processes and the whole suite on SUITE_WORKERS, a test file per
    worker (tests/helpers/tiers.py)."""
    option = config.option
    workers = tiers.workers_for(markexpr=option.markexpr, whole_suite=config.args_source == pytest.Config.ArgsSource.TESTPATHS,
                                numprocesses=getattr(option, "numprocesses", "absent"),
                                collect_only=option.collectonly, in_worker="PYTEST_XDIST_WORKER" in os.environ)
    if workers is not None:
        option.numprocesses, option.dist = workers, "loadfile"


def pytest_collection_modifyitems(config, items):
    seen: dict = {}
    kept = []
    for item in items:
        kinds = tiers.kinds_of_item(item, seen)
        for kind in sorted(kinds):
            item.add_marker(kind)
        if item.get_closest_marker("in_fast_tier"):
            kept.append(item.nodeid)
        if not kinds or item.get_closest_marker("in_fast_tier"):
            item.add_marker("fast")
    kinds_per_test = [{m.name for m in item.iter_markers() if m.name in tiers.LAUNCH_KINDS} for item in items]
    order = tiers.dearest_files_first([item.path.name for item in items], kinds_per_test, tiers.recorded_seconds())
    items[:] = [items[i] for i in order]
    if len(kept) > tiers.FAST_TIER_LAUNCHES:
        raise pytest.UsageError(f"at most {tiers.FAST_TIER_LAUNCHES} launching tests run in the fast tier "
                                f"(in_fast_tier): {kept}")
    # MCORE_DPO_GPU_CHECKS_ON_CPU=1: the dry run of scripts/gpu_checks.sh --cpu runs them on the CPU.
    if _has_cuda() or os.environ.get("MCORE_DPO_GPU_CHECKS_ON_CPU") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# While a fast-tier test runs (its fixtures' set-up included), process starts are recorded: the test
# reached no launch helper, so it starts them some other way and is in the wrong tier.
_running: dict = {"item": None, "started": []}


def _record(what: str) -> None:
    item = _running["item"]
    if item is not None:
        _running["started"].append(what)


def pytest_configure(config):
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recording_popen_init(self, *args, **kwargs):
        argv = args[0] if args else kwargs.get("args")
        _record(f"subprocess {argv if isinstance(argv, str) else ' '.join(map(str, argv))}"[:200])
        popen_init(self, *args, **kwargs)

    def recording_start(self):
        _record(f"multiprocessing process {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = recording_popen_init
    multiprocessing.process.BaseProcess.start = recording_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    watched = item.get_closest_marker("fast") and not item.get_closest_marker("in_fast_tier")
    _running.update(item=item if watched else None, started=[])
    try:
        return (yield)
    finally:
        _running.update(item=None, started=[])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    _fail_if_started(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    result = yield
    _fail_if_started(item)
    return result


def _fail_if_started(item) -> None:
    started = _running["started"] if _running["item"] is item else []
    if started:
        first, more = started[0], len(started) - 1
        _running["started"] = []
        pytest.fail(f"{item.nodeid} is in the fast tier but started {first}{f' (and {more} more)' if more else ''}: "
                    "start commands, ranks and Ray through tests/helpers (cli.py, ranks.py, ray_runs.py), which tier "
                    "the test (tests/helpers/tiers.py)", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """MCORE_DPO_CACHE for the whole run (module docstring)."""
    previous = os.environ.get("MCORE_DPO_CACHE")
    os.environ["MCORE_DPO_CACHE"] = str(tmp_path_factory.mktemp("mcore_dpo_cache"))
    yield
    if previous is None:
        os.environ.pop("MCORE_DPO_CACHE", None)
    else:
        os.environ["MCORE_DPO_CACHE"] = previous


@pytest.fixture(scope="session")
def ray_cluster():
    from tests.helpers.ray_runs import start_cluster

    cluster = start_cluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def parity_models(tmp_path_factory):
    from tests.helpers.models import write_models
    from tests.helpers.parity import FAMILIES

    root = tmp_path_factory.mktemp("parity_models")
    return {family: write_models(family, root) for family in FAMILIES}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    from tests.helpers.models import MOE_FACTORIES, save_hf

    root = tmp_path_factory.mktemp("moe_models")
    return {name: (save_hf(make(seed=1), root / f"{name}_policy"), save_hf(make(seed=2), root / f"{name}_ref"))
            for name, make in MOE_FACTORIES.items()}


@pytest.fixture(scope="session")
def qwen3_models(tmp_path_factory):
    from tests.helpers.models import qwen3, save_hf

    root = tmp_path_factory.mktemp("qwen3_models")
    return {tied: (save_hf(qwen3(tied=tied, seed=1), root / f"policy_{tied}"),
                   save_hf(qwen3(tied=tied, seed=2), root / f"ref_{tied}"))
            for tied in (True, False)}


@pytest.fixture(scope="session")
def trl_parity(parity_models, moe_models, ray_cluster, tmp_path_factory):
    from tests.helpers.trl_parity import Setup, write_pairs

    data = write_pairs(tmp_path_factory.mktemp("trl_parity"), tokenizer_dir=parity_models["llama"][0], seed=3)
    return Setup(models={**parity_models, **moe_models}, data=data, cluster=ray_cluster)


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    from tests.helpers.models import llama_gqa_untied, save_hf

    return save_hf(llama_gqa_untied(), tmp_path_factory.mktemp("hf_llama") / "llama")


@pytest.fixture(autouse=True)
def _device_of_the_test(request, monkeypatch):
    """MCORE_DPO_FORCE_CPU=1 for the CPU suite, removed for a `gpu` test (tests/helpers/devices.py)."""
    if devices.forces_cpu(gpu_test="gpu" in request.keywords):
        monkeypatch.setenv(devices.FORCE_CPU, "1")
    else:
        monkeypatch.delenv(devices.FORCE_CPU, raising=False)
