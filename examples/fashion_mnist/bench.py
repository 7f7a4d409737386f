#!/usr/bin/env python3
"""Benchmark train.py: psld.torch against torch DDP over gloo, in one sitting.

Four jobs, run in turn --reps times (interleaved, so that a change in the
machine's load falls on all of them alike):

  ddp                DistributedDataParallel over gloo, --workers processes
  psld               psld.torch, --workers workers and --servers servers
  psld-straggler     the same with server 0 behind a --slow-rate link, balancer off
  psld-balancer      the same straggler, balancer on

Each job's rounds/s and test accuracy come from train.py's JSON line; its CPU
use is the user + system seconds of all its processes (getrusage of the
children, which psld launch and torch's spawn both wait for). The results go
to docs/python-results.md (a table, with the ratios psld/DDP and balancer on /
off) and docs/python-results.png (rounds/s and loss against time).
"""

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# The targets, checked in the results table.
TARGET_PSLD_OVER_DDP = 1.0
TARGET_BALANCER_ON_OVER_OFF = 1.5


@dataclass
class Job:
    name: str
    title: str
    backend: str
    slow_server: bool = False
    balancer: bool = False
    runs: list = field(default_factory=list)  # one result dict per rep

    def median(self, key):
        return statistics.median(r[key] for r in self.runs)


JOBS = [
    Job("ddp", "DDP over gloo", "ddp"),
    Job("psld", "psld.torch", "psld"),
    Job("psld-straggler", "psld.torch, straggler, balancer off", "psld", slow_server=True),
    Job("psld-balancer", "psld.torch, straggler, balancer on", "psld", slow_server=True,
        balancer=True),
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=float, default=2, help="epochs each job trains (default 2)")
    p.add_argument("--rounds", type=int, help="rounds each job trains, instead of --epochs")
    p.add_argument("--reps", type=int, default=2, help="times each job runs (default 2)")
    p.add_argument("--jobs", default=",".join(j.name for j in JOBS),
                   help="comma-separated jobs to run (default all: %(default)s)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--slow-rate", default="25M", help="the straggler's link, bytes/s each way")
    p.add_argument("--bucket-bytes", type=int, default=4 << 20,
                   help="psld.torch's bucket_bytes (train.py --bucket-bytes)")
    p.add_argument("--chunk-bytes", type=int, default=65536,
                   help="psld's data.chunk_bytes: the 1.1 MB gradient bucket in 18 chunks of "
                        "64 KiB, enough for the balancer to move part of it")
    p.add_argument("--balancer-interval-ms", type=int, default=500)
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--psld", type=Path, help="the psld command (default $PSLD, the one "
                   "installed next to this Python, build/tools/psld of this repository, or "
                   "psld on PATH)")
    p.add_argument("--out", type=Path, default=REPO / "docs",
                   help="folder for python-results.md and .png (default %(default)s)")
    p.add_argument("--log-dir", type=Path, help="keep each job's output here (default a temp folder)")
    args = p.parse_args()
    names = {j.name for j in JOBS}
    args.jobs = args.jobs.split(",")
    unknown = [n for n in args.jobs if n not in names]
    if unknown:
        p.error(f"unknown job {', '.join(unknown)}; the jobs are {', '.join(names)}")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    return args


def find_psld(args):
    # pip install . puts the command next to the interpreter, built with the
    # package the workers import.
    for candidate in (args.psld, os.environ.get("PSLD"), Path(sys.executable).parent / "psld",
                      REPO / "build/tools/psld", shutil.which("psld")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    sys.exit("psld command not found: build it (tools/dev build), or pass --psld or set PSLD")


def command(job, args, psld):
    """The job's command line and environment."""
    train = [sys.executable, str(HERE / "train.py"), "--backend", job.backend, "--log-every", "25"]
    train += ["--rounds", str(args.rounds)] if args.rounds else ["--epochs", str(args.epochs)]
    if job.backend == "psld":
        train += ["--bucket-bytes", str(args.bucket_bytes)]
    env = dict(os.environ)
    if job.backend == "ddp":
        return train + ["--workers", str(args.workers)], env
    env.update({
        "PSLD_SERVER_MODE": "sum",  # the servers sum; each worker steps its own optimizer
        "PSLD_DATA_CHUNK_BYTES": str(args.chunk_bytes),
        "PSLD_BALANCER_ENABLED": "true" if job.balancer else "false",
        "PSLD_BALANCER_INTERVAL_MS": str(args.balancer_interval_ms),
        # Python workers import torch before they join: on a loaded machine that
        # took more than the default 10 s, and the job failed at start.
        "PSLD_LIVENESS_CONNECT_TIMEOUT_MS": "60000",
    })
    launch = [str(psld), "launch", "-w", str(args.workers), "-s", str(args.servers)]
    if job.slow_server:
        launch += ["--slow-server", f"0:{args.slow_rate}"]
    return launch + ["--"] + train, env


def children_cpu_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stop_group(proc):
    """Stops the job's whole process group: TERM, then KILL if it lingers."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass


def run_job(job, args, psld, log_path):
    """Runs one job to its end; returns train.py's result with cpu_s added.
    Exits the benchmark (after stopping the job) if the job fails or times out."""
    cmd, env = command(job, args, psld)
    cpu_before = children_cpu_s()
    began = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except BaseException:  # the timeout, or Ctrl-C: leave nothing running
            stop_group(proc)
            tail = log_path.read_text().splitlines()[-20:]
            sys.exit(f"{job.name} did not finish within {args.timeout:.0f} s (stopped); "
                     f"the end of {log_path}:\n" + "\n".join(tail))
    # The job's processes are in its group; psld launch stops its own children,
    # but make sure nothing of a failed job lives on.
    stop_group(proc)
    wall_s = time.monotonic() - began
    cpu_s = children_cpu_s() - cpu_before
    output = log_path.read_text()
    if rc != 0:
        tail = output.splitlines()[-20:]
        sys.exit(f"{job.name} failed (exit status {rc}); the end of {log_path}:\n" + "\n".join(tail))
    result = None
    for line in output.splitlines():
        # psld launch prefixes each line with who printed it.
        if '{"backend"' in line:
            result = json.loads(line[line.index("{"):])
    if result is None:
        sys.exit(f"{job.name} printed no result line; see {log_path}")
    result["cpu_s"] = round(cpu_s, 2)
    result["job_wall_s"] = round(wall_s, 2)
    return result


def ratio(jobs, num, den):
    if num not in jobs or den not in jobs:
        return None
    return jobs[num].median("rounds_per_s") / jobs[den].median("rounds_per_s")


def write_markdown(path, jobs, args, meta):
    by_name = {j.name: j for j in jobs}
    lines = [
        "# psld.torch against DDP over gloo: Fashion-MNIST CNN",
        "",
        f"Written by `examples/fashion_mnist/bench.py` ({meta['date']}, commit {meta['commit']}, "
        f"{meta['cpus']} CPUs, load average {meta['load']} at the start and {meta['load_end']} at "
        f"the end; torch {meta['torch']}, {meta['psld']}).",
        "",
        f"`examples/fashion_mnist/train.py`: a CNN of 281k parameters (1.1 MB of float32 "
        f"gradient per round), {args.workers} workers of one thread each, batch 64 per worker, "
        f"SGD with momentum; {meta['length']} per job. The psld jobs run under `psld launch -w "
        f"{args.workers} -s {args.servers}` with `server.mode=sum` (the servers sum the "
        f"gradients, each worker's `psld.torch.DistributedOptimizer` averages them and steps "
        f"its optimizer) and `data.chunk_bytes={args.chunk_bytes}`; the straggler is server 0 "
        f"behind a {args.slow_rate}B/s emulated link (`--slow-server 0:{args.slow_rate}`), the "
        f"balancer plans every {args.balancer_interval_ms} ms when on. The jobs ran one after "
        f"another, {args.reps} time(s) each in turn, on this one shared machine: compare the "
        f"ratios within this run, not absolute numbers across runs.",
        "",
        "CPU is the user + system seconds of all the job's processes (workers, and for psld "
        "the servers and the launcher's coordinator), start-up and the test included.",
        "",
        "| job | rounds/s (median) | each rep | test accuracy | CPU s | CPU s per round | wall s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for j in jobs:
        reps = ", ".join(f"{r['rounds_per_s']:.2f}" for r in j.runs)
        cpu = j.median("cpu_s")
        lines.append(
            f"| {j.title} | {j.median('rounds_per_s'):.2f} | {reps} | "
            f"{j.median('test_accuracy'):.4f} | {cpu:.1f} | {cpu / j.runs[0]['rounds']:.3f} | "
            f"{j.median('job_wall_s'):.1f} |")
    lines += ["", "| ratio (medians of rounds/s) | measured | target | met |",
              "| --- | ---: | ---: | --- |"]
    for label, num, den, target in (
            ("psld.torch / DDP, no straggler", "psld", "ddp", TARGET_PSLD_OVER_DDP),
            ("straggler: balancer on / off", "psld-balancer", "psld-straggler",
             TARGET_BALANCER_ON_OVER_OFF)):
        r = ratio(by_name, num, den)
        if r is not None:
            lines.append(f"| {label} | {r:.2f}x | {target:.1f}x | {'yes' if r >= target else 'no'} |")
    lines += ["", "![rounds/s of each job, and worker 0's loss against training time]"
              "(python-results.png)", "",
              f"Command: `{meta['command']}`", ""]
    path.write_text("\n".join(lines))


def write_plot(png, jobs, tmp):
    """Bars of the median rounds/s, and the first rep's loss curves, with gnuplot."""
    gnuplot = shutil.which("gnuplot")
    if gnuplot is None:
        print("gnuplot not found (Debian: gnuplot-nox): no plot", file=sys.stderr)
        return False
    bars = tmp / "bars.dat"
    bars.write_text("".join(f'{i} "{j.name}" {j.median("rounds_per_s")}\n'
                            for i, j in enumerate(jobs)))
    curves = []
    for j in jobs:
        data = tmp / f"{j.name}.dat"
        data.write_text("".join(f"{t} {loss}\n" for t, _, loss in j.runs[0]["curve"]))
        curves.append(f'"{data}" using 1:2 with linespoints title "{j.name}"')
    script = tmp / "plot.gp"
    script.write_text("\n".join([
        "set terminal pngcairo size 1200,450 noenhanced" if _has_cairo(gnuplot)
        else "set terminal png size 1200,450 noenhanced",
        f'set output "{png}"',
        "set multiplot layout 1,2",
        'set title "rounds/s (median over reps)"',
        "set style fill solid 0.6", "set boxwidth 0.6", "set yrange [0:*]", "set grid ytics",
        "unset key", f"set xrange [-0.6:{len(jobs) - 0.4}]",
        f'plot "{bars}" using 1:3:xtic(2) with boxes',
        'set title "loss of worker 0 (mean per 25 rounds), first rep"',
        'set xlabel "seconds of training"', "set key top right", "set autoscale x", "set autoscale y",
        "plot " + ", ".join(curves),
        "unset multiplot", ""]))
    subprocess.run([gnuplot, str(script)], check=True, timeout=60)
    return True


def _has_cairo(gnuplot):
    out = subprocess.run([gnuplot, "-e", "set terminal"], capture_output=True, text=True,
                         timeout=30)
    return "pngcairo" in out.stdout + out.stderr


def psld_version():
    """Which psld package the workers import (they inherit this environment)."""
    out = subprocess.run([sys.executable, "-c", "import psld, psld.torch; "
                          "print(psld.__version__, psld.torch.__file__)"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return "psld not importable"
    version, path = out.stdout.split()
    return f"psld {version} (psld.torch from {path})"


def main():
    args = parse_args()
    jobs = [j for j in JOBS if j.name in args.jobs]
    psld = find_psld(args) if any(j.backend == "psld" for j in jobs) else None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="psld-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    import torch
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip() or "unknown",
        "cpus": os.cpu_count(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "torch": torch.__version__,
        "psld": psld_version(),
        "length": f"{args.rounds} rounds" if args.rounds else f"{args.epochs:g} epochs",
        "command": " ".join(["python", "examples/fashion_mnist/bench.py"] + sys.argv[1:]),
    }
    print(f"logs in {log_dir}", flush=True)
    for rep in range(1, args.reps + 1):
        for job in jobs:
            result = run_job(job, args, psld, log_dir / f"{job.name}-{rep}.log")
            job.runs.append(result)
            print(f"rep {rep}/{args.reps} {job.name:15s} {result['rounds_per_s']:7.2f} rounds/s  "
                  f"accuracy {result['test_accuracy']:.4f}  cpu {result['cpu_s']:6.1f} s  "
                  f"wall {result['job_wall_s']:6.1f} s", flush=True)
    meta["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "python-results.md"
    write_markdown(md, jobs, args, meta)
    with tempfile.TemporaryDirectory() as tmp:
        write_plot(args.out / "python-results.png", jobs, Path(tmp))
    (log_dir / "results.json").write_text(json.dumps([{"job": j.name, "runs": j.runs} for j in jobs]))
    print(f"wrote {md} and {args.out / 'python-results.png'}")


if __name__ == "__main__":
    main()
