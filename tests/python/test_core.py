"""The psld package itself: configuration, registration without copies,
requests, errors, and jobs of several processes under `psld launch`.

In-process jobs run a Coordinator, Servers and Workers of one job on threads
of the test process (each member's constructor blocks until the job starts,
with the GIL released); the Worker threads' joins are what the job waits for.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import psld
from conftest import free_port, job_env, launch, stop_group

torch = pytest.importorskip("torch")

HERE = Path(__file__).parent


# --- configuration -----------------------------------------------------------

def test_settings_nested_dotted_and_args_are_the_same_keys():
    a = psld.load_config(job={"num_workers": 3}, server={"mode": "sum"})
    b = psld.load_config(**{"job.num_workers": 3, "server.mode": "sum"})
    c = psld.load_config(args=["--job.num_workers=3", "--server.mode=sum"])
    for cfg in (a, b, c):
        assert cfg["job.num_workers"] == 3
        assert cfg["server.mode"] == "sum"
    assert psld.load_config(balancer={"enabled": True})["balancer.enabled"] is True


def test_config_from_a_file_and_its_sources(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[job]\nnum_workers = 5\n[server]\nmode = 'sum'\n")
    cfg = psld.load_config(path, data={"sync": "async"})
    assert cfg["job.num_workers"] == 5 and cfg["data.sync"] == "async"
    assert f"file {path}:2" in str(cfg)


def test_a_wrong_or_unknown_key_names_itself():
    with pytest.raises(psld.InvalidArgument, match="data.sync.*bps"):
        psld.load_config(data={"sync": "bps"})
    with pytest.raises(psld.InvalidArgument, match="num_worker.*job.num_workers"):
        psld.load_config(**{"job.num_worker": 2})
    with pytest.raises(KeyError, match="not a psld configuration key"):
        psld.load_config()["no.such.key"]


def test_error_classes_one_per_status_code():
    assert issubclass(psld.Timeout, psld.Error) and issubclass(psld.Timeout, TimeoutError)
    for name in ("InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
                 "Unavailable", "Aborted", "DataLoss", "Moved", "Unimplemented", "Internal"):
        cls = getattr(psld, name)
        assert issubclass(cls, psld.Error) and cls.code == name


# --- in-process jobs ---------------------------------------------------------

@contextmanager
def job(workers=1, servers=1, **settings):
    """A job in this process; yields its Workers (rank order). Everything is
    shut down at the end, also on failure."""
    common = dict(settings)
    common.setdefault("server", {}).setdefault("mode", "sum")
    common["job"] = dict(common.get("job", {}), num_workers=workers, num_servers=servers,
                         coordinator=f"127.0.0.1:{free_port()}")
    coordinator = psld.Coordinator(common)
    members, errors = [], []

    def start(cls):
        try:
            members.append(cls(common))
        except Exception as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(psld.Server,)) for _ in range(servers)]
    threads += [threading.Thread(target=start, args=(psld.Worker,)) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        if errors:
            raise errors[0]
        assert not any(t.is_alive() for t in threads), "the job did not start within 60 s"
        yield sorted((m for m in members if isinstance(m, psld.Worker)), key=lambda w: w.rank)
    finally:
        for m in members:
            m.shutdown()
        coordinator.shutdown()


def test_a_pull_writes_into_the_registered_memory_itself():
    with job() as (w,):
        for tensor in (np.arange(10_000, dtype=np.float32), torch.arange(10_000, dtype=torch.float32),
                       w.zeros(10_000, like="torch")):
            address = tensor.ctypes.data if isinstance(tensor, np.ndarray) else tensor.data_ptr()
            view = tensor[:] if isinstance(tensor, np.ndarray) else tensor.view(-1)  # same memory
            t = w.register(f"t{id(tensor)}", tensor)
            view[:] = 3
            w.push_pull(t).wait(10)
            now = tensor.ctypes.data if isinstance(tensor, np.ndarray) else tensor.data_ptr()
            assert now == address
            # sum mode, one worker: the pull wrote back what was pushed, into
            # the same memory the view sees
            assert float(view[0]) == 3 and float(view[-1]) == 3
            assert t.array is tensor


def test_a_list_of_tensors_is_submitted_together_with_exact_sums():
    # Two workers in one process, each on its own thread; 40 small tensors
    # (and names mixed with handles) push_pulled as one list per round.
    with job(workers=2, servers=2) as workers:
        arrays = {w.rank: [np.zeros(1 + 37 * i, dtype=np.float32) for i in range(40)] for w in workers}
        handles = {w.rank: [w.register(f"small{i}", a) for i, a in enumerate(arrays[w.rank])]
                   for w in workers}
        failures = []

        def train(w):
            try:
                for r in range(1, 11):
                    for a in arrays[w.rank]:
                        a[:] = w.rank + r
                    mixed = [h if i % 2 else h.name for i, h in enumerate(handles[w.rank])]
                    requests = w.push_pull(mixed)
                    assert len(requests) == 40
                    for q in requests:
                        q.wait(10)
                    for a in arrays[w.rank]:
                        assert (a == 1 + 2 * r).all(), (r, a[:3])
            except Exception as e:  # reported on the test's thread
                failures.append(e)

        threads = [threading.Thread(target=train, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures[0]
        assert not any(t.is_alive() for t in threads)
        # A bad name in a list submits nothing and says which.
        with pytest.raises(psld.NotFound, match="no tensor 'nope'"):
            workers[0].push_pull([handles[0][0], "nope"])


def test_a_resumed_job_starts_at_the_checkpoint_round_with_its_parameters(tmp_path):
    settings = dict(checkpoint=dict(dir=str(tmp_path), every_rounds=2), stats=dict(interval_ms=20))
    with job(**settings) as (w,):
        t = w.register("t", np.zeros(1000, dtype=np.float32))
        assert w.round(t) == 0
        for r in range(1, 13):
            t.array[:] = r  # sum mode, one worker: round r's parameter is r
            w.push_pull(t).wait(10)
            time.sleep(0.03)  # the coordinator seals the rounds every worker went past
        assert w.round("t") == 12
    settings["checkpoint"]["resume"] = True
    with job(**settings) as (w,):
        t = w.register("t", np.zeros(1000, dtype=np.float32))
        resumed = w.round(t)
        assert 2 <= resumed < 12 and resumed % 2 == 0
        # register pulled the parameter of that round into the array
        assert np.all(t.array == resumed)
        with pytest.raises(psld.FailedPrecondition, match="not in the checkpoint"):
            w.register("other", np.zeros(10, dtype=np.float32))


def test_registering_a_tensor_that_requires_grad_shares_its_memory():
    with job() as (w,):
        p = torch.ones(100, requires_grad=True)
        w.register("p", p)
        w.push_pull("p").wait(10)
        assert p.requires_grad and float(p[0].detach()) == 1


@pytest.mark.parametrize("bad, message", [
    (lambda: np.zeros((8, 8), dtype=np.float32)[:, 1], "not C-contiguous"),
    (lambda: torch.zeros(8, 8).t(), "not contiguous"),
    (lambda: np.zeros(8, dtype=np.int64), "dtype int64 is not supported"),
    (lambda: torch.zeros(8, dtype=torch.float64), "dtype float64 is not supported"),
    (lambda: np.frombuffer(bytes(32), dtype=np.float32), "read-only"),
    (lambda: [1.0, 2.0], "cannot register a list"),
])
def test_bad_tensors_are_refused_with_a_reason(bad, message):
    with job() as (w,):
        with pytest.raises(psld.InvalidArgument, match=message):
            w.register("bad", bad())
        w.push_pull(w.register("good", np.ones(4, dtype=np.float32))).wait(10)  # still fine


def test_registering_a_name_again():
    with job() as (w,):
        a = np.zeros(100, dtype=np.float32)
        t = w.register("a", a)
        assert w.register("a", a) is t
        with pytest.raises(psld.AlreadyExists, match="'a' is already registered"):
            w.register("a", np.zeros(50, dtype=np.float32))
        with pytest.raises(psld.AlreadyExists):
            w.register("a", np.zeros(100, dtype=np.float16))
        with pytest.raises(psld.NotFound, match="no tensor 'b'"):
            w.push("b")


def test_calls_after_shutdown_fail_clearly():
    with job() as (w,):
        t = w.register("a", np.zeros(10, dtype=np.float32))
        w.shutdown()
        w.shutdown()  # idempotent
        for call in (lambda: w.push_pull(t), lambda: w.register("b", np.zeros(4, np.float32)),
                     lambda: w.barrier(1), lambda: w.rank):
            with pytest.raises(psld.FailedPrecondition, match="shut down"):
                call()


def test_wait_times_out_leaving_the_request_in_flight_and_releases_the_gil():
    with job(workers=2) as (w0, w1):
        a0, a1 = np.ones(100, dtype=np.float32), np.full(100, 2, dtype=np.float32)
        t0, t1 = w0.register("a", a0), w1.register("a", a1)
        r0 = w0.push_pull(t0)
        # BSP: the round's sum needs worker 1's push, which has not come.
        ticks = []
        ticker = threading.Thread(target=lambda: [ticks.append(time.sleep(0.01)) for _ in range(20)])
        ticker.start()
        start = time.monotonic()
        with pytest.raises(psld.Timeout, match="still in flight after 0.5 s"):
            r0.wait(0.5)
        assert time.monotonic() - start >= 0.45
        ticker.join()
        assert len(ticks) == 20  # Python ran while this thread waited
        assert not r0.done()
        w1.push_pull(t1).wait(10)
        r0.wait(10)
        assert r0.done() and a0[0] == 3 and a1[0] == 3
        with pytest.raises(psld.InvalidArgument, match="timeout"):
            r0.wait(-1)


def test_ctrl_c_interrupts_a_wait(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading, numpy as np
        sys.path.insert(0, {str(HERE)!r})
        import psld
        from test_core import job
        with job(workers=2) as (w0, w1):
            r = w0.push_pull(w0.register("a", np.ones(4, dtype=np.float32)))
            print("waiting", flush=True)
            try:
                r.wait()
            except KeyboardInterrupt:
                print("interrupted", flush=True)
    """))
    # SIGINT at its default in the child whatever this process inherited: a
    # shell's background job (`.ci/run &`) ignores it, and an ignored SIGINT
    # stays ignored across exec, so Python would never raise KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=job_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert "interrupted" in out
        assert time.monotonic() - sent < 5
    finally:
        stop_group(proc)


def test_a_job_that_fails_mid_step_raises_and_does_not_hang(tmp_path):
    """A server process dies while a worker waits on a push_pull: the wait
    raises a psld.Error naming what happened, within the liveness timeouts."""
    port = free_port()
    settings = dict(job={"num_workers": 1, "num_servers": 2, "coordinator": f"127.0.0.1:{port}"},
                    server={"mode": "sum"}, liveness={"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 1000})
    coordinator = psld.Coordinator(settings)
    code = ("import psld, json, sys; s = psld.Server(json.loads(sys.argv[1])); "
            "print('started', flush=True); s.wait(120)")
    servers = [subprocess.Popen([sys.executable, "-c", code, json.dumps(settings)], env=job_env(),
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
               for _ in range(2)]
    w = None
    try:
        w = psld.Worker(settings)
        grads = [np.ones(1 << 18, dtype=np.float32) for _ in range(4)]
        handles = [w.register(f"g{i}", g) for i, g in enumerate(grads)]
        for h in handles:
            w.push_pull(h).wait(30)
        servers[0].kill()
        start = time.monotonic()
        with pytest.raises(psld.Error) as failure:
            for _ in range(1000):  # rounds until the loss is noticed
                for r in [w.push_pull(h) for h in handles]:
                    r.wait(30)
        assert time.monotonic() - start < 30
        assert not isinstance(failure.value, psld.Timeout)
        assert "server" in str(failure.value)
        with pytest.raises(psld.Error):
            w.health()
    finally:
        if w is not None:
            w.shutdown()
        coordinator.shutdown()
        for s in servers:
            stop_group(s)


# --- jobs under psld launch --------------------------------------------------

def test_exact_sums_from_four_worker_processes(tmp_path):
    launch([sys.executable, HERE / "core_job.py", "sums", tmp_path], tmp_path, workers=4, servers=2,
           PSLD_SERVER_MODE="sum", PSLD_DATA_CHUNK_BYTES=262144)
    for rank in range(4):
        result = json.loads((tmp_path / f"sums.{rank}.json").read_text())
        assert result["wrong"] == [], result
        assert result["same_memory"] and result["rounds"] == 20
        assert result["launcher"] == "psld"
