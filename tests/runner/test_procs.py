"""Telling a live process from a reused pid (runner.procs.process_matches), on real processes."""

from __future__ import annotations

import subprocess
import sys

import psutil

from m3run.runner.procs import process_matches


def test_a_process_is_known_by_its_create_time_within_a_boot_time_step():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        born = psutil.Process(child.pid).create_time()
        assert process_matches(child.pid, born)
        # The boot time psutil adds is whole seconds of /proc/stat that move with the wall
        # clock: a reader after an NTP adjustment sees the same process a second off.
        assert process_matches(child.pid, born - 1.0) and process_matches(child.pid, born + 1.0)
        # A create time seconds away is another process that got the pid.
        assert not process_matches(child.pid, born - 5.0)
        assert process_matches(child.pid, None)  # nothing recorded: alive is all we know
    finally:
        child.kill()
        child.wait()
    assert not process_matches(child.pid, born)
