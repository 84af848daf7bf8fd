"""Suite-wide settings: quiet, deterministic, CPU-friendly."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Megatron's HF conversions (a child process and a sharded checkpoint each) land in one directory
# per test session, so a tiny model converts once however many tests read it, and nothing is
# written under ~/.cache/huggingface. Tests of the conversion itself set their own directory.
_CONVERSIONS = None
if not os.environ.get("NRL_MEGATRON_CHECKPOINT_DIR", "").strip():
    import tempfile

    _CONVERSIONS = tempfile.mkdtemp(prefix="nrl-test-megatron-conversions-")
    os.environ["NRL_MEGATRON_CHECKPOINT_DIR"] = _CONVERSIONS


def pytest_unconfigure(config):
    if _CONVERSIONS is not None:
        import shutil

        shutil.rmtree(_CONVERSIONS, ignore_errors=True)


# Packages whose session-scoped fixtures are costly runs (evaluation) or engines: their tests share
# one pytest worker under ``-n``, so each fixture is built once. Every other file is its own group,
# so module-scoped fixtures are never rebuilt in a second worker.
_SHARED_SESSION = ("evaluation", "moe", "vllm")


def pytest_collection_modifyitems(config, items):
    """Group the tests for ``--dist loadgroup``; with workers, the groups holding slow tests go
    first, so that the last groups to be handed out are short ones and both workers end together."""
    import pytest

    groups = {}
    for item in items:
        parts = item.nodeid.split("::")[0].split("/")
        group = parts[1] if len(parts) > 2 and parts[1] in _SHARED_SESSION else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        groups[id(item)] = group
    if getattr(config.option, "numprocesses", None):
        slow = {groups[id(item)] for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: groups[id(item)] not in slow)
