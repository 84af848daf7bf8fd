"""The engine SDK (``nrl_core.engine``): what it plans and what it does around a backend's forward.

A toy backend (an embedding and a linear head: a real causal LM, tiny) writes only the two
primitives; the engine's train, scoring, reference, guard and metrics are checked against the
same computations done by hand. The real backends run the whole conformance kit on top.
"""

from __future__ import annotations

import math

import pytest
import torch

from nrl_core.algorithms.loss import NLLLoss
from nrl_core.contracts import CheckpointOptions, TokenBatch
from nrl_core.engine import ForwardRequest, MicroBatch, TrainingEngine, plan_micro_batches
from nrl_core.engine.state_file import StateFileCheckpoints
from nrl_core.errors import ConfigError, NrlError
from nrl_core.nonfinite import NonFiniteError
from nrl_core.sdk import ReferenceWeights

VOCAB = 11


class ToyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


class ToyEngine(TrainingEngine):
    backend_name = "toy"

    def __init__(self, micro: int, **policy: object) -> None:
        torch.manual_seed(0)
        self.rank, self.device = 0, torch.device("cpu")
        self.policy = {"train_micro_batch_size": micro, "logprob_batch_size": micro, "max_grad_norm": 1.0,
                       "seed": 0, "max_total_sequence_length": 8, "model_name": "toy", **policy}
        self.model = ToyLM()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.reference = ReferenceWeights(self.model.parameters())
        self.forwards: list[list[int]] = []

    def forward(self, mb: MicroBatch, request: ForwardRequest) -> tuple[torch.Tensor, ...]:
        self.forwards.append(list(mb.rows))
        return (token_logprobs(self.model, mb.batch),)


def token_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    ids = batch.input_ids
    lp = torch.log_softmax(model(ids)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    valid = torch.arange(ids.shape[1])[None] < batch.input_lengths[:, None]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1) * valid


def make_batch() -> TokenBatch:
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([8, 3, 6, 2, 7, 5])
    ids = torch.randint(0, VOCAB, (6, 8), generator=g)
    mask = (torch.arange(8)[None] < lengths[:, None]) & (torch.arange(8)[None] >= 1)
    return TokenBatch(input_ids=ids, input_lengths=lengths, fields={"token_mask": mask.float()})


def test_fixed_dynamic_and_packed_plans_cover_every_row_once() -> None:
    batch = make_batch()
    fixed = plan_micro_batches(batch, {"train_micro_batch_size": 4}, train=True)
    assert [mb.rows for mb in fixed] == [[0, 1, 2, 3], [4, 5]] and not any(mb.packed for mb in fixed)
    assert fixed[1].batch.input_ids.shape == (2, 7)  # trimmed to the group's longest
    for key in ("dynamic_batching", "sequence_packing"):
        policy = {key: {"enabled": True, "train_mb_tokens": 12, "logprob_mb_tokens": 16}, "max_total_sequence_length": 8}
        plan = plan_micro_batches(batch, policy, train=True)
        assert sorted(r for mb in plan for r in mb.rows) == list(range(6))
        assert all(mb.packed == (key == "sequence_packing") for mb in plan)
        widths = [len(mb.rows) * max(int(batch.input_lengths[r]) for r in mb.rows) if key == "dynamic_batching"
                  else sum(int(batch.input_lengths[r]) for r in mb.rows) for mb in plan]
        assert max(widths) <= 12, widths
        assert len(plan_micro_batches(batch, policy, train=False)) <= len(plan)  # the larger scoring budget


def test_packing_and_dynamic_batching_together_are_one_line() -> None:
    policy = {"dynamic_batching": {"enabled": True}, "sequence_packing": {"enabled": True}}
    with pytest.raises(ConfigError, match="^policy.sequence_packing.enabled: sequence packing and dynamic batching"):
        plan_micro_batches(make_batch(), policy, train=True)


def test_a_forward_is_asked_for_what_the_loss_reads() -> None:
    class Values:
        reads_values = True

    class Gathered:
        gather_ids_field = "teacher_ids"

    assert ForwardRequest.for_loss(NLLLoss()) == ForwardRequest("logprobs")
    assert ForwardRequest.for_loss(Values()) == ForwardRequest("values") and not ForwardRequest("values").shifted
    assert ForwardRequest.for_loss(Gathered()) == ForwardRequest("gathered", ids_field="teacher_ids")
    with pytest.raises(ValueError, match="forward request kind 'hidden'"):
        ForwardRequest("hidden")


def test_train_equals_one_step_on_the_whole_batch_whatever_the_micro_batches() -> None:
    batch = make_batch()
    by_hand = ToyEngine(6)
    loss, _ = NLLLoss()(token_logprobs(by_hand.model, batch), batch, global_valid_tokens=batch.loss_counts()[0],
                        global_valid_seqs=batch.loss_counts()[1])
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(by_hand.model.parameters(), 1.0))
    by_hand.optimizer.step()
    for micro in (1, 4, 6):
        engine = ToyEngine(micro)
        metrics = engine.train(batch, NLLLoss())
        assert len(engine.forwards) == math.ceil(6 / micro) and engine.step == 1
        assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(norm, abs=1e-6) and metrics["lr"] == 0.5
        assert metrics["num_tokens"] == 31 and metrics["num_valid_tokens"] == 25
        for mine, theirs in zip(engine.model.parameters(), by_hand.model.parameters()):
            assert torch.allclose(mine, theirs, atol=1e-6)


def test_scores_land_in_the_batch_layout_and_the_reference_stays_the_initial_policy() -> None:
    batch = make_batch()
    engine = ToyEngine(4)
    before = engine.get_logprobs(batch)
    assert before.rows == list(range(6)) and before.values.shape == (6, 8)
    assert torch.allclose(before.values, token_logprobs(ToyEngine(6).model, batch).detach())
    engine.train(batch, NLLLoss())
    after = engine.get_logprobs(batch).values
    assert not torch.allclose(after, before.values)
    assert torch.equal(engine.get_reference_logprobs(batch).values, before.values)
    assert torch.equal(engine.get_logprobs(batch).values, after)  # swapped back


def test_a_non_finite_loss_stops_before_the_weights_change() -> None:
    class Diverged(NLLLoss):
        def __call__(self, logprobs, batch, **kw):  # type: ignore[no-untyped-def]
            loss, metrics = super().__call__(logprobs, batch, **kw)
            return loss * float("nan"), metrics

    engine = ToyEngine(4, check_for_nan=True)
    weights = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(NonFiniteError, match="training step 1 \\(toy\\)"):
        engine.train(make_batch(), Diverged())
    assert engine.step == 0 and all(torch.equal(p, w) for p, w in zip(engine.model.parameters(), weights))


def test_a_request_the_forward_does_not_answer_is_one_line() -> None:
    with pytest.raises(NrlError, match=r"^toy worker rank 0: get_topk_logprobs needs topk from the forward, which "
                                       r"returns only logprobs; declare the capability"):
        ToyEngine(4).get_topk_logprobs(make_batch(), 2)


def test_state_file_checkpoints_round_trip_and_refuse_what_does_not_fit(tmp_path) -> None:
    batch = make_batch()
    engine = ToyEngine(4)
    engine.scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    checkpoints = StateFileCheckpoints(engine)
    engine.train(batch, NLLLoss())
    checkpoints.save(str(tmp_path / "a"), CheckpointOptions(async_save=True))
    checkpoints.finalize()
    expected = engine.train(batch, NLLLoss())
    fresh = ToyEngine(4)
    fresh.scheduler = torch.optim.lr_scheduler.StepLR(fresh.optimizer, step_size=1, gamma=0.5)
    StateFileCheckpoints(fresh).load(str(tmp_path / "a"), CheckpointOptions())
    assert fresh.step == 1 and fresh.optimizer.param_groups[0]["lr"] == 0.25  # the schedule resumed too
    assert fresh.train(batch, NLLLoss())["loss"] == expected["loss"]

    other = ToyEngine(4)  # no scheduler: refused before anything changes
    weights = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(NrlError, match="saved with an LR scheduler, but this run has none"):
        StateFileCheckpoints(other).load(str(tmp_path / "a"), CheckpointOptions())
    other.optimizer = torch.optim.SGD([next(other.model.parameters())], lr=0.5)  # another optimizer setup
    other.scheduler = fresh.scheduler
    with pytest.raises(NrlError, match=r"its optimizer has parameter groups of \[3\] tensors, this run's \[1\]"):
        StateFileCheckpoints(other).load(str(tmp_path / "a"), CheckpointOptions())
    assert all(torch.equal(p, w) for p, w in zip(other.model.parameters(), weights)) and other.step == 0


def test_a_failed_asynchronous_save_raises_at_finalize(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    checkpoints = StateFileCheckpoints(ToyEngine(4))
    with pytest.raises(NrlError, match="^checkpoint save failed: (NotADirectoryError|FileExistsError)"):
        checkpoints.save(str(blocker / "a"), CheckpointOptions())  # a synchronous save fails at once
    (tmp_path / "b").mkdir()
    checkpoints.file_name = "missing/state.pt"  # the write itself fails, in the thread
    checkpoints.save(str(tmp_path / "b"), CheckpointOptions(async_save=True))
    with pytest.raises(NrlError, match=r"^checkpoint save failed: \w+: .*missing"):
        checkpoints.finalize()
    checkpoints.finalize()  # reported once
