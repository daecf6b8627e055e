"""Every test runs with a profile cache of its own session: a profile the user saved with
`empanel-gguf calibrate` (moe_profile="auto" finds it) must not change what the tests measure.

Optional parts of a build, each asked for by one helper here, skip the tests that need them when
they are missing; one variable per part makes that a failure (CI sets them):
    require_programs(*names)   llama.cpp's programs (EMPANEL_PROGRAMS=ON)    EMPANEL_REQUIRE_PROGRAMS=1
    require_archs_writer()     the test-llama-archs model writer (the same)  EMPANEL_REQUIRE_ARCHS=1
    require_vulkan()           a Vulkan build's lib folder (.ci/run's)       none: CI may lack the packages
    require_uring()            io_uring in this build and kernel             EMPANEL_REQUIRE_URING=1

The `read_io` fixture runs a test on both read paths (the reader threads, then io_uring), set
by EMPANEL_READ_IO in this process and in children made with child_env.
"""

import os
import tempfile
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent

_PROFILES = tempfile.mkdtemp(prefix="empanel-test-profiles-")
os.environ["EMPANEL_PROFILE_DIR"] = _PROFILES  # read by empanel_gguf.planning.cache.cache_dir, children too


def _missing_part(message, require_env=None):
    """Skip the test, or fail it when `require_env` is set to 1."""
    import pytest

    if require_env is not None and os.environ.get(require_env) == "1":
        pytest.fail(f"{require_env}=1 but {message}", pytrace=False)
    pytest.skip(message)


_BUILD_PROGRAMS = 'build with CMAKE_ARGS="-DLLAMA_BUILD=OFF -DEMPANEL_PROGRAMS=ON" pip install .'


def require_programs(*names):
    """llama.cpp's programs `names` (default: all of them) are built in this install, or the test
    is skipped (failed with EMPANEL_REQUIRE_PROGRAMS=1)."""
    from empanel_gguf.commands.programs import PROGRAMS, programs_dir

    missing = [name for name in names or PROGRAMS if not (programs_dir() / name).is_file()]
    if missing:
        _missing_part(f"llama.cpp's {', '.join(missing)} are not built in {programs_dir()} ({_BUILD_PROGRAMS})",
                      "EMPANEL_REQUIRE_PROGRAMS")


def require_archs_writer():
    """llama.cpp's test-llama-archs model writer of this checkout's build (EMPANEL_ARCHS_BIN, else
    build/*/bin/), or the test is skipped (failed with EMPANEL_REQUIRE_ARCHS=1)."""
    given = os.environ.get("EMPANEL_ARCHS_BIN")
    found = [Path(given)] if given else sorted((_REPO / "build").glob("*/bin/test-llama-archs"))
    if not found or not found[0].is_file():
        _missing_part(f"llama.cpp's test-llama-archs is not built (it is built with the programs: {_BUILD_PROGRAMS})",
                      "EMPANEL_REQUIRE_ARCHS")
    return found[0]


def require_vulkan():
    """The lib folder of a Vulkan build (EMPANEL_VULKAN_LIB_DIR, .ci/run makes one when the Vulkan
    packages install), or the test is skipped: CI tolerates a machine without them."""
    lib_dir = os.environ.get("EMPANEL_VULKAN_LIB_DIR", "")
    if not (lib_dir and (Path(lib_dir) / "libggml-vulkan.so").exists()):
        _missing_part("no Vulkan build: set EMPANEL_VULKAN_LIB_DIR to a Vulkan build's lib folder (see .ci/run)")
    return lib_dir


def require_uring():
    """This build and kernel read with io_uring, or the test is skipped (failed with
    EMPANEL_REQUIRE_URING=1)."""
    from empanel_gguf.engine.native import uring_available

    ok, why = uring_available()
    if not ok:
        _missing_part(f"no io_uring here: {why}", "EMPANEL_REQUIRE_URING")


_READ_IO = {"path": None}  # the read path the read_io fixture set, for child_env


@pytest.fixture(params=["threads", "uring"])
def read_io(request, monkeypatch):
    """The read path of the test (EMPANEL_READ_IO): "threads", then "uring"."""
    if request.param == "uring":
        require_uring()
    monkeypatch.setenv("EMPANEL_READ_IO", request.param)
    _READ_IO["path"] = request.param
    yield request.param
    _READ_IO["path"] = None


def child_env(drop=(), **extra):
    """The environment for a child process of a test: this checkout on PYTHONPATH, none of the
    user's LLAMA_ARG_* / EMPANEL_* settings (the session's profile cache kept), minus `drop`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LLAMA_ARG_", "EMPANEL_")) and k != "LLAMA_CPP_LIB_PATH" and k not in drop}
    env["EMPANEL_PROFILE_DIR"] = _PROFILES
    env["PYTHONPATH"] = str(_REPO)
    if _READ_IO["path"] is not None:
        env["EMPANEL_READ_IO"] = _READ_IO["path"]
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
