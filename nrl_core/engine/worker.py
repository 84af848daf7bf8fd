"""``TrainingEngine``: a training worker written as engine primitives, in the spirit of verl's engines.

A backend writes what only it knows: build the model and optimizer, ``forward`` over one
micro-batch returning the outputs a :class:`ForwardRequest` asks for, and (when plain
``torch.optim`` over ``self.model`` is not it) ``optimizer_step``. This class writes the rest of
:class:`nrl_core.contracts.TrainingWorker` once for every backend: the data-parallel shard, the
micro-batches, the loss with its global normalisers, metric sums reduced over ranks, the non-finite
guard, the reference swap, and every scoring variant (logprobs, reference logprobs, top-k, gathered,
values). A backend whose schedule interleaves micro-batches (pipeline parallelism) overrides
:meth:`run_micro_batches` and still calls the ``consume`` it is given once per micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from nrl_core.contracts import BatchShard, LossFunction, TokenBatch, TopkShard, WeightSpec
from nrl_core.device import all_reduce_values, check_batch_device, to_device
from nrl_core.engine.micro_batches import ForwardRequest, MicroBatch, plan_micro_batches
from nrl_core.errors import NrlError
from nrl_core.nonfinite import check_finite, guard_enabled
from nrl_core.sdk.base import TrainingWorkerBase

#: The contract method that asks for each kind of output, for one-line refusals.
SCORING_METHODS = {"logprobs": "get_logprobs", "values": "get_values", "topk": "get_topk_logprobs",
                   "gathered": "get_gathered_logprobs"}

#: ``consume(micro_batch, outputs)``: the SDK's use of one forward's outputs; returns the loss to
#: back-propagate while training (None while scoring).
Consume = Callable[[MicroBatch, tuple[torch.Tensor, ...]], torch.Tensor | None]


class TrainingEngine(TrainingWorkerBase):
    """See the module docstring. Besides :class:`TrainingWorkerBase`'s attributes a subclass sets
    ``dp_rank``, ``dp_size`` and ``dp_group`` when it shards data, and ``reference`` (a
    :class:`~nrl_core.sdk.ReferenceWeights`) when it has a reference policy."""

    #: The kinds of :class:`ForwardRequest` this backend's ``forward`` answers (``topk`` and
    #: ``gathered`` with the ``topk_logprobs`` capability, ``values`` with ``value_head``).
    forward_outputs: frozenset[str] = frozenset({"logprobs"})
    dp_rank = 0
    dp_size = 1
    dp_group: Any = None
    step = 0  # optimizer steps taken (checkpoints save it)
    reference: Any = None
    scheduler: Any = None

    # ------------------------------------------------------------------ primitives a backend writes

    def forward(self, mb: MicroBatch, request: ForwardRequest) -> tuple[torch.Tensor, ...]:
        """The model on ``mb`` (``mb.inputs`` when :meth:`lay_out` set it), with gradients when
        ``mb.train``; returns what ``request`` names, aligned with ``mb.batch``."""
        raise NotImplementedError(f"{type(self).__name__} writes forward() or run_micro_batches()")

    def optimizer_step(self, check: Callable[[float], None]) -> dict[str, float]:
        """Clip, call ``check(grad_norm)`` (which raises to stop the step), step the optimizer and
        the scheduler; returns ``grad_norm`` (before clipping), ``lr`` and anything else measured.
        This default is plain ``torch.optim`` over the trainable parameters of ``self.model``."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.policy.get("max_grad_norm")
        norm = float(torch.nn.utils.clip_grad_norm_(params, float(max_norm) if max_norm else float("inf")))
        check(norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return {"grad_norm": norm, "lr": lr}

    # ------------------------------------------------------------------ hooks with defaults

    def lay_out(self, mbs: list[MicroBatch]) -> None:
        """Set each micro-batch's ``inputs`` (padding, packing) before the step runs them."""

    def run_micro_batches(self, mbs: list[MicroBatch], request: ForwardRequest, consume: Consume) -> None:
        """Forward each micro-batch, hand its outputs to ``consume`` and, while training,
        back-propagate the loss it returns."""
        for i, mb in enumerate(mbs):
            loss = consume(mb, self.forward(mb, request))
            if loss is not None:
                self.backward(loss, last=i == len(mbs) - 1)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """``loss`` is this micro-batch's share of the global loss: gradients summed over
        micro-batches and data-parallel ranks are the global batch's. A backend whose gradient
        reduction averages over ranks scales it here."""
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_mode(self, train: bool) -> None:
        """Training (dropout) or evaluation mode."""
        self.model.train(train)

    def after_scoring(self) -> None:
        """After a scoring pass (FSDP puts its shards back here)."""

    def reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Per-rank metric sums → global sums (every rank returns the same)."""
        if self.dp_size == 1:
            return sums
        keys = sorted(sums)
        return dict(zip(keys, all_reduce_values([sums[k] for k in keys], group=self.dp_group)))

    def step_metrics(self, micro_batches: int) -> dict[str, float]:
        """Metrics of the step the backend measures itself (MoE router balance, ...)."""
        return {}

    def reference_policy(self) -> AbstractContextManager[Any]:
        """Within it the model computes the reference policy (the initial weights swapped in)."""
        if self.reference is None:
            raise self.no_reference_policy()
        return self.reference.swapped_in()

    def no_reference_policy(self) -> NrlError:
        """The one-line error of a reference pass on a worker that keeps no reference weights."""
        return NrlError(f"{self.backend_name} worker rank {self.rank}: this model keeps no reference policy (a "
                        "value model, or a run whose algorithm never asks for reference logprobs: "
                        "AlgorithmSpec.reference_policy)")

    def require_output(self, request: ForwardRequest, what: str) -> ForwardRequest:
        """Refuse in one line a request this backend's forward does not answer."""
        if request.kind not in self.forward_outputs:
            raise NrlError(f"{self.backend_name} worker rank {self.rank}: {what} needs {request.kind} from the "
                           f"forward, which returns only {', '.join(sorted(self.forward_outputs))}; declare the "
                           "capability only for outputs the forward returns")
        return request

    @property
    def reports_results(self) -> bool:
        """Whether this rank returns its data-parallel group's scores (one rank per group does)."""
        return True

    def plan(self, local: TokenBatch, *, train: bool) -> list[MicroBatch]:
        mbs = plan_micro_batches(local, self.policy, train=train, seed=int(self.policy.get("seed") or 0) + self.step)
        self.lay_out(mbs)
        return mbs

    def local_batch(self, batch: TokenBatch) -> TokenBatch:
        if batch.size % self.dp_size:
            raise NrlError(f"a batch of {batch.size} sequences does not divide over {self.dp_size} data-parallel "
                           f"ranks; make the global batch a multiple of {self.dp_size}")
        return batch.shard(self.dp_rank, self.dp_size) if self.dp_size > 1 else batch

    # ------------------------------------------------------------------ the contract, written once

    def train(self, batch: TokenBatch, loss_fn: LossFunction) -> dict[str, float]:
        """One optimizer step on the global ``batch``: metrics summed over micro-batches and ranks."""
        self.require_on_device("train")
        self.require_loss_fits(loss_fn)
        start = time.perf_counter()
        tokens, seqs = batch.loss_counts()  # every rank holds the global batch: global normalisers
        mbs = self.plan(self.local_batch(batch), train=True)
        sums: dict[str, float] = {}

        def consume(mb: MicroBatch, outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            rows = to_device(mb.batch, outputs[0].device)  # what the loss reads, where the outputs are
            check_batch_device(rows, outputs[0].device, f"{self.backend_name} train")
            loss, metrics = loss_fn(outputs[0], rows, global_valid_tokens=tokens, global_valid_seqs=seqs)
            if mb.padding:
                return loss * 0.0
            for key, value in {**metrics, "loss": loss.detach()}.items():  # they add up over micro-batches
                sums[key] = sums.get(key, 0.0) + float(value)
            return loss

        request = self.require_output(ForwardRequest.for_loss(loss_fn), "train")
        self.set_mode(True)
        self.zero_grad()
        self.run_micro_batches(mbs, request, consume)
        metrics = self.reduce_metrics(sums)

        def check(grad_norm: float) -> None:
            if guard_enabled(self.policy):  # both are global: every rank raises together
                check_finite(self.step + 1, {"loss": metrics.get("loss", 0.0), "grad_norm": grad_norm},
                             backend=self.backend_name)

        metrics.update(self.optimizer_step(check))
        self.step += 1
        metrics.update(self.step_metrics(len(mbs)))
        metrics.update(num_tokens=float(batch.input_lengths.sum()), num_valid_tokens=tokens,
                       step_seconds=self.slowest(time.perf_counter() - start))
        return metrics

    @staticmethod
    def slowest(seconds: float) -> float:
        """The slowest rank's time: what the step cost. As the step's last collective it also ends
        the step together on every rank, so no rank returns while a peer is still updating."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return seconds
        return all_reduce_values([seconds], op=dist.ReduceOp.MAX)[0]

    @torch.no_grad()
    def get_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        self.require_lm_head("get_logprobs")
        return self._shard(self.score(batch, ForwardRequest("logprobs")))

    @torch.no_grad()
    def get_reference_logprobs(self, batch: TokenBatch) -> BatchShard | None:
        self.require_lm_head("get_reference_logprobs")
        self.require_on_device("get_reference_logprobs")
        with self.reference_policy():
            return self._shard(self.score(batch, ForwardRequest("logprobs")))

    @torch.no_grad()
    def get_gathered_logprobs(self, batch: TokenBatch, ids_field: str) -> BatchShard | None:
        self.require_lm_head("get_gathered_logprobs")
        return self._shard(self.score(batch, ForwardRequest("gathered", ids_field=ids_field)))

    @torch.no_grad()
    def get_topk_logprobs(self, batch: TokenBatch, k: int) -> TopkShard | None:
        self.require_lm_head("get_topk_logprobs")
        out = self.score(batch, ForwardRequest("topk", k=k))
        return None if out is None else TopkShard(rows=out[0], logprobs=out[1].float(), ids=out[2].long())

    @torch.no_grad()
    def get_values(self, batch: TokenBatch) -> BatchShard | None:
        self.require_value_head("get_values")
        return self._shard(self.score(batch, ForwardRequest("values")))

    @staticmethod
    def _shard(out: tuple[Any, ...] | None) -> BatchShard | None:
        return None if out is None else BatchShard(rows=out[0], values=out[1].float())

    def score(self, batch: TokenBatch, request: ForwardRequest) -> tuple[Any, ...] | None:
        """``request``'s outputs over this rank's shard in the batch's padded layout, as
        ``(rows, *outputs)`` on the rank that reports them, else None."""
        self.require_on_device(SCORING_METHODS[request.kind])
        self.require_output(request, SCORING_METHODS[request.kind])
        local = self.local_batch(batch)
        width = int(batch.input_ids.shape[1])
        outs: list[torch.Tensor] = []

        def consume(mb: MicroBatch, outputs: tuple[torch.Tensor, ...]) -> None:
            if mb.padding or not self.reports_results:
                return
            parts = [part.detach().cpu() for part in outputs]
            if not outs:
                outs.extend(torch.zeros((local.size, width, *p.shape[2:]), dtype=p.dtype) for p in parts)
            for out, part in zip(outs, parts):
                out[mb.rows, :part.shape[1]] = part

        self.set_mode(False)
        self.run_micro_batches(self.plan(local, train=False), request, consume)
        self.after_scoring()
        if not self.reports_results:
            return None
        return (batch.shard_rows(self.dp_rank, self.dp_size), *(outs or [torch.zeros((0, width))]))

    # ------------------------------------------------------------------ weights out (a plain HF model)

    def weight_manifest(self, dtype: str) -> list[WeightSpec]:
        from nrl_core.refit.hf_source import HFWeightSource

        return HFWeightSource(self.model).weight_manifest(dtype)

    def export_weights(self, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
        from nrl_core.refit.hf_source import HFWeightSource

        return HFWeightSource(self.model).export_weights(bucket_bytes, dtype)
