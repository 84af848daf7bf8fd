"""Registers NeMo RL's named datasets (``data.train.dataset_name``) and its math prompt processors.

Where each dataset loads from, its split and what it reads are NeMo RL's (commit 7ea279a,
``nemo_rl/data/datasets/``); docs/data.md lists them with their columns.
"""

from __future__ import annotations

from nrl_core.api import DataProcessorSpec, DatasetSpec, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

DISTRIBUTION = "nrl-data-nemo-rl"
_FORMATS = "nrl_data_nemo_rl.formats"
_STAND_INS = "nrl_data_nemo_rl.stand_ins"
_AIME = "AIME: the American Invitational Mathematics Examination's problems, answers as integers"


def _dataset(name: str, fmt: str, description: str, **fields: object) -> DatasetSpec:
    return DatasetSpec(name=name, format=f"{_FORMATS}:{fmt}", stand_in=f"{_STAND_INS}:{fmt}", distribution=DISTRIBUTION,
                       description=description, **fields)  # type: ignore[arg-type]


DATASETS = [
    _dataset("OpenMathInstruct-2", "open_math_instruct_2", "NVIDIA's math problems with Llama-3.1-405B's solutions",
             hub="nvidia/OpenMathInstruct-2", split="train_1M", splits=("train", "train_1M", "train_2M", "train_5M"),
             keys=("output_key",), split_validation_size=0.05),
    _dataset("DAPOMath17K", "dapo_math", "DAPO's math prompts with integer answers",
             hub="BytedTsinghua-SIA/DAPO-Math-17k", splits=("train",)),
    _dataset("DAPOMathAIME2024", "dapo_math", "AIME 2024 in DAPO's prompt format, each problem repeated",
             hub="BytedTsinghua-SIA/AIME-2024", splits=("train",)),
    _dataset("AIME2024", "aime", _AIME, hub="HuggingFaceH4/aime_2024", keys=("repeat",)),
    _dataset("AIME2025", "aime", _AIME, hub="opencompass/AIME2025", subsets=("AIME2025-I", "AIME2025-II"),
             split="test", keys=("repeat",)),
    _dataset("AIME2026", "aime", _AIME, hub="MathArena/aime_2026", keys=("repeat",)),
    *(_dataset(name, "gsm8k", "grade-school math word problems", hub="openai/gsm8k", subsets=("main",),
               keys=("subset", "extract_answer")) for name in ("gsm8k", "GSM8K")),
    _dataset("DeepScaler", "problem_and_answer", "DeepScaleR's competition math problems",
             hub="agentica-org/DeepScaleR-Preview-Dataset", splits=("train",)),
    _dataset("OpenR1-Math-220k", "problem_and_answer", "Open R1's math problems with DeepSeek R1's answers",
             hub="open-r1/OpenR1-Math-220k", subsets=("default",), keys=("subset",), split_validation_size=0.0),
    _dataset("squad", "squad", "Stanford's reading-comprehension questions (the passage as the system turn)",
             hub="rajpurkar/squad", splits=("train", "validation")),
    _dataset("tulu3_sft_mixture", "tulu3_sft", "AI2's Tulu 3 SFT conversations", hub="allenai/tulu-3-sft-mixture",
             splits=("train",), keys=("max_samples",), split_validation_size=0.05),
    _dataset("Nemotron-Cascade-2-SFT-Math", "tulu3_sft", "NVIDIA's Nemotron-Cascade 2 math SFT conversations",
             hub="nvidia/Nemotron-Cascade-2-SFT-Data", subsets=("math",), keys=("max_samples",),
             split_validation_size=0.05),
    _dataset("ResponseDataset", "response_dataset", "prompt and answer columns, or chats, from data_path",
             keys=("input_key", "output_key", "subset"), split_validation_size=0.0),
    _dataset("HelpSteer3", "helpsteer3", "NVIDIA's preference pairs rated by people", kind="preference",
             hub="nvidia/HelpSteer3", subsets=("preference",), splits=("train", "validation")),
    _dataset("Tulu3Preference", "tulu3_preference", "AI2's Tulu 3 preference mixture", kind="preference",
             hub="allenai/llama-3.1-tulu-3-8b-preference-mixture", splits=("train",)),
    _dataset("PreferenceDataset", "preference_dataset", "ranked completions (context, completions) from data_path",
             kind="preference", keys=("subset",)),
    _dataset("BinaryPreferenceDataset", "binary_preference", "prompt, chosen and rejected columns from data_path",
             kind="preference", keys=("prompt_key", "chosen_key", "rejected_key", "subset")),
]


@hookimpl
def nrl_datasets() -> list[DatasetSpec]:
    return DATASETS


@hookimpl
def nrl_data_processors() -> list[DataProcessorSpec]:
    hf = "nrl_data_nemo_rl.processors:math_hf_data_processor"
    return [DataProcessorSpec(name=name, processor=hf, distribution=DISTRIBUTION,
                              description="NeMo RL's: system and templated user turn in one chat rendering")
            for name in ("math_hf_data_processor", "default")] + [
        DataProcessorSpec(name="math_data_processor", processor="nrl_data_nemo_rl.processors:math_data_processor",
                          distribution=DISTRIBUTION,
                          description="NeMo RL's: system and templated user turn rendered apart"),
        DataProcessorSpec(name="sft_processor", processor="nrl_data_nemo_rl.processors:sft_processor",
                          distribution=DISTRIBUTION,
                          description="NeMo RL's SFT: a conversation turn by turn, assistant turns in the loss")]
