"""Every test runs with a profile cache of its own session: a profile the user saved with
`empanel-gguf calibrate` (moe_profile="auto" finds it) must not change what the tests measure."""

import os
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

_PROFILES = tempfile.mkdtemp(prefix="empanel-test-profiles-")
os.environ["EMPANEL_PROFILE_DIR"] = _PROFILES  # read by empanel_gguf.cache.cache_dir, children too


def child_env(drop=(), **extra):
    """The environment for a child process of a test: this checkout on PYTHONPATH, none of the
    user's LLAMA_ARG_* / EMPANEL_* settings (the session's profile cache kept), minus `drop`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LLAMA_ARG_", "EMPANEL_")) and k != "LLAMA_CPP_LIB_PATH" and k not in drop}
    env["EMPANEL_PROFILE_DIR"] = _PROFILES
    env["PYTHONPATH"] = str(_REPO)
    env.update(extra)
    return env


def stop_process(proc, timeout=10, group=False):
    """SIGTERM, then SIGKILL after `timeout` s: a test's server child never outlives the test.
    group: proc leads a session of its own (start_new_session=True) and SIGKILL takes all of it,
    so that a wrapper's own child (the real server) is not left behind."""
    import signal
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(timeout=10)


def free_port():
    """A loopback TCP port free right now (for a server child to listen on)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc, url, log, timeout, what="server"):
    """Poll url until it answers 200; pytest.fail (with the log's tail) if proc exits first or
    `timeout` s pass."""
    import time
    import urllib.request

    import pytest

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{Path(log).read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not answer within {timeout} s:\n{Path(log).read_text()[-3000:]}")
        time.sleep(0.2)
