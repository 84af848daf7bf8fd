"""The backend SDK: what every training backend would otherwise write again, written once.

A backend derives its worker from :class:`TrainingWorkerBase` and writes what is its own: build the
model, logprobs, a train step, checkpoint state I/O and the weight stream (``export_weights``).
The base class brings the colocated memory hand-off (``offload_before_refit``,
``offload_after_refit``, ``prepare_for_training``, with overridable hooks and sensible defaults),
the HF export derived from the weight stream, and the training precision; the modules beside it
bring the reference-weights swap, RNG capture and one-line checkpoint failures. Device discipline
(collectives, batches, offload copies) lives in :mod:`nrl_core.device`, which the SDK uses.
Importing this package imports torch: workers import it, plugin modules (entry points) must not.
"""

from nrl_core.sdk.base import TrainingWorkerBase, training_precision
from nrl_core.sdk.failures import describe_failure, first_failure
from nrl_core.sdk.fingerprint import base_model_identity, weights_fingerprint
from nrl_core.sdk.hf_export import write_hf_export
from nrl_core.sdk.reference import ReferenceWeights, init_reference_model
from nrl_core.sdk.rng import rng_state, set_rng_state

__all__ = ["ReferenceWeights", "TrainingWorkerBase", "base_model_identity", "describe_failure", "first_failure",
           "init_reference_model", "rng_state", "set_rng_state", "training_precision", "weights_fingerprint", "write_hf_export"]
