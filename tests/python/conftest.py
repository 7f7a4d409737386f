"""Shared by the Python tests: how to find and launch psld, and a deadline on
every test (no pytest-timeout here: a hung test dumps every thread's stack
and ends the run rather than hanging CI)."""

import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DEADLINE_S = 120


@pytest.fixture(autouse=True)
def deadline():
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def psld_command() -> str:
    """The psld command: $PSLD_COMMAND, next to this interpreter (a venv's
    bin/, where pip installs it), or on PATH."""
    for candidate in (os.environ.get("PSLD_COMMAND"), str(Path(sys.executable).with_name("psld")),
                      shutil.which("psld")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no psld command: set PSLD_COMMAND, or pip install the package into this interpreter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**env) -> dict:
    """This environment for a job's processes, with `env` added; no variable
    psld would reject (PSLD_COMMAND is this harness's, not a psld key)."""
    full = dict(os.environ, OMP_NUM_THREADS="1")
    full.pop("PSLD_COMMAND", None)
    full.update({k: str(v) for k, v in env.items()})
    return full


def stop_group(proc: subprocess.Popen) -> None:
    """Kills the process group `proc` leads (started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def launch(program, outdir: Path, workers: int, servers: int, *, deadline_s: float = 60,
           launch_args=(), **env) -> subprocess.CompletedProcess:
    """Runs `psld launch -w W -s S [launch_args] -- PROGRAM...` in its own
    process group, killed when it ends however it ends; fails the test with
    the end of its output when it does not exit 0 within deadline_s."""
    log_path = outdir / "launch.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [psld_command(), "launch", "-w", str(workers), "-s", str(servers), *launch_args, "--",
             *[str(p) for p in program]],
            stdout=log, stderr=subprocess.STDOUT, env=job_env(**env), start_new_session=True)
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        pytest.fail(f"job still running after {deadline_s} s:\n{log_path.read_text(errors='replace')[-6000:]}")
    finally:
        stop_group(proc)
    if proc.returncode != 0:
        pytest.fail(f"job failed (exit {proc.returncode}):\n{log_path.read_text(errors='replace')[-6000:]}")
    return proc
