"""The GCS watcher's two ways out: the main thread takes the interrupt, or the watcher ends the process.

A real child process stands in for the GCS (the watcher only polls it); each case runs in its own
interpreter, since the watcher interrupts that interpreter's main thread.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from nrl_core.cluster import gcs_watch

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal; a parent may have ignored it

    gcs_watch.GRACE_S = 1.0
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gcs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **quiet)
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **quiet)

    def unheeded(reason):
        print("unheeded:", reason, flush=True)
        raylet.kill()
        os._exit(3)

    gcs_watch.watch_local_ray([(f"GCS (gcs_server pid {gcs.pid})", gcs), (f"raylet (raylet pid {raylet.pid})", raylet)],
                              is_connected=lambda: True, on_unheeded=unheeded)
    gcs.kill()
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        if sys.argv[1] == "acknowledge":
            gcs_watch.stop_watching()
    time.sleep(3)  # longer than the grace period: a silent main thread is ended by the watcher
    print("finished:", gcs_watch.cluster_failure(), flush=True)
    raylet.kill()
""")


def _run(mode: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - started


@pytest.mark.parametrize("mode", ["acknowledge", "swallow"])
def test_gcs_death_interrupts_main_and_an_unheeded_interrupt_ends_the_process(mode: str) -> None:
    done, took = _run(mode)
    lines = done.stdout.splitlines()
    assert lines[0] == "interrupted", done.stdout + done.stderr
    assert "gcs_server pid" in lines[1] and "was killed by SIGKILL" in lines[1]
    if mode == "acknowledge":
        assert done.returncode == 0 and lines[1].startswith("finished: cluster: the local Ray's GCS")
    else:
        assert done.returncode == 3 and lines[1].startswith("unheeded: cluster: the local Ray's GCS")
    assert took < 20
