"""Suite-wide settings: quiet, deterministic, CPU-friendly; and how tests spread over pytest-xdist's
workers (docs/testing.md)."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray's log monitor lists its logs directory for new worker logs ten times a second until the
# directory holds a thousand of them; a shared Ray's directory collects hundreds over the suite,
# and each listing matches every name there. With the threshold at 0 it lists every half second
# (LOG_NAME_UPDATE_INTERVAL_S) and still reads the files it knows ten times a second.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every host computes as an AVX2 host does (docs/testing.md, "The float path"): torch's own kernels
# and its float32 random fill (the tiny models' weights), MKL's and oneDNN's code paths. Set here,
# before anything imports torch; Ray's workers and the test's ranks inherit them. vLLM's CPU
# kernels still follow the CPU; the learning tests' margins cover what that moves.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("MKL_CBWR", "AVX2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

#: Each test module's seconds in a run of the whole suite (``scripts/suite_durations.py`` writes it
#: from a JUnit report): the longest groups of tests go to xdist's workers first.
DURATIONS = Path(__file__).with_name("durations.json")
_ROOT = Path(__file__).parent.name


def _conversions_dir(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"nrl-test-megatron-conversions-{run}"


# Megatron's HF conversions (a child process and a sharded checkpoint each) land in one directory
# per test run, shared by its xdist workers (the conversion locks each target), so a tiny model
# converts once however many tests read it, and nothing is written under ~/.cache/huggingface.
# Tests of the conversion itself set their own directory. The process that owns the run removes
# it: the controller under xdist, after every worker has finished.
_OWN_CONVERSIONS: Path | None = None
if not os.environ.get("NRL_MEGATRON_CHECKPOINT_DIR", "").strip() and "PYTEST_XDIST_WORKER" not in os.environ:
    _OWN_CONVERSIONS = Path(tempfile.mkdtemp(prefix="nrl-test-megatron-conversions-"))
    os.environ["NRL_MEGATRON_CHECKPOINT_DIR"] = str(_OWN_CONVERSIONS)


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller names the run (``--testrunuid``) so that it knows the workers' shared
    conversion directory, which it set before they started."""
    if _OWN_CONVERSIONS is not None and config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex
        shutil.rmtree(_OWN_CONVERSIONS, ignore_errors=True)
        shared = _conversions_dir(config.option.testrunuid)
        shared.mkdir(exist_ok=True)
        os.environ["NRL_MEGATRON_CHECKPOINT_DIR"] = str(shared)  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CONVERSIONS is not None:
        shutil.rmtree(os.environ["NRL_MEGATRON_CHECKPOINT_DIR"], ignore_errors=True)


def group_of(item: pytest.Item) -> str | None:
    """The xdist group ``item`` must run in, or None when it can run on any worker by itself: its
    module for a module- or class-scoped fixture, a package for a package- or session-scoped
    fixture of that package's conftest (the evaluation tests' training runs, the vLLM tests'
    engine), so that a fixture broader than one test is built once. The root conftest's fixtures
    are cheap and per process, and tie nothing together."""
    group = None
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        fixture = definitions[-1]
        where = fixture.baseid.split("::")[0]
        if fixture.scope in ("session", "package") and where.startswith(f"{_ROOT}/") and not where.endswith(".py"):
            return where
        if fixture.scope != "function":
            group = item.nodeid.split("::")[0]
    return group


#: Modules whose tests are not marked slow but together take tens of seconds (a Ray cluster, an
#: engine or a conversion of their own): outside the quick tier, which takes their distribution's
#: other unit tests and one short run per algorithm (tests marked ``quick`` by name).
NOT_QUICK = frozenset({
    "tests/core/test_cluster.py",
    "tests/core/test_watchdog_hangs.py",
    "tests/e2e/test_grpo.py",
    "tests/e2e/test_refit_backends.py",
    "tests/examples/test_bad_configs.py",
    "tests/examples/test_configs.py",
    "tests/megatron/test_value_head.py",
    "tests/plugins/test_env_code_hardening.py",
    "tests/plugins/test_env_code_sandbox.py",
    "tests/plugins/test_installed_plugins.py",
})


def in_quick_tier(item: pytest.Item) -> bool:
    """The quick tier (``scripts/test.sh --quick``, ``-m quick``): the tests marked ``quick``, and
    every test not marked ``slow`` outside :data:`NOT_QUICK`."""
    if item.get_closest_marker("quick") is not None:
        return True
    return item.get_closest_marker("slow") is None and item.nodeid.split("::")[0] not in NOT_QUICK


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the quick tier (:func:`in_quick_tier`). In each xdist worker (``--dist loadgroup``):
    mark each test's group (:func:`group_of`), and order the tests longest group first, each
    module's tests in their own order (every worker orders them the same way, as xdist requires);
    with ``NRL_TEST_ORDER_SEED`` set, in an order drawn from that seed instead, to show that no test
    depends on what ran before it."""
    for item in items:
        if in_quick_tier(item):
            item.add_marker(pytest.mark.quick)
    seed = os.environ.get("NRL_TEST_ORDER_SEED", "").strip()
    if not hasattr(config, "workerinput") and not seed:
        return
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    modules = Counter(item.nodeid.split("::")[0] for item in items)
    keys: dict[str, str] = {}
    seconds: Counter[str] = Counter()
    for item in items:
        module = item.nodeid.split("::")[0]
        group = group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        keys[item.nodeid] = group or module
        seconds[keys[item.nodeid]] += durations.get(module, 10.0) / modules[module]
    order = {item.nodeid: i for i, item in enumerate(items)}
    if seed:  # random order: groups, and the tests within each, shuffled alike on every worker
        shuffle = random.Random(seed)
        group_rank = {key: shuffle.random() for key in sorted(set(keys.values()))}
        order = {nodeid: shuffle.random() for nodeid in sorted(order)}
        items.sort(key=lambda item: (group_rank[keys[item.nodeid]], order[item.nodeid]))
        return
    items.sort(key=lambda item: (-seconds[keys[item.nodeid]], keys[item.nodeid], order[item.nodeid]))
