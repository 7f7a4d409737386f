#!/usr/bin/env python3
"""register + push_pull of one 64 MiB CPU tensor: from Python, and from C++ in the same sitting.

    .venv/bin/python bench/python/register_push_pull.py [--cxx build/bench/register_push_pull]
        [--mib 64] [--rounds 4] [--repeat 6] [--json FILE] [--report FILE]

Each side runs in its own process: one job there (a coordinator, one server
and one worker) and, `--repeat` times, a fresh heap tensor (a numpy array on
the Python side) registered, one push_pull, and a second push_pull of it.
The two sides alternate `--rounds` times (A B A B ...), so load on this
shared machine falls on both; the first repetition of each process is
warm-up and is dropped. The table gives medians and Python/C++ ratios: psld
uses the array's own memory, so a hidden copy would show as a ratio above 1.

--report FILE writes Google Benchmark-shaped JSON (bench/report.h; psld bench
run's python suite): BM_python_<step> with its ratio C++/Python (higher is
better: 1 is as fast as C++) against BM_cxx_<step>, medians of this run.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("register_s", "push_pull_s", "second_push_pull_s")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags() -> list:
    return [f"--job.coordinator=127.0.0.1:{free_port()}", "--server.mode=sum"]


def python_side(nbytes: int, repeat: int, job_flags: list) -> None:
    """The same steps as bench/register_push_pull.cc, one JSON line each."""
    import threading

    import numpy as np

    import psld

    cfg = psld.load_config(args=job_flags)
    coordinator = psld.Coordinator(cfg)
    box = {}
    server = threading.Thread(target=lambda: box.setdefault("s", psld.Server(cfg)))
    server.start()
    worker = psld.Worker(cfg)
    server.join()
    for r in range(repeat):
        tensor = np.ones(nbytes // 4, dtype=np.float32)
        start = time.perf_counter()
        t = worker.register(f"t{r}", tensor)
        register_s = time.perf_counter() - start
        start = time.perf_counter()
        worker.push_pull(t).wait()
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        worker.push_pull(t).wait()
        second_s = time.perf_counter() - start
        print(json.dumps({"register_s": register_s, "push_pull_s": first_s,
                          "second_push_pull_s": second_s}), flush=True)
    worker.shutdown()
    coordinator.wait(30)
    box["s"].shutdown()


def run_side(cmd: list, timeout: float) -> list:
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env, timeout=timeout, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows[1:]  # the first repetition warms up the process


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cxx", default=str(ROOT / "build/bench/register_push_pull"))
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--json")
    ap.add_argument("--report", help="also write Google Benchmark-shaped JSON rows to this file")
    ap.add_argument("--python-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = args.mib << 20
    if args.python_side:
        python_side(nbytes, args.repeat, args.rest)
        return 0
    if not os.access(args.cxx, os.X_OK):
        sys.exit(f"no C++ side at {args.cxx}: build it with tools/dev build (build/bench/register_push_pull)")
    samples = {"python": [], "cxx": []}
    for rnd in range(args.rounds):
        for side in ("cxx", "python") if rnd % 2 == 0 else ("python", "cxx"):
            if side == "cxx":
                cmd = [args.cxx, "--bytes", str(nbytes), "--repeat", str(args.repeat)]
            else:
                cmd = [sys.executable, __file__, "--python-side", "--mib", str(args.mib),
                       "--repeat", str(args.repeat), "--"]
            rows = run_side(cmd + flags(), timeout=300)
            samples[side] += rows
            print(f"round {rnd + 1}/{args.rounds} {side:6}: median push_pull "
                  f"{statistics.median(r['push_pull_s'] for r in rows) * 1e3:.1f} ms", file=sys.stderr)
    table = []
    for step in STEPS:
        cxx = statistics.median(r[step] for r in samples["cxx"])
        py = statistics.median(r[step] for r in samples["python"])
        table.append({"step": step, "cxx_ms": cxx * 1e3, "python_ms": py * 1e3, "ratio": py / cxx,
                      "samples": len(samples["cxx"])})
    print(f"{args.mib} MiB heap tensor, 1 worker + 1 server in one process, medians of "
          f"{table[0]['samples']} repetitions per side")
    print(f"{'step':22} {'C++ ms':>10} {'Python ms':>10} {'Python/C++':>11}")
    for row in table:
        print(f"{row['step']:22} {row['cxx_ms']:10.2f} {row['python_ms']:10.2f} {row['ratio']:11.3f}")
    total_cxx = sum(r["cxx_ms"] for r in table[:2])
    total_py = sum(r["python_ms"] for r in table[:2])
    print(f"{'register + push_pull':22} {total_cxx:10.2f} {total_py:10.2f} {total_py / total_cxx:11.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": table, "samples": samples}, indent=1))
    if args.report:
        write_report(args.report, table, total_cxx, total_py)
    return 0


def write_report(path: str, table: list, total_cxx_ms: float, total_py_ms: float) -> None:
    rows = []
    steps = [(r["step"], r["cxx_ms"], r["python_ms"]) for r in table]
    steps.append(("register_push_pull", total_cxx_ms, total_py_ms))
    for step, cxx_ms, py_ms in steps:
        for side, ms in (("cxx", cxx_ms), ("python", py_ms)):
            row = {"name": f"BM_{side}_{step}", "run_type": "iteration", "repetitions": 1,
                   "repetition_index": 0, "threads": 1, "iterations": 1,
                   "real_time": ms * 1e6, "cpu_time": ms * 1e6, "time_unit": "ns"}
            if side == "python":
                row.update({"yardstick": f"BM_cxx_{step}", "ratio": cxx_ms / py_ms})
            row["run_name"] = row["name"]
            rows.append(row)
    doc = {"context": {"executable": "bench/python/register_push_pull.py"}, "benchmarks": rows}
    Path(path + ".tmp").write_text(json.dumps(doc, indent=1))
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
