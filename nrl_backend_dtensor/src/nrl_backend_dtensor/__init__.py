"""nrl-backend-dtensor: the FSDP2/DTensor training backend of nrl (registered as ``dtensor``).

Import :class:`nrl_backend_dtensor.worker.DTensorPolicyWorker` lazily: this package's top level
stays free of torch so listing plugins or checking a config stays cheap.
"""

__version__ = "0.13.0"
