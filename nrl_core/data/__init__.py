"""Data handling the core owns and every backend reuses: datasets read from local disk, the
arithmetic generator, prompt processors and the resumable prompt dataloader, sequence packing and
dynamic batching."""

from nrl_core.data.arithmetic import ArithmeticConfig, generate_arithmetic, write_arithmetic_splits
from nrl_core.data.collate import prompt_batch, sft_batch
from nrl_core.data.dataloader import PromptDataloader
from nrl_core.data.datasets import load_records, read_jsonl, write_jsonl
from nrl_core.data.dynamic_batching import dynamic_micro_batches
from nrl_core.data.packing import PACKING_ALGORITHMS, PackedRows, pack_bins, pack_sequences
from nrl_core.data.processors import (
    DatumSpec,
    LengthLimits,
    PreparedData,
    PromptConfig,
    get_processor,
    prepare_data,
    process_records,
)
from nrl_core.data.splits import DataSplits, load_data_splits

__all__ = [
    "PACKING_ALGORITHMS",
    "ArithmeticConfig",
    "DataSplits",
    "DatumSpec",
    "LengthLimits",
    "PackedRows",
    "PreparedData",
    "PromptConfig",
    "PromptDataloader",
    "dynamic_micro_batches",
    "generate_arithmetic",
    "get_processor",
    "load_data_splits",
    "load_records",
    "pack_bins",
    "pack_sequences",
    "prepare_data",
    "process_records",
    "prompt_batch",
    "read_jsonl",
    "sft_batch",
    "write_arithmetic_splits",
    "write_jsonl",
]
