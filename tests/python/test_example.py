"""Smoke test of examples/fashion_mnist/train.py: a few rounds with each backend,
2 workers (and 1 server for psld), checking the JSON line worker 0 prints."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, launch, stop_group

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "fashion_mnist" / "train.py"
DATA = Path("/usr/share/datasets/fashion-mnist")
ROUNDS = 6
DEADLINE_S = 60

pytestmark = pytest.mark.skipif(not (DATA / "train-images-idx3-ubyte.gz").is_file(),
                                reason=f"no Fashion-MNIST at {DATA} (Debian: dataset-fashion-mnist)")


def train_cmd(backend):
    return [sys.executable, str(TRAIN), "--backend", backend, "--rounds", str(ROUNDS),
            "--log-every", "3"]


def check_result(out, backend):
    """The one JSON line (psld launch prefixes it with who printed it) says what was run."""
    lines = [line for line in out.splitlines() if '{"backend"' in line]
    assert len(lines) == 1, f"expected one result line, got {len(lines)}; the output:\n{out}"
    result = json.loads(lines[0][lines[0].index("{"):])
    assert result["backend"] == backend
    assert result["workers"] == 2
    assert result["rounds"] == ROUNDS
    assert result["rounds_per_s"] > 0
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert result["wall_s"] >= result["train_s"] > 0
    # A progress point every --log-every rounds and one at the last round.
    assert [point[1] for point in result["curve"]] == [3, 6]


def test_ddp(tmp_path):
    log_path = tmp_path / "ddp.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(train_cmd("ddp") + ["--workers", "2"], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=job_env(), start_new_session=True)
    try:
        proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"train.py --backend ddp still running after {DEADLINE_S} s:\n"
                    f"{log_path.read_text(errors='replace')[-6000:]}")
    finally:
        stop_group(proc)
    out = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"train.py --backend ddp exited {proc.returncode}:\n{out[-6000:]}"
    check_result(out, "ddp")


def test_psld(tmp_path):
    try:
        import psld.torch
    except ImportError as e:
        pytest.skip(f"psld.torch is not importable: {e}")
    if not hasattr(psld.torch, "DistributedOptimizer"):
        pytest.skip("this psld.torch has no DistributedOptimizer yet")
    launch(train_cmd("psld"), tmp_path, workers=2, servers=1, deadline_s=DEADLINE_S,
           PSLD_SERVER_MODE="sum",
           # The workers import torch before they join, slow on a loaded machine.
           PSLD_LIVENESS_CONNECT_TIMEOUT_MS="30000")
    check_result((tmp_path / "launch.log").read_text(errors="replace"), "psld")
