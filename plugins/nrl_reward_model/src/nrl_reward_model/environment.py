"""The ``reward_model`` environment (NeMo RL's ``RewardModelEnvironment``): every response's reward is
a trained Bradley-Terry model's score of the prompt and the response.

The reward model runs in a worker group of its own (any training backend that declares
``value_head``, on ``resources``' devices), built from ``env.reward_model`` as a policy-shaped
config and never trained. ``score`` tokenizes each sample with the reward model's tokenizer as
``nrl train rm`` lays out a preference pair (the prompt text, then the response and the
end-of-sequence token) and scores a whole call's samples in one pass over the group, ``batch_size``
sequences per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nrl_core.api import (
    ConfigError,
    DatumSpec,
    EnvResult,
    EnvSample,
    NrlError,
    Policy,
    TokenBatch,
    choose_backends,
    last_token_values,
    prompt_batch,
    renamed_error,
    validate_config,
)

SECTION = "env.reward_model"
BACKEND_KEYS = ("dtensor_cfg", "megatron_cfg", "dynamic_batching", "sequence_packing")


def scorer_config(section: Mapping[str, Any]) -> dict[str, Any]:
    """The reward model as a validated config of its own: ``policy`` from the section's model keys
    (a value head, no generation), ``cluster`` from ``resources``. Errors name ``env.reward_model``."""
    if not section.get("model_name"):
        raise ConfigError(f"{SECTION}.model_name", "is required: the reward model to score with (an HF "
                                                   "*ForSequenceClassification directory, e.g. nrl train rm's export)")
    batch = int(section["batch_size"])
    policy: dict[str, Any] = {
        "model_name": section["model_name"], "tokenizer": {"name": section["tokenizer"]["name"]},
        "precision": section["precision"], "reward_model_cfg": dict(section["reward_model_cfg"]),
        "max_total_sequence_length": int(section["max_model_len"]), "generation": None,
        "train_global_batch_size": batch, "train_micro_batch_size": batch, "logprob_batch_size": batch,
        **{key: dict(section[key]) for key in BACKEND_KEYS if section.get(key) is not None},
    }
    cluster = {"gpus_per_node": int(section["resources"]["gpus_per_node"]),
               "num_nodes": int(section["resources"]["num_nodes"])}
    try:
        return validate_config({"policy": policy, "cluster": cluster})
    except ConfigError as exc:
        if exc.key_path.startswith("cluster."):
            raise ConfigError(f"{SECTION}.resources" + exc.key_path[len("cluster"):], exc.message) from None
        raise renamed_error(exc, SECTION) from None


def score_ids(tokenizer: Any, sample: EnvSample, max_length: int) -> list[int]:
    """What the reward model reads for ``sample``: as ``nrl train rm``'s sequences, the prompt text
    and the response followed by the end-of-sequence token; a longer one keeps its end."""
    ids = list(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
    ids += list(tokenizer(sample.response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids[-max_length:]


def padded_batch(sequences: Sequence[list[int]], pad_id: int, rows: int) -> TokenBatch:
    """Right-padded sequences, with copies of the first up to a multiple of ``rows`` (whole
    micro-batches on every data-parallel rank)."""
    count = len(sequences) + (-len(sequences) % rows)
    sequences = [*sequences, *[sequences[0]] * (count - len(sequences))]
    batch = prompt_batch([DatumSpec(idx=i, prompt_text="", prompt_ids=seq) for i, seq in enumerate(sequences)],
                         pad_id)
    width = int(batch.input_ids.shape[1])
    batch.fields["token_mask"] = (torch.arange(width)[None] < batch.input_lengths[:, None]).float()
    batch.fields["sample_mask"] = torch.ones(count)
    return batch


class RewardModelEnvironment:
    """See the module docstring; built once per run from ``env.reward_model``."""

    def __init__(self, section: Mapping[str, Any]) -> None:
        from transformers import AutoTokenizer

        from nrl_core.api import data_parallel_size

        self.config = scorer_config(section)
        policy = self.config["policy"]
        spec = choose_backends(self.config, generation=False, warn=False).training
        self.max_length = int(policy["max_total_sequence_length"])
        self.rows = int(policy["logprob_batch_size"]) * data_parallel_size(self.config, spec)
        self.tokenizer = AutoTokenizer.from_pretrained(policy["tokenizer"]["name"])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else int(self.tokenizer.eos_token_id)
        self.scorer = Policy(self.config, spec, colocated_generation=False, name="reward_model", standalone=True)
        if section.get("checkpoint_path"):
            self.scorer.load_checkpoint(str(section["checkpoint_path"]))

    def score(self, samples: list[EnvSample]) -> EnvResult:
        if not samples:
            return EnvResult(rewards=[])
        batch = padded_batch([score_ids(self.tokenizer, s, self.max_length) for s in samples], self.pad_id, self.rows)
        scores = last_token_values(self.scorer.get_values(batch), batch.input_lengths)[:len(samples)].tolist()
        if not all(torch.isfinite(torch.tensor(scores))):
            raise NrlError(f"{SECTION}: the reward model gave a non-finite score; check its weights "
                           f"({self.config['policy']['model_name']})")
        return EnvResult(rewards=scores, metrics={"reward_model_score": sum(scores) / len(scores)})

    def shutdown(self) -> None:
        self.scorer.shutdown()
