#!/usr/bin/env python3
"""Train a small CNN on Fashion-MNIST, data-parallel, with psld or with torch DDP.

Every worker trains the same model (same seed) on its own shard of the
training set, one batch per round; the gradients are averaged across workers
each round, by psld's servers (psld.torch.DistributedOptimizer, server.mode=sum)
or by a gloo all-reduce (DistributedDataParallel). Worker 0 prints progress
every --log-every rounds and, at the end, one JSON line (rounds/s, test
accuracy, wall time, its loss curve) that bench.py reads.

    # psld: 4 workers, 2 servers; the servers only sum the gradients
    PSLD_SERVER_MODE=sum psld launch -w 4 -s 2 -- python train.py --backend psld
    # torch DistributedDataParallel over gloo: the script starts its 4 processes
    python train.py --backend ddp --workers 4
"""

import argparse
import datetime
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

START = time.monotonic()

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530  # over the 60000 training images, pixels in [0, 1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["psld", "ddp"], required=True)
    p.add_argument("--workers", type=int, default=4,
                   help="ddp only: processes to start (under psld launch, -w says it)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--rounds", type=int, help="rounds to train (default 100)")
    length.add_argument("--epochs", type=float,
                        help="epochs to train: each worker passes over its shard this many times")
    p.add_argument("--batch", type=int, default=64, help="images per worker per round")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--bucket-bytes", type=int, default=4 << 20,
                   help="psld.torch's gradient buckets (bytes): smaller ones start their push_pull "
                        "earlier in backward")
    p.add_argument("--seed", type=int, default=0, help="the model's seed, the same on every worker")
    p.add_argument("--log-every", type=int, default=25, help="rounds between progress lines")
    p.add_argument("--data", type=Path, default=DATA_DIR,
                   help="folder of the *-idx?-ubyte.gz files (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120,
                   help="ddp only: seconds the processes wait for each other to start")
    args = p.parse_args(argv)
    if args.rounds is None and args.epochs is None:
        args.rounds = 100
    for name in ("workers", "batch", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.epochs is not None and args.epochs <= 0:
        p.error("--epochs must be positive")
    return args


def read_idx(path):
    """An IDX file (gzip'd) as a numpy array: images (n, rows, cols) or labels (n,), uint8."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        sys.exit(f"{path} not found: install Debian's dataset-fashion-mnist or pass --data")
    # Header: two zero bytes, the element type (0x08: unsigned byte), the number
    # of dimensions, then each dimension as a big-endian uint32.
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        sys.exit(f"{path} is not an IDX file of unsigned bytes")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    body = 4 + 4 * ndim
    if len(data) - body != int(np.prod(dims)):
        sys.exit(f"{path}: {len(data) - body} bytes of data, the header says {tuple(dims)}")
    return np.frombuffer(data, dtype=np.uint8, offset=body).reshape(dims)


def load_split(data_dir, split):
    """Images as float32 (n, 1, 28, 28) and labels as int64, for "train" or "t10k"."""
    images = read_idx(data_dir / f"{split}-images-idx3-ubyte.gz")
    labels = read_idx(data_dir / f"{split}-labels-idx1-ubyte.gz")
    if len(images) != len(labels):
        sys.exit(f"{data_dir}: {len(images)} {split} images but {len(labels)} labels")
    # Centred and scaled by the training set's mean and standard deviation of a pixel.
    x = torch.from_numpy((images.astype(np.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD).unsqueeze(1)
    return x, torch.from_numpy(labels.astype(np.int64))


def make_model(seed):
    """The CNN: 281k parameters (1.1 MB of float32 gradient per round), most in the
    first fully connected layer. The convolutions set the compute of a round;
    the wide layer makes the gradient exchange a visible part of it, so that a
    slow server shows (with 512 -> 256 the straggler's cost was half as large)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 12 x 12
        nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 4 x 4
        nn.Flatten(),
        nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )


class Shard:
    """This worker's part of the training set, reshuffled each epoch, one batch per round.

    Every worker gets the same number of batches per epoch, since each round
    waits for all of them."""

    def __init__(self, x, y, rank, num_workers, batch, seed):
        per_worker = len(x) // num_workers
        if per_worker < batch:
            sys.exit(f"{len(x)} images make shards of {per_worker}, fewer than --batch {batch}")
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        mine = order[rank * per_worker:(rank + 1) * per_worker]
        self.x, self.y = x[mine], y[mine]
        self.batch = batch
        self.rounds_per_epoch = per_worker // batch
        self.generator = torch.Generator().manual_seed(seed + 1 + rank)
        self.order, self.next = None, self.rounds_per_epoch

    def next_batch(self):
        if self.next == self.rounds_per_epoch:
            self.order, self.next = torch.randperm(len(self.x), generator=self.generator), 0
        idx = self.order[self.next * self.batch:(self.next + 1) * self.batch]
        self.next += 1
        return self.x[idx], self.y[idx]


@torch.no_grad()
def accuracy(model, x, y):
    model.eval()
    correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                  for i in range(0, len(x), 1000))
    model.train()
    return correct / len(x)


def train(args, rank, num_workers, model, optimizer):
    """The training loop, the same for both backends: `model` and `optimizer`
    are already wrapped by the backend. Worker 0 prints; returns its result."""
    x, y = load_split(args.data, "train")
    shard = Shard(x, y, rank, num_workers, args.batch, args.seed)
    rounds = args.rounds or max(1, round(args.epochs * shard.rounds_per_epoch))
    if rank == 0:
        print(f"{args.backend}: {num_workers} workers, batch {args.batch} each, {rounds} rounds "
              f"({rounds / shard.rounds_per_epoch:.2f} epochs of {shard.rounds_per_epoch} rounds)",
              flush=True)

    curve = []  # (seconds since training began, round, worker 0's mean loss over the interval)
    losses = []
    began = last = time.monotonic()
    for r in range(1, rounds + 1):
        images, labels = shard.next_batch()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if r % args.log_every == 0 or r == rounds:
            now = time.monotonic()
            mean = sum(losses) / len(losses)
            curve.append((round(now - began, 3), r, round(mean, 4)))
            if rank == 0:
                print(f"round {r:5d}  loss {mean:.4f}  rounds/s {len(losses) / (now - last):7.2f}",
                      flush=True)
            losses, last = [], now
    train_s = time.monotonic() - began

    if rank != 0:
        return None
    x_test, y_test = load_split(args.data, "t10k")
    result = {
        "backend": args.backend,
        "workers": num_workers,
        "batch": args.batch,
        "rounds": rounds,
        "train_s": round(train_s, 3),
        "rounds_per_s": round(rounds / train_s, 3),
        "images_per_s": round(rounds * args.batch * num_workers / train_s, 1),
        "final_loss": curve[-1][2],
        "test_accuracy": round(accuracy(model, x_test, y_test), 4),
        "wall_s": round(time.monotonic() - START, 3),
        "curve": curve,
    }
    print(json.dumps(result), flush=True)
    return result


def run_psld(args):
    """One worker of a psld job: psld launch started this process and says its rank."""
    import psld
    import psld.torch

    with psld.Worker() as worker:
        # DistributedOptimizer averages the sums the servers return; in
        # server.mode=optimizer they would return parameters instead.
        mode = worker.config["server.mode"]
        if mode != "sum":
            sys.exit(f"server.mode is {mode!r}: run the job with PSLD_SERVER_MODE=sum, "
                     "so that the servers sum the gradients and each worker steps its optimizer")
        model = make_model(args.seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        optimizer = psld.torch.DistributedOptimizer(optimizer, model.named_parameters(),
                                                    worker=worker, bucket_bytes=args.bucket_bytes)
        psld.torch.broadcast_parameters(model.state_dict(), root_rank=0, worker=worker)
        train(args, worker.rank, worker.num_workers, model, optimizer)


def ddp_worker(rank, args, store_path):
    """One of the processes run_ddp starts."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=args.workers,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        model = DistributedDataParallel(make_model(args.seed))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        train(args, rank, args.workers, model, optimizer)
    finally:
        dist.destroy_process_group()


def run_ddp(args):
    """Starts --workers processes that meet through a file store (no port to pick)
    and all-reduce over gloo on the loopback interface."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="ddp-store-") as tmp:
        # spawn, not fork: each process starts clean, as a launcher's would.
        # join raises when one fails, after stopping the others.
        mp.spawn(ddp_worker, args=(args, os.path.join(tmp, "store")), nprocs=args.workers,
                 join=True)


def main():
    args = parse_args()
    # One thread per worker: the workers (and psld's servers) share the cores.
    torch.set_num_threads(1)
    if args.backend == "psld":
        run_psld(args)
    else:
        run_ddp(args)


if __name__ == "__main__":
    main()
