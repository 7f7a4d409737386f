"""The worker program of tests/python/test_torch.py, run under `psld launch`.

    python torch_job.py MODE OUTDIR

MODE is one of the jobs below; each worker writes what the test checks to
OUTDIR/MODE.RANK.json. Everything is deterministic: the models are built from
fixed seeds (a different one per rank, so that a missing broadcast shows) and
worker r trains on batch (step, r) of one fixed data set.
"""

import json
import os
import signal
import sys
import time

import torch

import psld
import psld.torch as pt

STEPS = 20
BATCH = 8
IN, HIDDEN, OUT = 8, 16, 3


def make_model(seed, depth=2, width=HIDDEN):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(IN, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(width, OUT))
    return torch.nn.Sequential(*layers)


def dataset(workers):
    """Inputs and the labels a fixed linear teacher gives them: learnable, so
    the loss falls."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * workers * BATCH, IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def batch(data, step, rank, workers):
    x, y = data
    start = (step * workers + rank) * BATCH
    return x[start:start + BATCH], y[start:start + BATCH]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def train(model, opt, data, rank, workers, sched=None, apply=None):
    """STEPS steps; `apply` (default opt.step) applies the gradients."""
    losses = []
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = batch(data, step, rank, workers)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        (apply or opt.step)()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def write(outdir, mode, rank, result):
    path = os.path.join(outdir, f"{mode}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def ddp_model(seed):
    # DDP's first iteration has one bucket; then it rebuilds them, the first
    # up to _DEFAULT_FIRST_BUCKET_BYTES and the others up to bucket_cap_mb:
    # about 400 bytes each makes several of this model.
    import torch.distributed as dist
    dist._DEFAULT_FIRST_BUCKET_BYTES = 400
    return torch.nn.parallel.DistributedDataParallel(make_model(seed), bucket_cap_mb=0.0004)


def equivalence(w, outdir):
    """4 workers, server.mode=sum: DDP over gloo, psld.torch, DDP with the
    psld comm hook, the float16 and bfloat16 wire, the overlap trace and the
    broadcasts."""
    import torch.distributed as dist
    rank, workers = w.rank, w.num_workers
    data = dataset(workers)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['TORCH_JOB_GLOO_PORT']}",
                            rank=rank, world_size=workers)
    result = {}

    model = ddp_model(100 + rank)
    opt = sgd(model.parameters())
    result["ddp"] = train(model, opt, data, rank, workers, torch.optim.lr_scheduler.StepLR(opt, 7, 0.5))

    model = ddp_model(100 + rank)
    state = pt.CommHookState(w)
    model.register_comm_hook(state, pt.comm_hook)
    opt = sgd(model.parameters())
    result["comm_hook"] = train(model, opt, data, rank, workers,
                                torch.optim.lr_scheduler.StepLR(opt, 7, 0.5))
    result["comm_hook_buckets"] = len(state.registered)
    result["ddp_buckets"] = len({name.split(".")[-3] for name in state.registered})
    state.close()

    def psld_run(name, **kwargs):
        model = make_model(100 + rank)
        pt.broadcast_parameters(model.state_dict(), root_rank=0, worker=w)
        opt = pt.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), worker=w,
                                      name=name, **kwargs)
        losses = train(model, opt, data, rank, workers, torch.optim.lr_scheduler.StepLR(opt, 7, 0.5))
        return losses, opt

    result["psld"], opt = psld_run("sum", bucket_bytes=256)
    result["psld_buckets"] = opt.stats["buckets"]
    result["psld_lr_after"] = opt.param_groups[0]["lr"]
    result["psld_fp16"], _ = psld_run("fp16", wire_dtype="float16")
    result["psld_bf16"], _ = psld_run("bf16", wire_dtype="bfloat16")

    # Gradient clipping on the averaged gradients: DDP's are averaged when
    # backward returns; psld.torch's after synchronize().
    def clipped(opt, model, psld_opt):
        def apply():
            if psld_opt:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if psld_opt:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        return apply

    model = ddp_model(100 + rank)
    opt = sgd(model.parameters())
    result["ddp_clip"] = train(model, opt, data, rank, workers, apply=clipped(opt, model, False))
    model = make_model(100 + rank)
    pt.broadcast_parameters(model.state_dict(), worker=w)
    opt = pt.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), worker=w,
                                  name="clip")
    result["psld_clip"] = train(model, opt, data, rank, workers, apply=clipped(opt, model, True))

    # Unused parameters: a second head that worker r uses only in steps where
    # (step + r) is even, and a third never used; gradients set to None.
    torch.manual_seed(400)
    trunk, head_a, head_b, unused = (torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT),
                                     torch.nn.Linear(HIDDEN, OUT), torch.nn.Linear(HIDDEN, OUT))
    modules = torch.nn.ModuleList([trunk, head_a, head_b, unused])
    opt = pt.DistributedOptimizer(sgd(modules.parameters()), modules.named_parameters(), worker=w,
                                  name="unused", timeout=20)
    for step in range(6):
        x, y = batch(data, step, rank, workers)
        opt.zero_grad(set_to_none=True)
        h = torch.tanh(trunk(x))
        out = head_a(h) + (head_b(h) if (step + rank) % 2 == 0 else 0)
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
    result["unused"] = torch.cat([p.detach().reshape(-1) for p in modules.parameters()]).tolist()

    # Two backward passes of half batches with the loss halved, one step:
    # the same update as one pass over the whole batch.
    finals = []
    for passes in (1, 2):
        model = make_model(500)
        opt = pt.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), worker=w,
                                      name=f"accumulate{passes}", backward_passes_per_step=passes)
        for step in range(5):
            x, y = batch(data, step, rank, workers)
            opt.zero_grad()
            for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
                (torch.nn.functional.cross_entropy(model(xs), ys) / passes).backward()
            opt.step()
        finals.append(flat(model))
    result["accumulate_max_abs_diff"] = float((finals[0] - finals[1]).abs().max())

    # Overlap: six layers, one bucket per weight; when does the first go out?
    model = make_model(200, depth=5, width=64)
    pt.broadcast_parameters(model.state_dict(), worker=w)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  model.named_parameters(), worker=w, name="overlap",
                                  bucket_bytes=64 * 64 * 4, trace=True)
    rounds = []
    x = torch.randn(256, IN)
    y = torch.randint(0, OUT, (256,))
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        pushes = [t for t, event, _ in opt.trace if event == "push"]
        done = [t for t, event, _ in opt.trace if event == "done"]
        opt.step()
        rounds.append({"backward_began": began, "backward_ended": ended, "pushes": pushes,
                       "done_during_backward": len(done)})
    result["overlap"] = {"buckets": opt.stats["buckets"], "rounds": rounds}

    # Broadcasts of any dtype and of optimizer state.
    values = {"f64": torch.full((3,), 1.0 / 3 + rank, dtype=torch.float64),
              "i64": torch.tensor([2**62 + rank, -rank], dtype=torch.int64),
              "mask": torch.tensor([rank % 2 == 0, True, False]),
              "odd": torch.arange(5, dtype=torch.uint8) + rank}
    pt.broadcast_parameters(values, root_rank=2, worker=w)
    model = make_model(300 + rank)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    model(torch.randn(4, IN)).sum().backward()
    adam.step()
    pt.broadcast_optimizer_state(adam, root_rank=1, worker=w)
    s = adam.state_dict()
    result["broadcast"] = {
        "f64": values["f64"].tolist(), "i64": values["i64"].tolist(),
        "mask": values["mask"].tolist(), "odd": values["odd"].tolist(),
        "adam_lr": s["param_groups"][0]["lr"],
        "adam_step": float(s["state"][0]["step"]),
        "adam_exp_avg": s["state"][0]["exp_avg"].reshape(-1)[:4].tolist(),
        "object": pt.broadcast_object({"rank": rank, "text": "x" * 10}, root_rank=3, worker=w),
    }
    try:
        pt.broadcast_parameters(make_model(1 + rank, depth=1 + rank % 2).state_dict(), worker=w)
        result["broadcast"]["mismatch"] = "no error"
    except psld.InvalidArgument as e:
        result["broadcast"]["mismatch"] = "InvalidArgument: " + str(e)
    dist.destroy_process_group()
    write(outdir, "equivalence", rank, result)


def optimizer_mode(w, outdir):
    """2 workers, server.mode=optimizer, optimizer.kind=sgd; the wrapped SGD's lr 0.1, halved
    every 7 steps by StepLR, drives the servers (whose own optimizer.lr is another)."""
    rank, workers = w.rank, w.num_workers
    data = dataset(workers)
    model = make_model(100 + rank)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                  worker=w, bucket_bytes=512)
    result = {"initial_is_worker0s": bool(torch.equal(flat(model), flat(make_model(100))))}
    result["losses"] = train(model, opt, data, rank, workers, torch.optim.lr_scheduler.StepLR(opt, 7, 0.5))
    result["params"] = flat(model).tolist()

    # The same training on one process: SGD on the mean gradient of all workers' batches.
    ref = make_model(100)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        grads = []
        for r in range(workers):
            ref.zero_grad()
            x, y = batch(data, step, r, workers)
            loss_fn(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * 0.5 ** (step // 7) * sum(g[i] for g in grads) / workers
    result["reference_max_abs_diff"] = float((flat(ref) - flat(model)).abs().max())

    # One lr for every group: a second rate is refused, with a reason, by step().
    opt.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5})
    x, y = batch(data, 0, rank, workers)
    try:
        opt.zero_grad()
        torch.nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        result["two_rates"] = "no error"
    except psld.InvalidArgument as e:
        result["two_rates"] = "InvalidArgument: " + str(e)

    buffers = {"running": torch.full((4,), float(rank))}
    pt.broadcast_parameters(buffers, worker=w)
    result["broadcast"] = buffers["running"].tolist()
    write(outdir, "optimizer", rank, result)


def failure(w, outdir):
    """2 workers, 1 server. At step 3 worker 1 holds back its backward pass
    until the test has killed the server; worker 0 meanwhile waits in
    step() (BSP). Both must get a psld exception from step(), not hang."""
    # psld launch stops the workers with SIGTERM once the server died; this
    # job wants to see what step() raises first (launch kills it 5 s later).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank, workers = w.rank, w.num_workers
    data = dataset(workers)
    model = make_model(100)
    opt = pt.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), worker=w)
    loss_fn = torch.nn.CrossEntropyLoss()
    result = {}

    def mark(name):
        open(os.path.join(outdir, f"{name}.{rank}"), "w").close()

    def wait_for(name, seconds=30):
        deadline = time.monotonic() + seconds
        while not os.path.exists(os.path.join(outdir, name)):
            if time.monotonic() > deadline:
                raise SystemExit(f"worker {rank}: {name} never came")
            time.sleep(0.01)

    for step in range(10):
        x, y = batch(data, step, rank, workers)
        opt.zero_grad()
        if step == 3 and rank == 1:
            mark("ready")
            wait_for("go")
        loss_fn(model(x), y).backward()
        if step == 3 and rank == 0:
            try:
                opt.step(timeout=0.5)
                result["timeout"] = "no error"
            except psld.Timeout as e:
                result["timeout"] = "Timeout: " + str(e)
            mark("ready")
        began = time.monotonic()
        try:
            opt.step()
        except psld.Error as e:
            result["error"] = f"{type(e).__name__}: {e}"
            result["seconds"] = time.monotonic() - began
            break
    else:
        result["error"] = "no error"
    write(outdir, "failure", rank, result)
    sys.stdout.flush()
    os._exit(0)  # the job is gone: shutting the worker down has no one to tell


def main():
    torch.set_num_threads(1)
    mode, outdir = sys.argv[1], sys.argv[2]
    jobs = {"equivalence": equivalence, "optimizer": optimizer_mode, "failure": failure}
    with psld.Worker() as w:
        jobs[mode](w, outdir)


if __name__ == "__main__":
    main()
