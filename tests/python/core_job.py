"""A worker of the jobs tests/python/test_core.py launches (psld launch ... --
python core_job.py MODE OUTDIR). Writes OUTDIR/MODE.RANK.json."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

import psld


def sums(w: psld.Worker) -> dict:
    """20 rounds of push_pull on four kinds of memory; every sum is of small
    integers, so exact in float32 (and float16 below 2048)."""
    n, k = w.num_workers, w.rank + 1
    tensors = {
        "numpy": np.zeros(1000, dtype=np.float32),  # malloc'd, a few bytes: one chunk
        "torch": torch.zeros(300_000),  # 1.2 MB: several chunks, on both servers
        "transport": w.zeros(70_000, like="torch"),  # from w.allocate
        "fp16": np.zeros(4096, dtype=np.float16),
    }
    pattern = {name: (np.arange(len(t)) % 7).astype(np.float32) for name, t in tensors.items()}
    handles = {name: w.register(name, t) for name, t in tensors.items()}

    def address(t):
        return t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()

    before = {name: address(t) for name, t in tensors.items()}
    wrong = []
    for rnd in range(1, 21):
        for name, t in tensors.items():
            value = pattern[name] * k * rnd + k
            if isinstance(t, np.ndarray):
                t[:] = value
            else:
                t.copy_(torch.from_numpy(value))
        requests = [w.push_pull(h) for h in handles.values()]
        for r in requests:
            r.wait(30)
        total_k = n * (n + 1) // 2
        for name, t in tensors.items():
            want = pattern[name] * total_k * rnd + total_k
            got = t if isinstance(t, np.ndarray) else t.numpy()
            if not np.array_equal(got.astype(np.float32), want):
                bad = int(np.flatnonzero(got.astype(np.float32) != want)[0])
                wrong.append(f"round {rnd} {name}[{bad}] = {got[bad]}, want {want[bad]}")
    after = {name: address(t) for name, t in tensors.items()}
    return {"wrong": wrong[:5], "same_memory": before == after, "rounds": 20}


def main() -> None:
    mode, outdir = sys.argv[1], Path(sys.argv[2])
    with psld.Worker() as w:
        result = {"sums": sums}[mode](w)
        result["rank"] = w.rank
        result["launcher"] = w.config.launcher
        w.barrier(30)
    (outdir / f"{mode}.{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
