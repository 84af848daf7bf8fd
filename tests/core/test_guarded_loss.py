"""A loss plugin's faults at the boundary (``GuardedLoss``), as a training worker meets them: one
line naming the plugin and ``__call__``, with the traceback in ``<log_dir>/faults/``; a wrong
answer named before a backend differentiates it; the core's own losses untouched; and the
wrapper survives the pickling that carries it to the workers with the loss's attributes intact."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from nrl_core.algorithms.guarded_loss import GuardedLoss
from nrl_core.contracts import TokenBatch
from nrl_core.errors import PluginError
from nrl_core.plugin_faults import PluginOwner

OWNER = PluginOwner("loss function", "odd", "nrl-odd", "odd-plugin")
NAMED = "loss function 'odd' of nrl-odd (entry point 'odd-plugin'): OddLoss.__call__ "
BATCH = TokenBatch(input_ids=torch.ones(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 3]))


class OddLoss:
    gather_ids_field = None
    reads_values = False

    def __init__(self, answer: str = "") -> None:
        self.answer = answer

    def __call__(self, logprobs, batch, *, global_valid_tokens, global_valid_seqs):
        if self.answer == "raise":
            raise KeyError("advantages")
        if self.answer == "vector":
            return logprobs.sum(-1), {}
        if self.answer == "bare":
            return logprobs.sum()
        return -logprobs.sum() / global_valid_tokens, {"loss": 1.0}


def call(loss: GuardedLoss) -> object:
    return loss(torch.zeros(2, 3, requires_grad=True), BATCH, global_valid_tokens=6.0, global_valid_seqs=2.0)


def test_a_good_answer_passes_and_the_loss_s_attributes_survive_pickling(tmp_path):
    loss = pickle.loads(pickle.dumps(GuardedLoss(OddLoss(), OWNER, tmp_path)))
    value, metrics = call(loss)
    assert value.ndim == 0 and metrics == {"loss": 1.0}
    assert loss.reads_values is False and loss.gather_ids_field is None and loss.answer == ""
    assert isinstance(loss.plugin_object, OddLoss)


def test_a_raise_is_one_line_naming_the_plugin_with_the_traceback_in_a_file(tmp_path):
    with pytest.raises(PluginError) as caught:
        call(GuardedLoss(OddLoss("raise"), OWNER, tmp_path))
    line = str(caught.value)
    assert line.startswith(NAMED + "raised KeyError: 'advantages'; traceback in ") and "\n" not in line
    trace = tmp_path / "faults" / line.rsplit("/faults/", 1)[1]
    assert "raise KeyError" in trace.read_text()


@pytest.mark.parametrize(("answer", "said"), [
    ("vector", "returned a tensor of shape [2] as its loss; it must be a scalar tensor (0 dimensions)"),
    ("bare", "returned a tensor of shape []; it must return (a scalar loss tensor, a dict of float metrics)"),
])
def test_a_wrong_answer_is_named_before_the_backend_uses_it(answer, said, tmp_path):
    with pytest.raises(PluginError, match=f"^{re.escape(NAMED + said)}$"):
        call(GuardedLoss(OddLoss(answer), OWNER, tmp_path))


def test_the_core_s_own_loss_keeps_its_exception_and_traceback(tmp_path):
    core = PluginOwner("loss function", "odd", "nrl-core", "nrl_core.builtin")
    with pytest.raises(KeyError):
        call(GuardedLoss(OddLoss("raise"), core, tmp_path))
    assert not (tmp_path / "faults").exists()
