"""Weight refit: moving a training backend's weights into a generation engine.

The pieces, each small and engine-free (no vLLM, no training backend is imported here):

* :mod:`~nrl_core.refit.buckets`: cut a stream of named tensors into size-bounded buckets and
  describe it as a manifest of :class:`~nrl_core.contracts.WeightSpec`.
* :mod:`~nrl_core.refit.manifest`: prove that what arrived is exactly what the manifest promised.
* :mod:`~nrl_core.refit.transports`: how a bucket crosses from the training side to the generation
  side (by reference, through shared memory, or a ``torch.distributed`` broadcast).
* :mod:`~nrl_core.refit.endpoints`: the actor-side halves of a refit between Ray actors.
* :mod:`~nrl_core.refit.hf_source`: a plain Hugging Face model as a weight source.

The driver's side, which wires a source, a transport and a sink over worker groups, sits above
the cluster: :mod:`nrl_core.algorithms.refit_orchestrator`.
"""

from nrl_core.refit.buckets import DEFAULT_BUCKET_BYTES, iter_buckets, manifest_of
from nrl_core.refit.manifest import RefitError, verify
from nrl_core.refit.report import RefitReport

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RefitError",
    "RefitReport",
    "iter_buckets",
    "manifest_of",
    "verify",
]
