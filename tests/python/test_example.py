"""Smoke test of examples/fashion_mnist/train.py: a few rounds with each backend,
2 workers (and 1 server for psld), checking the JSON line worker 0 prints."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "fashion_mnist" / "train.py"
DATA = Path("/usr/share/datasets/fashion-mnist")
ROUNDS = 6
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").is_file(),
                                reason=f"no Fashion-MNIST at {DATA} (Debian: dataset-fashion-mnist)")


def run_job(cmd, env=None):
    """Runs cmd in its own process group; kills the group when it is done, fails or times out."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {TIMEOUT_S} s; its output:\n{out}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}; its output:\n{out}"
    return out


def result_line(out):
    """The one JSON line; psld launch prefixes it with who printed it."""
    lines = [line for line in out.splitlines() if '{"backend"' in line]
    assert len(lines) == 1, f"expected one result line, got {len(lines)}; the output:\n{out}"
    return json.loads(lines[0][lines[0].index("{"):])


def check_result(result, backend):
    assert result["backend"] == backend
    assert result["workers"] == 2
    assert result["rounds"] == ROUNDS
    assert result["rounds_per_s"] > 0
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert result["wall_s"] >= result["train_s"] > 0
    # A progress point every --log-every rounds and one at the last round.
    assert [point[1] for point in result["curve"]] == [3, 6]


def train_cmd(backend):
    return [sys.executable, str(TRAIN), "--backend", backend, "--rounds", str(ROUNDS),
            "--log-every", "3"]


def test_ddp():
    check_result(result_line(run_job(train_cmd("ddp") + ["--workers", "2"])), "ddp")


def find_psld():
    for candidate in (os.environ.get("PSLD"), Path(sys.executable).parent / "psld",
                      REPO / "build" / "tools" / "psld", shutil.which("psld")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def test_psld():
    if importlib.util.find_spec("psld") is None:
        pytest.skip("the psld Python package is not importable")
    try:
        import psld.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"psld.torch is not importable: {e}")
    psld_cmd = find_psld()
    if psld_cmd is None:
        pytest.skip("no psld command: build it (tools/dev build) or set PSLD")
    env = dict(os.environ, PSLD_SERVER_MODE="sum")
    out = run_job([psld_cmd, "launch", "-w", "2", "-s", "1", "--"] + train_cmd("psld"), env=env)
    check_result(result_line(out), "psld")
