"""psld.torch against torch.distributed: each test runs a job of
tests/python/torch_job.py under `psld launch` and checks what its workers wrote.

Every job runs in its own process group, killed when the test ends however
it ends, and under a deadline (no pytest-timeout here: subprocess timeouts).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import job_env, free_port, launch, psld_command, stop_group

torch = pytest.importorskip("torch", reason="psld.torch needs PyTorch")
import psld  # noqa: E402

JOB = Path(__file__).with_name("torch_job.py")
DEADLINE_S = 60
# Servers wait this long for the workers to join. A worker imports torch
# first: seconds each on two loaded cores, past psld's 10 s default.
JOIN_ENV = {"PSLD_LIVENESS_CONNECT_TIMEOUT_MS": "50000"}


def job_program(mode, outdir):
    return [sys.executable, JOB, mode, outdir]


def results(mode, outdir, workers, returncode):
    """Each worker's JSON; the launch log in the message when one is missing."""
    out = []
    for rank in range(workers):
        path = outdir / f"{mode}.{rank}.json"
        if not path.exists():
            log = (outdir / "launch.log").read_text(errors="replace")[-6000:]
            pytest.fail(f"worker {rank} wrote no result (launch exit {returncode}):\n{log}")
        out.append(json.loads(path.read_text()))
    return out


def run_job(mode, outdir, workers, servers, **env):
    """psld launch -w WORKERS -s SERVERS -- python torch_job.py MODE OUTDIR, to its end."""
    proc = launch(job_program(mode, outdir), outdir, workers, servers, deadline_s=DEADLINE_S,
                  TORCH_JOB_GLOO_PORT=free_port(), **JOIN_ENV, **env)
    return results(mode, outdir, workers, proc.returncode)


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    """One 4-worker, 2-server job in server.mode=sum for the tests below."""
    return run_job("equivalence", tmp_path_factory.mktemp("equivalence"), 4, 2, PSLD_SERVER_MODE="sum")


def assert_close(actual, expected, rel, what):
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{what}: step {step}: {a} vs {e} (rel {rel})"
    assert len(actual) == len(expected)


def test_sum_mode_matches_ddp_over_gloo(equivalence):
    # Same data, seeds, SGD with momentum and weight decay, StepLR: the only
    # difference is the order in which float32 sums of 4 terms are added (a
    # ring allreduce vs the servers), a few ulps per step.
    for rank, r in enumerate(equivalence):
        assert len(r["psld"]) == 20
        assert_close(r["psld"], r["ddp"], 1e-5, f"worker {rank} psld vs DDP")
        assert r["psld_buckets"] > 1, "bucket_bytes=256 should split the model"
        assert r["psld_lr_after"] == pytest.approx(0.1 * 0.5 ** 2), "StepLR drove the wrapped optimizer"
    # The losses differ between workers (their batches do): a real 4-way job.
    assert len({round(r["ddp"][0], 6) for r in equivalence}) == 4


def test_clipping_between_synchronize_and_step(equivalence):
    # clip_grad_norm_ on the averaged gradients (synchronize(), then step()
    # under skip_synchronize()) as DDP clips its averaged gradients; a norm
    # of 0.05 clips every step, so the losses differ from the unclipped run.
    for rank, r in enumerate(equivalence):
        assert_close(r["psld_clip"], r["ddp_clip"], 1e-5, f"worker {rank} clipped psld vs DDP")
        assert r["psld_clip"][-1] != pytest.approx(r["psld"][-1], rel=1e-3), "clipping changed nothing"


def test_comm_hook_matches_default_allreduce(equivalence):
    # DDP's buckets summed by psld instead of gloo: the same arithmetic up to
    # the order of the 4-term float32 sums, hence the same 1e-5 bound.
    for rank, r in enumerate(equivalence):
        assert_close(r["comm_hook"], r["ddp"], 1e-5, f"worker {rank} comm hook vs allreduce")
        # Several DDP buckets, and the layout DDP rebuilt after the first
        # iteration registered beside the first one.
        assert r["comm_hook_buckets"] > r["ddp_buckets"] > 1, r


def test_half_precision_wire_stays_close(equivalence):
    # float16 keeps 11 significant bits (relative error 2^-11 per gradient
    # element), bfloat16 8 bits (2^-8): over 20 steps the losses drift by
    # well under 1% and 5%.
    for rank, r in enumerate(equivalence):
        assert_close(r["psld_fp16"], r["psld"], 1e-2, f"worker {rank} float16 wire")
        assert_close(r["psld_bf16"], r["psld"], 5e-2, f"worker {rank} bfloat16 wire")
        assert r["psld_fp16"] != r["psld"], "the float16 wire changed nothing: was it used?"


def test_unused_parameters_do_not_hang(equivalence):
    # Every worker pushed every bucket each round (zeros for the missing
    # gradients) and applied the same result: the parameters agree.
    for rank, r in enumerate(equivalence):
        assert r["unused"] == equivalence[0]["unused"], f"worker {rank} diverged"


def test_gradient_accumulation(equivalence):
    # Two half-batch passes summed vs one pass: float32 sums in another order.
    for r in equivalence:
        assert r["accumulate_max_abs_diff"] < 1e-6


def test_first_bucket_leaves_during_backward(equivalence):
    for rank, r in enumerate(equivalence):
        overlap = r["overlap"]
        assert overlap["buckets"] >= 6
        for i, rnd in enumerate(overlap["rounds"]):
            pushes = rnd["pushes"]
            assert len(pushes) == overlap["buckets"], f"worker {rank} round {i}: every bucket sent in backward"
            # The first bucket (the last layer) left while backward still had
            # the other layers to go, not at its end or in step().
            assert rnd["backward_began"] < pushes[0] < pushes[-1] <= rnd["backward_ended"]


def test_broadcasts(equivalence):
    root = equivalence[2]["broadcast"]
    assert root["f64"] == [1.0 / 3 + 2] * 3
    assert root["i64"] == [2**62 + 2, -2]
    assert root["mask"] == [True, True, False]
    assert root["odd"] == [2, 3, 4, 5, 6]
    for rank, r in enumerate(equivalence):
        b = r["broadcast"]
        for key in ("f64", "i64", "mask", "odd"):
            assert b[key] == root[key], f"worker {rank}: {key}"
        assert b["adam_lr"] == pytest.approx(0.02), "worker 1's optimizer state"
        assert b["adam_step"] == 1.0
        assert b["adam_exp_avg"] == equivalence[1]["broadcast"]["adam_exp_avg"]
        assert b["object"] == {"rank": 3, "text": "x" * 10}
        if rank % 2 == 0:
            assert b["mismatch"] == "no error"
        else:
            assert b["mismatch"].startswith("InvalidArgument: broadcast_parameters")


def test_optimizer_mode_trains(tmp_path):
    rs = run_job("optimizer", tmp_path, 2, 1, PSLD_SERVER_MODE="optimizer",
                 PSLD_OPTIMIZER_KIND="sgd", PSLD_OPTIMIZER_LR="0.7")
    for rank, r in enumerate(rs):
        assert r["initial_is_worker0s"], f"worker {rank} did not start from worker 0's parameters"
        assert sum(r["losses"][-5:]) < sum(r["losses"][:5]), f"worker {rank}: loss did not go down"
        # The servers' SGD on the mean gradient, at the rate StepLR set on the
        # wrapped optimizer (not the servers' optimizer.lr 0.7), vs the same
        # on one process: float32 sums in another order.
        assert r["reference_max_abs_diff"] < 1e-5
        assert r["two_rates"].startswith("InvalidArgument:") and "one learning rate" in r["two_rates"]
        assert r["broadcast"] == [0.0] * 4
    assert rs[0]["params"] == rs[1]["params"], "the workers' parameters differ"


def test_server_killed_mid_step_raises(tmp_path):
    # Not conftest's launch: the test kills the server while the job runs.
    with open(tmp_path / "launch.log", "wb") as log:
        proc = subprocess.Popen(
            [psld_command(), "launch", "-w", "2", "-s", "1", "--",
             *map(str, job_program("failure", tmp_path))],
            stdout=log, stderr=subprocess.STDOUT, env=job_env(PSLD_SERVER_MODE="sum", **JOIN_ENV),
            start_new_session=True)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not all((tmp_path / f"ready.{r}").exists() for r in range(2)):
            assert proc.poll() is None, (tmp_path / "launch.log").read_text(errors="replace")
            assert time.monotonic() < deadline, "the workers never reached step 3"
            time.sleep(0.02)
        server = server_pid(proc.pid)
        os.kill(server, signal.SIGKILL)
        (tmp_path / "go").touch()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still runs 30 s after its server was killed: step() hangs\n" +
                        (tmp_path / "launch.log").read_text(errors="replace")[-6000:])
    finally:
        stop_group(proc)
    rs = results("failure", tmp_path, 2, proc.returncode)
    assert rs[0]["timeout"].startswith("Timeout: psld.torch: bucket"), rs[0]["timeout"]
    for rank, r in enumerate(rs):
        assert r["error"] != "no error", f"worker {rank}: step() did not fail"
        kind = r["error"].split(":")[0]
        assert issubclass(getattr(psld, kind), psld.Error) and kind != "Timeout", r["error"]
        assert "server" in r["error"], r["error"]
        if "seconds" in r:
            assert r["seconds"] < 10


def server_pid(launcher: int) -> int:
    """The pid of the first `psld server` child of the launcher."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher and b"server" in cmdline:
            return int(entry.name)
    pytest.fail(f"no psld server process under the launcher (pid {launcher})")
