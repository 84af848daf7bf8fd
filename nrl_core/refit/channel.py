"""A same-node channel of refit handles: the exporting actor publishes each bucket's handle the
moment it is written, so the generation actors load bucket k while bucket k+1 is exported.

Between two Ray actors a handle would otherwise travel with the export's return value, once the
whole model is written. The channel is a directory of small files under ``/dev/shm``: the header
(the prepared session and the manifest), then one file per handle, each written under a temporary
name and renamed into place (a rename is atomic, so a reader sees a whole file or none), then an
end or an error marker. Readers poll; any number of them read the same channel. The refit's
cleanup removes it with the transport's files (:func:`remove_channel`).
"""

from __future__ import annotations

import glob
import os
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nrl_core.refit.manifest import RefitError

_FIRST_POLL_S = 0.0001
_MAX_POLL_S = 0.002  # a wait grows to this: the next chunk is a copy away, the other core is the exporter's
_LIVENESS_EVERY_S = 0.01


@dataclass(frozen=True)
class ChannelAddress:
    """Where a channel lives; picklable, created by the orchestrator."""

    session_id: str
    directory: str | None = None  # None: channel_directory() where it is read (one node, one answer)

    @property
    def prefix(self) -> str:
        return os.path.join(self.directory or channel_directory(), f"nrl-refit-{self.session_id}-chan-")


def channel_directory() -> str:
    """``/dev/shm`` where it is writable (the same answer on every process of a node)."""
    from nrl_core.refit.shm_space import shm_dir

    return shm_dir()


def remove_channel(address: ChannelAddress) -> None:
    _remove_files(address.prefix)


def _remove_files(prefix: str) -> None:
    for path in glob.glob(prefix + "*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ChannelWriter:
    """The exporting side: :meth:`header`, then :meth:`put` per handle, then :meth:`close` (or
    :meth:`fail` with the error that ended the export)."""

    def __init__(self, address: ChannelAddress) -> None:
        self._prefix = address.prefix
        self._count = 0

    def _publish(self, name: str, value: Any) -> None:
        path = self._prefix + name
        with open(path + ".tmp", "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.rename(path + ".tmp", path)

    def header(self, session: Any, manifest: list[Any]) -> None:
        self._publish("header", (session, manifest))

    def put(self, handle: Any) -> None:
        self._publish(f"h{self._count:06d}", handle)
        self._count += 1

    def close(self) -> None:
        self._publish("end", self._count)

    def fail(self, error: BaseException) -> None:
        self._publish("error", f"{type(error).__name__}: {error}")


class ChannelReader:
    """The importing side. ``exporter_done`` (optional) says whether the export call has returned:
    a sender that died without writing its end marker then ends the wait at once, rather than
    at ``timeout_s``."""

    def __init__(self, address: ChannelAddress, timeout_s: float = 600.0,
                 exporter_done: Callable[[], bool] | None = None) -> None:
        self._prefix = address.prefix
        self._timeout_s = timeout_s
        self._exporter_done = exporter_done

    def _read(self, name: str) -> Any:
        try:
            with open(self._prefix + name, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            raise RefitError("refit failed: its channel was removed while this side read it (the exporting side "
                             "is gone)") from None

    def _wait_for(self, name: str) -> Any:
        """The value of ``name`` once published; raises the sender's error, or at its end marker
        (``None`` then), or when the sender is gone or the wait times out."""
        deadline = time.monotonic() + self._timeout_s
        next_liveness = time.monotonic() + _LIVENESS_EVERY_S
        poll = _FIRST_POLL_S
        while True:
            if os.path.exists(self._prefix + name):
                return self._read(name)
            if os.path.exists(self._prefix + "error"):
                raise RefitError(f"refit failed: the exporting side raised {self._read('error')}")
            if name != "header" and os.path.exists(self._prefix + "end"):
                if os.path.exists(self._prefix + name):  # published between the two checks
                    return self._read(name)
                return None
            now = time.monotonic()
            if now > deadline:
                raise RefitError(f"refit failed: no weights from the exporting side in {self._timeout_s:.0f} s "
                                 f"(waiting for {os.path.basename(self._prefix + name)})")
            if self._exporter_done is not None and now > next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                if self._exporter_done() and not any(os.path.exists(self._prefix + n) for n in (name, "end", "error")):
                    _remove_files(self._prefix)  # nobody else will: the exporter's cleanup goes with its process
                    raise RefitError("refit failed: the exporting side ended without finishing its weights "
                                     "(its process died or its call failed before it started)")
            time.sleep(poll)
            poll = min(poll * 1.5, _MAX_POLL_S)

    def header(self) -> tuple[Any, list[Any]]:
        return self._wait_for("header")

    def handles(self) -> Iterator[Any]:
        index = 0
        while True:
            handle = self._wait_for(f"h{index:06d}")
            if handle is None:
                return
            yield handle
            index += 1
