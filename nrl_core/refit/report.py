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


def combine_reports(reports: list[RefitReport], *, concurrent: bool = True) -> RefitReport:
    """One report for refits into several engines: bytes add up, the time is the longest refit's
    when they ran at the same time (else the sum)."""
    if len(reports) == 1:
        return reports[0]
    seconds = [r.seconds for r in reports]
    return RefitReport(bytes=sum(r.bytes for r in reports), seconds=max(seconds) if concurrent else sum(seconds),
                       version=max(r.version for r in reports), transport=reports[0].transport,
                       placement=reports[0].placement)
