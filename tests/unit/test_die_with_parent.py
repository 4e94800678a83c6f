"""A service started by `meshserve up` stops when the launcher does: MESHSERVE_PARENT_PID
makes it ask Linux for SIGTERM when its parent goes, and refuse to start if the parent is
gone already (shared/service_main.py)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

from meshserve.shared.service_main import PARENT_PID_ENV

# The grandchild: asks for the signal, says it is ready, then waits to be stopped.
_CHILD = """
import sys, time
from meshserve.shared.service_main import die_with_parent
die_with_parent()
print("ready", flush=True)
time.sleep(120)
"""
# The middle process (a stand-in launcher): starts the grandchild with its own pid, reports
# the grandchild's pid once it is ready, then waits to be killed.
_PARENT = """
import os, subprocess, sys, time
env = dict(os.environ, {var}=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", {child!r}], env=env, stdout=subprocess.PIPE,
                         text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def _exits_within(pidfd: int, seconds: float) -> bool:
    """Whether the process behind `pidfd` exits within `seconds` (a pidfd polls readable
    when its process exits)."""
    readable, _, _ = select.select([pidfd], [], [], seconds)
    return bool(readable)


def test_the_service_gets_sigterm_when_its_launcher_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT.format(var=PARENT_PID_ENV, child=_CHILD)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = os.pidfd_open(int(parent.stdout.readline()))
        try:
            assert not _exits_within(child, 0.2)  # alive while the launcher is
            parent.send_signal(signal.SIGKILL)
            parent.wait(timeout=10)
            assert _exits_within(child, 10.0)
        finally:
            os.close(child)
    finally:
        parent.kill()


def test_a_service_whose_launcher_is_already_gone_does_not_start() -> None:
    env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid() + 10**6)})  # not our parent
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "ready" not in done.stdout and "exited before this service started" in done.stderr


def test_without_the_variable_nothing_changes() -> None:
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    script = _CHILD.replace("time.sleep(120)", "")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ready"
