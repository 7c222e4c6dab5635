"""Fixtures that more than one test file here uses."""
import contextlib
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1",  # a child imports the repository's modules and tests'
             "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}


@contextlib.contextmanager
def child(flag, script=None, command=None):
    """A child process running `script` (or `command`), once it has made `flag`; killed at the block's end."""
    process = subprocess.Popen(command or [sys.executable, "-c", script], env=CHILD_ENV)
    try:
        for _ in range(1200):
            if flag.exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert flag.exists(), f"the child never reached its flag (exit status {process.poll()})"
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def child_at():
    """child_at(flag, script=None, command=None): a context manager around a child process, entered once the
    child has made `flag` (it stands for "the child has reached that point")."""
    return child


@pytest.fixture
def child_env():
    return CHILD_ENV
