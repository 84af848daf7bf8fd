"""What one refit did, for logs and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RefitReport:
    """``bytes`` moved (the manifest's total), wall ``seconds`` end to end (export, transport,
    verification, load), the generation side's new weight ``version``, the ``transport`` used and
    the ``placement`` it was chosen for."""

    bytes: int
    seconds: float
    version: int
    transport: str = "in_process"
    placement: str = "same_process"

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")
