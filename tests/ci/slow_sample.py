"""A test that takes a little over a second: what ``test_ci_run.py`` runs through ``.ci/run``, so
that the alarm on the suite's time can be shown to fire at a lowered limit. Not collected by the
suite itself (its name does not start with ``test_``)."""

import time


def test_takes_a_little_over_a_second():
    time.sleep(1.2)
