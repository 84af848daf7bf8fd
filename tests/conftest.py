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
