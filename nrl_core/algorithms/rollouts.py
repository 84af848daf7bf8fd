"""Turning prompts and generations into the padded ``TokenBatch`` the training backends consume."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nrl_core.contracts import GenerationOutput, TokenBatch


def repeat_prompts(prompts: Sequence[Sequence[int]], times: int) -> list[list[int]]:
    """Each prompt ``times`` times in a row: the group layout advantages expect."""
    return [list(p) for p in prompts for _ in range(times)]


def rollout_batch(prompts: Sequence[Sequence[int]], generation: GenerationOutput, *, pad_token_id: int,
                  max_total_length: int | None = None,
                  loss_masks: Sequence[Sequence[float]] | None = None) -> TokenBatch:
    """Concatenate each prompt with its response into one right-padded row.

    Fields: ``token_mask`` (1 on the response tokens a loss counts: every one, or where
    ``loss_masks`` says so; a multi-turn episode's environment tokens are 0), ``generation_logprobs``
    (the engine's logprob of each response token, aligned with ``input_ids``), and per sequence
    ``truncated`` (1 when the response hit the length limit: the overlong filter's input) and
    ``response_lengths``. Sequences longer than ``max_total_length`` are cut from the end.
    """
    rows = []
    masks = loss_masks if loss_masks is not None else [[1.0] * len(r) for r in generation.token_ids]
    for prompt, response, logprobs, loss_mask in zip(prompts, generation.token_ids, generation.logprobs, masks):
        if not len(response) == len(logprobs) == len(loss_mask):
            raise ValueError(f"a rollout has {len(response)} tokens, {len(logprobs)} logprobs and a loss mask of "
                             f"{len(loss_mask)}")
        tokens = list(prompt) + list(response)
        mask = [0.0] * len(prompt) + [float(m) for m in loss_mask]
        lps = [0.0] * len(prompt) + list(logprobs)
        if max_total_length is not None:
            tokens, mask, lps = tokens[:max_total_length], mask[:max_total_length], lps[:max_total_length]
        rows.append((tokens, mask, lps))
    width = max(len(r[0]) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros(n, width)
    gen_logprobs = torch.zeros(n, width)
    lengths = torch.zeros(n, dtype=torch.long)
    for i, (tokens, mask, lps) in enumerate(rows):
        input_ids[i, : len(tokens)] = torch.tensor(tokens)
        token_mask[i, : len(mask)] = torch.tensor(mask)
        gen_logprobs[i, : len(lps)] = torch.tensor(lps)
        lengths[i] = len(tokens)
    truncated = torch.tensor([1.0 if reason == "length" else 0.0 for reason in generation.finish_reasons])
    return TokenBatch(input_ids=input_ids, input_lengths=lengths, fields={
        "token_mask": token_mask,
        "generation_logprobs": gen_logprobs,
        "truncated": truncated,
        "response_lengths": token_mask.sum(1),
    })

