"""psld.torch: data-parallel PyTorch training over psld.

Three ways in, in the manner of Horovod and BytePS:

- :class:`DistributedOptimizer` wraps a ``torch.optim.Optimizer``. Hooks on
  the parameters start a push_pull as soon as a bucket of gradients is ready
  during ``backward()``, so communication overlaps the rest of the backward
  pass; ``step()`` waits for what is in flight, writes the results back and
  (``server.mode=sum``) runs the wrapped optimizer on the averaged gradients.
- :func:`comm_hook` with a :class:`CommHookState`: a communication hook for
  ``torch.nn.parallel.DistributedDataParallel`` that push_pulls DDP's own
  gradient buckets through psld instead of an allreduce.
- :func:`broadcast_parameters`, :func:`broadcast_optimizer_state` and
  :func:`broadcast_object`: give every worker the root's values at start.

Every call takes ``worker=``, a :class:`psld.Worker`; without one the default
worker of :func:`init` is used (created on first use from the environment,
as under ``psld launch``).

Errors are psld exceptions (``psld.Error`` subclasses) with psld's message;
usage mistakes are ``ValueError``/``TypeError``/``RuntimeError`` as torch
raises them. The guide is docs/python.md, section "psld.torch".
"""

from __future__ import annotations

import atexit
import hashlib
import io
import queue
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

import psld

__all__ = [
    "init",
    "shutdown",
    "DistributedOptimizer",
    "CommHookState",
    "comm_hook",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
]

# --- the default worker -----------------------------------------------------

_default_worker: Optional[psld.Worker] = None
_default_lock = threading.Lock()


def init(config: Any = None, *, args: Optional[Iterable[str]] = None, **settings: Any) -> psld.Worker:
    """Joins the job as this process's default worker (once) and returns it.

    Takes what :class:`psld.Worker` takes; under ``psld launch`` no argument
    is needed. Later calls return the same worker. It is shut down at exit,
    or by :func:`shutdown`.
    """
    global _default_worker
    with _default_lock:
        if _default_worker is None:
            _default_worker = psld.Worker(config, args=args, **settings)
            atexit.register(shutdown)
        return _default_worker


def shutdown() -> None:
    """Shuts the default worker down (if :func:`init` made one). Idempotent."""
    global _default_worker
    with _default_lock:
        worker, _default_worker = _default_worker, None
    if worker is not None:
        worker.shutdown()


def _worker(worker: Optional[psld.Worker]) -> psld.Worker:
    if worker is not None:
        if not isinstance(worker, psld.Worker):
            raise TypeError(f"worker must be a psld.Worker, not {type(worker).__name__}")
        return worker
    return init()


# --- dtypes -----------------------------------------------------------------

# The dtypes psld carries, by the name psld.Worker.zeros takes.
_WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _wire_dtype(wire_dtype: Union[None, str, torch.dtype], param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of ``param_dtype`` travels in."""
    if wire_dtype is None:
        if param_dtype in _WIRE_DTYPES.values():
            return param_dtype
        if param_dtype == torch.float64:
            return torch.float32  # psld carries no float64: documented as lossy
        raise TypeError(f"psld.torch: parameters of dtype {param_dtype} cannot be trained "
                        "(psld carries float32, float16 and bfloat16)")
    if isinstance(wire_dtype, str):
        if wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {', '.join(_WIRE_DTYPES)} or None, "
                             f"not {wire_dtype!r}")
        return _WIRE_DTYPES[wire_dtype]
    if wire_dtype in _WIRE_DTYPES.values():
        return wire_dtype
    raise ValueError(f"wire_dtype must be one of {', '.join(_WIRE_DTYPES)} or None, not {wire_dtype!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _communication_buffer(worker: psld.Worker, numel: int, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """Zeroed memory to register: the transport's own for host tensors (pulls
    into it are one memcpy on the same host), the device's for CUDA ones
    (psld registers CUDA memory, direct or staged)."""
    if device.type == "cuda":
        return torch.zeros(numel, dtype=dtype, device=device)
    if device.type != "cpu":
        raise TypeError(f"psld.torch: tensors on {device} are not supported (cpu or cuda)")
    return worker.zeros(numel, _dtype_name(dtype), like="torch")


def _ready_for_transport(device: torch.device) -> None:
    """Makes the writes queued on the current CUDA stream (gradients, and the
    copies into a bucket) finish before psld reads the memory. psld reads
    CUDA memory outside torch's streams, so nothing orders it otherwise."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()


def _server_mode(worker: psld.Worker) -> str:
    return worker.config["server.mode"]


def _require_sum_bsp(worker: psld.Worker, what: str) -> None:
    """``what`` averages sums of one round: that needs server.mode=sum with BSP."""
    mode, sync = worker.config["server.mode"], worker.config["data.sync"]
    if mode == "sum" and sync != "bsp":
        raise psld.FailedPrecondition(
            f"{what} needs data.sync=bsp with server.mode=sum (it is {sync!r}): with async or "
            "staleness a push_pull returns a running total, not the sum of one round")


# --- DistributedOptimizer ---------------------------------------------------

class _Bucket:
    """Gradients of a few parameters, packed into one registered psld tensor."""

    __slots__ = ("index", "name", "params", "names", "offsets", "numels", "buffer", "device",
                 "dtype", "handle", "pending", "request", "error")

    def __init__(self, index: int, name: str, device: torch.device, dtype: torch.dtype):
        self.index, self.name, self.device, self.dtype = index, name, device, dtype
        self.params: List[torch.nn.Parameter] = []
        self.names: List[str] = []
        self.offsets: List[int] = []
        self.numels: List[int] = []
        self.buffer: Optional[torch.Tensor] = None
        self.handle: Optional[psld.Tensor] = None
        self.pending = 0      # parameters of this round not yet copied in
        self.request: Optional[psld.Request] = None
        self.error: Optional[BaseException] = None  # a push that could not be sent

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.params else 0

    def view(self, slot: int) -> torch.Tensor:
        return self.buffer[self.offsets[slot]:self.offsets[slot] + self.numels[slot]]


def _delegated(attribute: str) -> property:
    """An attribute of the wrapped optimizer, read and written through."""
    return property(lambda self: getattr(self._optimizer, attribute),
                    lambda self, value: setattr(self._optimizer, attribute, value),
                    doc=f"The wrapped optimizer's {attribute}.")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that every worker trains with the gradients of all.

    ``DistributedOptimizer(optimizer, named_parameters=None, *, worker=None,
    bucket_bytes=4 << 20, wire_dtype=None, average=True,
    backward_passes_per_step=1, name="psld.torch", timeout=None, trace=False)``

    The gradients of ``optimizer``'s parameters (those with requires_grad)
    are packed into buckets of up to ``bucket_bytes`` (in the wire dtype), in
    reverse parameter order, since backward produces the last layers'
    gradients first (as DDP does). Each bucket is one psld tensor, registered
    once as ``f"{name}.{index}"`` (the same on every worker, as long as every
    worker builds the same model: a different layout is an error at
    registration). When the last gradient of a bucket is in, the bucket's
    push_pull starts, while backward goes on.

    ``server.mode=sum`` (the worker's configuration): ``step()`` waits for
    the buckets, writes the average (``average=True``, the sum otherwise)
    into each ``p.grad`` and calls the wrapped optimizer's ``step()``.
    ``param_groups``, ``state``, ``state_dict()``, ``zero_grad()``... are the
    wrapped optimizer's, so LR schedulers work unchanged. Needs
    ``data.sync=bsp``.

    ``server.mode=optimizer``: the servers run ``optimizer.kind`` (with its
    momentum, betas, weight decay from the job's configuration) at the
    wrapped optimizer's learning rate: every round's pushes carry the
    ``lr`` its param_groups have when the round's first bucket leaves
    (``Worker.set_learning_rate``), so LR schedulers work unchanged; all
    groups must then share one ``lr``. The buckets start as worker 0's
    parameters (registered with ``init=True``; every worker then takes
    them), carry gradients up and parameters back, and ``step()`` writes the
    parameters; the wrapped optimizer's own update is not run.

    ``wire_dtype="float16"`` or ``"bfloat16"`` sends the gradients in that
    dtype (the servers accumulate in float32); the results come back into
    the parameters' dtype. ``backward_passes_per_step=k`` accumulates ``k``
    backward passes locally before a bucket is sent (their sum, as Horovod:
    scale the loss by 1/k for their mean). ``timeout`` (seconds) bounds the
    wait in ``step()``. ``trace=True`` records when each bucket was filled,
    sent and seen complete (:attr:`trace`, :attr:`last_trace`).

    A parameter whose gradient was not produced in a round (unused in that
    forward pass) still sends its bucket: BSP needs every worker to push
    every bucket each round. It contributes ``p.grad`` as it stands, zeros
    when None, and gets the round's result into ``p.grad`` like the others,
    so every worker's optimizer updates the same parameters.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *,
                 worker: Optional[psld.Worker] = None, bucket_bytes: int = 4 << 20,
                 wire_dtype: Union[None, str, torch.dtype] = None, average: bool = True,
                 backward_passes_per_step: int = 1, name: str = "psld.torch",
                 timeout: Optional[float] = None, trace: bool = False):
        # torch.optim.Optimizer.__init__ is not called: the state and the
        # parameter groups are the wrapped optimizer's, reached through the
        # properties below.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a psld.torch.DistributedOptimizer")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, not {bucket_bytes}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, not {timeout}")
        self._optimizer = optimizer
        self._worker = _worker(worker)
        self._mode = _server_mode(self._worker)
        if self._mode == "sum":
            _require_sum_bsp(self._worker, "DistributedOptimizer")
        self._average = bool(average)
        self._passes_per_step = int(backward_passes_per_step)
        self._timeout = timeout
        self._name = name
        self._scale = 1.0 / self._worker.num_workers if self._average else 1.0
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        self._failure: Optional[BaseException] = None
        self._synchronized = False
        self._sent_lr: Optional[float] = None  # optimizer mode: the rate the pushes carry
        self._step_count = 0

        params = self._trained_parameters(optimizer, named_parameters)
        self._buckets = self._make_buckets(params, int(bucket_bytes), wire_dtype)
        self._slot: Dict[int, Tuple[_Bucket, int]] = {}
        for bucket in self._buckets:
            for slot, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, slot)
        self._passes: Dict[int, int] = {id(p): 0 for _, p in params}

        self.trace_enabled = bool(trace)
        self.trace: List[Tuple[float, str, int]] = []       # this round: (perf_counter, event, bucket)
        self.last_trace: List[Tuple[float, str, int]] = []  # the round step() last finished
        self.stats = {"rounds": 0, "buckets": len(self._buckets),
                      "bytes_per_round": sum(b.buffer.numel() * b.buffer.element_size()
                                             for b in self._buckets),
                      "wait_seconds": 0.0}

        self._register()
        self._grad_accumulators = []  # the AccumulateGrad nodes: hooks live as long as they do
        self._hook_handles = []
        for _, p in params:
            self._hook(p)

    # -- setup

    @staticmethod
    def _trained_parameters(optimizer, named_parameters) -> List[Tuple[str, torch.Tensor]]:
        """(name, parameter) for every parameter with requires_grad, in the
        optimizer's order: the order every worker builds the same way."""
        names: Dict[int, str] = {}
        if named_parameters is not None:
            taken = set()
            for n, p in named_parameters:
                if id(p) in names:
                    continue  # shared parameters appear once
                if n in taken:
                    raise ValueError(f"named_parameters names {n!r} twice")
                names[id(p)] = n
                taken.add(n)
        seen = set()
        out = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) in seen or not p.requires_grad or p.numel() == 0:
                    continue
                seen.add(id(p))
                if named_parameters is not None and id(p) not in names:
                    raise ValueError(f"parameter {i} of parameter group {g} (shape {tuple(p.shape)}) "
                                     "is not in named_parameters: pass model.named_parameters() of "
                                     "the model the optimizer trains")
                out.append((names.get(id(p), f"group{g}.param{i}"), p))
        if not out:
            raise ValueError("the optimizer has no parameter that requires grad")
        return out

    def _make_buckets(self, params, bucket_bytes: int, wire_dtype) -> List[_Bucket]:
        buckets: List[_Bucket] = []
        current: Optional[_Bucket] = None
        current_key = None
        used = 0
        for n, p in reversed(params):
            if p.is_sparse:
                raise TypeError(f"parameter {n!r}: sparse parameters are not supported")
            dtype = _wire_dtype(wire_dtype, p.dtype)
            key = (p.device, dtype)
            nbytes = p.numel() * torch.empty((), dtype=dtype).element_size()
            if current is None or key != current_key or (used + nbytes > bucket_bytes and used > 0):
                current = _Bucket(len(buckets), f"{self._name}.{len(buckets)}", p.device, dtype)
                buckets.append(current)
                current_key, used = key, 0
            current.offsets.append(current.numel)
            current.params.append(p)
            current.names.append(n)
            current.numels.append(p.numel())
            used += nbytes
        for b in buckets:
            b.buffer = _communication_buffer(self._worker, b.numel, b.dtype, b.device)
            b.pending = len(b.params)
        return buckets

    def _register(self) -> None:
        init = self._mode == "optimizer"
        for b in self._buckets:
            if init:
                self._pack_parameters(b)
                _ready_for_transport(b.device)
            b.handle = self._worker.register(b.name, b.buffer, init=init)
        if init:
            # Worker 0's parameters are everyone's: wait until it registered
            # them, then take them.
            self._worker.barrier(self._timeout)
            requests = [self._worker.pull(b.handle) for b in self._buckets]
            for r in requests:
                r.wait(self._timeout)
            for b in self._buckets:
                self._unpack_parameters(b)
            kind = self._worker.config["optimizer.kind"]
            expected = {"sgd": "SGD", "momentum": "SGD", "adam": "Adam", "adamw": "AdamW"}.get(kind)
            if type(self._optimizer).__name__ != expected:
                import warnings
                warnings.warn(f"psld.torch: server.mode=optimizer: the servers run "
                              f"optimizer.kind={kind!r}, not the wrapped "
                              f"{type(self._optimizer).__name__} (only its lr is used)", stacklevel=3)

    @torch.no_grad()
    def _pack_parameters(self, b: _Bucket) -> None:
        for slot, p in enumerate(b.params):
            b.view(slot).copy_(p.reshape(-1))

    @torch.no_grad()
    def _unpack_parameters(self, b: _Bucket) -> None:
        for slot, p in enumerate(b.params):
            p.copy_(b.view(slot).view(p.shape))

    def _hook(self, p: torch.Tensor) -> None:
        # torch 1.13 has no Tensor.register_post_accumulate_grad_hook. The
        # AccumulateGrad node of a leaf runs once p.grad holds this pass's
        # gradient; a hook on it (not on p itself, whose hooks see the
        # gradient before it is accumulated) is where the gradient is final.
        # p.expand_as(p) is a view whose grad_fn leads to that node, as in
        # Horovod and BytePS. The node must be kept alive, or its hooks go.
        accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
        pid = id(p)
        self_ref = weakref.ref(self)

        def on_grad_ready(*_):
            opt = self_ref()
            if opt is not None:
                opt._on_grad_ready(pid)

        self._hook_handles.append(accumulator.register_hook(on_grad_ready))
        self._grad_accumulators.append(accumulator)

    # -- the data path

    def _on_grad_ready(self, pid: int) -> None:
        bucket, slot = self._slot[pid]
        with self._lock:
            passes = self._passes[pid] + 1
            if passes > self._passes_per_step:
                raise RuntimeError(
                    f"psld.torch: the gradient of {bucket.names[slot]!r} was computed "
                    f"{passes} times before step(); backward_passes_per_step is "
                    f"{self._passes_per_step} (call step(), or raise backward_passes_per_step)")
            self._passes[pid] = passes
            if passes < self._passes_per_step or self._failure is not None:
                return
            self._copy_in(bucket, slot)
            bucket.pending -= 1
            if self.trace_enabled:
                self._trace_completions()
            if bucket.pending == 0:
                self._launch(bucket)

    @torch.no_grad()
    def _copy_in(self, bucket: _Bucket, slot: int) -> None:
        """This round's gradient of one parameter into its bucket; divided by
        the number of workers before the cast, as DDP does, so a float16 wire
        carries the average's range rather than the sum's."""
        view, grad = bucket.view(slot), bucket.params[slot].grad
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise TypeError(f"psld.torch: the gradient of {bucket.names[slot]!r} is sparse; "
                            "sparse gradients are not supported")
        elif self._scale != 1.0:
            torch.mul(grad.reshape(-1), self._scale, out=view)
        else:
            view.copy_(grad.reshape(-1))

    def _launch(self, bucket: _Bucket) -> None:
        _ready_for_transport(bucket.device)
        try:
            if self._mode == "optimizer":
                self._carry_learning_rate()
            bucket.request = self._worker.push_pull(bucket.handle)
        except psld.Error as e:
            # Raised in step(), not in the middle of backward.
            bucket.error = e
        if self.trace_enabled:
            self.trace.append((time.perf_counter(), "push", bucket.index))

    def _trace_completions(self) -> None:
        for b in self._buckets:
            if b.request is not None and b.request.done() and \
                    not any(e == "done" and i == b.index for _, e, i in self.trace):
                self.trace.append((time.perf_counter(), "done", b.index))

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Sends the buckets not yet sent, waits for every bucket of this round
        and writes the results back (averaged gradients into ``p.grad``, or
        with server.mode=optimizer the new parameters). ``step()`` calls it;
        call it yourself to see the averaged gradients before ``step()`` (for
        clipping), then run ``step()`` inside :meth:`skip_synchronize`.

        ``timeout`` (seconds; default the optimizer's) bounds the wait: on
        ``psld.Timeout`` the round stays in flight and a later call goes on
        waiting. Any other error is the job's failure and is raised again by
        every later call.
        """
        if self._failure is not None:
            raise self._failure
        timeout = self._timeout if timeout is None else timeout
        with self._lock:
            for b in self._buckets:
                if b.request is None and b.error is None:
                    for slot, p in enumerate(b.params):
                        if self._passes[id(p)] < self._passes_per_step:
                            self._copy_in(b, slot)  # unused this round: what p.grad holds
                    self._launch(b)
        started = time.perf_counter()
        deadline = None if timeout is None else started + timeout
        try:
            for b in self._buckets:
                if b.error is not None:
                    raise b.error
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    b.request.wait(left)
                except psld.Timeout as e:
                    raise psld.Timeout(
                        f"psld.torch: bucket {b.name!r} ({', '.join(b.names[:3])}"
                        f"{', ...' if len(b.names) > 3 else ''}) not complete within {timeout} s; "
                        f"the round stays in flight: call step() or synchronize() again to wait "
                        f"on ({e})") from e
        except psld.Timeout:
            raise
        except psld.Error as e:
            self._failure = e
            raise
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - started
        self._finish_round()

    @torch.no_grad()
    def _finish_round(self) -> None:
        for b in self._buckets:
            if self._mode == "optimizer":
                self._unpack_parameters(b)
            else:
                for slot, p in enumerate(b.params):
                    result = b.view(slot).view(p.shape)
                    if p.grad is None:
                        p.grad = result.to(dtype=p.dtype, copy=True)
                    else:
                        p.grad.copy_(result)
            b.request, b.pending = None, len(b.params)
        for pid in self._passes:
            self._passes[pid] = 0
        if self.trace_enabled:
            self.last_trace, self.trace = self.trace, []
        self.stats["rounds"] += 1

    def skip_synchronize(self):
        """``with opt.skip_synchronize(): opt.step()`` after your own
        :meth:`synchronize`: step() then does not synchronize again."""
        opt = self

        class _Skip:
            def __enter__(self):
                opt._synchronized = True

            def __exit__(self, *exc):
                opt._synchronized = False

        return _Skip()

    def step(self, closure=None, *, timeout: Optional[float] = None):
        """Waits for this round (:meth:`synchronize`, with its ``timeout``),
        then with server.mode=sum runs the wrapped optimizer's step on the
        averaged gradients. With server.mode=optimizer the parameters are the
        servers' result and nothing else runs."""
        if closure is not None:
            raise NotImplementedError(
                "psld.torch.DistributedOptimizer.step(closure): a closure re-runs backward inside "
                "step, which would send a second round; compute the loss before step()")
        if not self._synchronized:
            self.synchronize(timeout)
        if self._mode == "optimizer":
            return None
        return self._optimizer.step()

    # -- learning rate

    def _carry_learning_rate(self) -> None:
        """Optimizer mode: the pushes from now on carry the wrapped optimizer's lr."""
        lrs = {g.get("lr") for g in self._optimizer.param_groups}
        if len(lrs) != 1 or None in lrs:
            raise psld.InvalidArgument(
                f"psld.torch: server.mode=optimizer updates every parameter at one learning rate, "
                f"but the param_groups have {sorted(lrs, key=str)}; give them one lr, or use "
                "server.mode=sum to run per-group rates locally")
        lr = float(lrs.pop())
        if lr != self._sent_lr:
            self._worker.set_learning_rate(lr)
            self._sent_lr = lr

    def set_learning_rate(self, lr: float) -> None:
        """Sets the learning rate of every parameter group (what a scheduler does); with
        server.mode=optimizer the servers use it from the next round on."""
        for g in self._optimizer.param_groups:
            g["lr"] = lr

    # -- what a torch.optim.Optimizer offers, delegated

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def worker(self) -> psld.Worker:
        return self._worker

    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False):
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        raise NotImplementedError(
            "psld.torch.DistributedOptimizer.add_param_group: the buckets are registered once "
            "with psld; add the group to the optimizer before wrapping it")

    def close(self) -> None:
        """Removes the gradient hooks: the parameters train locally again
        (the buckets stay registered until the worker shuts down)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._grad_accumulators.clear()

    def __getstate__(self):
        raise TypeError("a psld.torch.DistributedOptimizer holds a psld job; save state_dict() instead")

    def __repr__(self) -> str:
        return (f"psld.torch.DistributedOptimizer(server.mode={self._mode}, "
                f"buckets={len(self._buckets)}, {self._optimizer!r})")


# --- DDP communication hook -------------------------------------------------

class CommHookState:
    """The state of :func:`comm_hook`: ``ddp.register_comm_hook(CommHookState(worker), comm_hook)``.

    Each DDP gradient bucket is push_pulled through a psld tensor registered
    on first sight as ``f"{name}.{index}.{numel}.{dtype}"``: DDP rebuilds its
    buckets after the first iteration (and then makes every rank use rank
    0's layout), so a bucket is known by its index and size together. The
    tensors from the first layout stay registered until the worker shuts
    down. A waiter thread waits for each push_pull (without the GIL) and
    completes DDP's future, so backward goes on meanwhile.

    Needs ``server.mode=sum`` with ``data.sync=bsp``; ``average=True``
    divides by the number of workers (DDP's default allreduce does the
    same); ``wire_dtype`` as for :class:`DistributedOptimizer`; ``timeout``
    bounds each wait (seconds).
    """

    def __init__(self, worker: Optional[psld.Worker] = None, *, name: str = "psld.ddp",
                 wire_dtype: Union[None, str, torch.dtype] = None, average: bool = True,
                 timeout: Optional[float] = None):
        self.worker = _worker(worker)
        if _server_mode(self.worker) != "sum":
            raise psld.FailedPrecondition(
                "psld.torch.comm_hook needs server.mode=sum (the servers sum DDP's buckets; with "
                "server.mode=optimizer they would apply an optimizer to them)")
        _require_sum_bsp(self.worker, "psld.torch.comm_hook")
        self.name = name
        self.wire_dtype = wire_dtype
        self.timeout = timeout
        self.scale = 1.0 / self.worker.num_workers if average else 1.0
        self.registered: List[str] = []  # the names of the psld tensors registered so far
        self._tensors: Dict[Tuple[int, int, torch.dtype, torch.device], Tuple[torch.Tensor, psld.Tensor]] = {}
        # One entry per DDP bucket in flight: at most the buckets of one
        # iteration, since DDP waits for all of them before the next.
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._complete_futures, name="psld-comm-hook",
                                        daemon=True)
        self._thread.start()

    def _tensor(self, index: int, buffer: torch.Tensor) -> Tuple[torch.Tensor, psld.Tensor]:
        dtype = _wire_dtype(self.wire_dtype, buffer.dtype)
        key = (index, buffer.numel(), dtype, buffer.device)
        entry = self._tensors.get(key)
        if entry is None:
            memory = _communication_buffer(self.worker, buffer.numel(), dtype, buffer.device)
            name = f"{self.name}.{index}.{buffer.numel()}.{_dtype_name(dtype)}"
            entry = (memory, self.worker.register(name, memory))
            self._tensors[key] = entry
            self.registered.append(name)
        return entry

    def _complete_futures(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, memory, buffer, future = item
            try:
                request.wait(self.timeout)
                with torch.no_grad():
                    buffer.copy_(memory)
                if buffer.is_cuda:
                    torch.cuda.current_stream(buffer.device).synchronize()
                future.set_result(buffer)
            except BaseException as e:  # DDP raises it from backward's end
                future.set_exception(e)

    def close(self) -> None:
        """Stops the waiter thread (after the buckets queued before)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


# Not annotated: DDP compares the annotations with torch.futures.Future[torch.Tensor]
# and dist.GradBucket, which this module's string annotations are not.
def comm_hook(state, bucket):
    """A DDP communication hook: ``ddp_model.register_comm_hook(psld.torch.CommHookState(worker),
    psld.torch.comm_hook)``. Push_pulls the bucket's flat gradient buffer
    and completes the returned future with the average (see
    :class:`CommHookState`)."""
    future: torch.futures.Future = torch.futures.Future()
    buffer = bucket.buffer()
    try:
        memory, handle = state._tensor(bucket.index(), buffer)
        with torch.no_grad():
            if state.scale != 1.0:
                torch.mul(buffer, state.scale, out=memory)
            else:
                memory.copy_(buffer)
        _ready_for_transport(buffer.device)
        request = state.worker.push_pull(handle)
    except BaseException as e:
        future.set_exception(e)
        return future
    state._queue.put((request, memory, buffer, future))
    return future


# --- broadcasts -------------------------------------------------------------
#
# psld has no broadcast. With server.mode=sum and BSP, a push_pull in which
# the root sends its values and every other worker zeros returns the root's
# values. Bytes travel exactly as 16-bit integers held in float32 (every
# integer of -32768..32767 is a float32, and adding zeros to it is exact),
# so any dtype (int64 step counters, bool masks, float64) arrives bit for
# bit, at twice its size. With server.mode=optimizer the servers would run
# an optimizer on what is pushed; there a tensor registered with init=True
# holds worker 0's values and a pull after a barrier gives them to all.

_SLOTS = 4                  # chunks in flight at once, each in its own registered tensor
_CHUNK_ELEMS = 1 << 20      # float32 elements per chunk (4 MiB, 2 MiB of payload)
_HEADER_BYTES = 16          # payload length and layout digest


class _Broadcaster:
    def __init__(self, worker: psld.Worker, name: str):
        self.worker, self.name = worker, name
        self.slots: Dict[Tuple[int, int], Tuple[torch.Tensor, psld.Tensor]] = {}
        self.calls = 0

    def _slot(self, elems: int, i: int) -> Tuple[torch.Tensor, psld.Tensor]:
        key = (elems, i)
        if key not in self.slots:
            memory = self.worker.zeros(elems, "float32", like="torch")
            handle = self.worker.register(f"{self.name}.{elems}.{i}", memory)
            self.slots[key] = (memory, handle)
        return self.slots[key]

    def bytes(self, data: torch.Tensor, root_rank: int) -> None:
        """Gives every worker the root's ``data`` (a uint8 CPU tensor of even
        length, the same length everywhere), in place."""
        words = data.view(torch.int16)
        if self.worker.config["server.mode"] == "optimizer":
            self._by_init(words, root_rank)
            return
        _require_sum_bsp(self.worker, "psld.torch broadcasts")
        root = self.worker.rank == root_rank
        # Chunks are sized by powers of two so that small broadcasts (the
        # header) do not push megabytes; every worker picks the same sizes.
        elems = min(_CHUNK_ELEMS, 1 << max(0, (words.numel() - 1).bit_length()))
        in_flight: List[Optional[Tuple[psld.Request, torch.Tensor, int, int]]] = [None] * _SLOTS

        def finish(entry):
            request, memory, start, n = entry
            request.wait()
            if not root:
                words[start:start + n].copy_(memory[:n])

        for k, start in enumerate(range(0, words.numel(), elems)):
            i = k % _SLOTS
            if in_flight[i] is not None:
                finish(in_flight[i])
                in_flight[i] = None
            memory, handle = self._slot(elems, i)
            n = min(elems, words.numel() - start)
            if root:
                memory[:n].copy_(words[start:start + n])
                memory[n:].zero_()
            else:
                memory.zero_()
            in_flight[i] = (self.worker.push_pull(handle), memory, start, n)
        for entry in in_flight:
            if entry is not None:
                finish(entry)

    def _by_init(self, words: torch.Tensor, root_rank: int) -> None:
        if root_rank != 0:
            raise psld.FailedPrecondition(
                f"psld.torch broadcasts from root_rank={root_rank} need server.mode=sum; with "
                "server.mode=optimizer only worker 0's values can be given to all (they are the "
                "initial value of a tensor registered with init=True)")
        # A new tensor per call (its memory held until the worker shuts
        # down): a name can be initialised only once.
        self.calls += 1
        memory = self.worker.zeros(max(1, words.numel()), "float32", like="torch")
        if self.worker.rank == 0:
            memory[:words.numel()].copy_(words)
        handle = self.worker.register(f"{self.name}.init{self.calls}", memory, init=True)
        self.worker.barrier()
        self.worker.pull(handle).wait()
        if self.worker.rank != 0:
            words.copy_(memory[:words.numel()])


_broadcasters: "weakref.WeakKeyDictionary[psld.Worker, _Broadcaster]" = weakref.WeakKeyDictionary()


def _broadcaster(worker: psld.Worker) -> _Broadcaster:
    b = _broadcasters.get(worker)
    if b is None:
        b = _broadcasters[worker] = _Broadcaster(worker, "psld.torch.broadcast")
    return b


def _check_root(worker: psld.Worker, root_rank: int) -> None:
    if not 0 <= root_rank < worker.num_workers:
        raise ValueError(f"root_rank {root_rank} is not a worker rank (0..{worker.num_workers - 1})")


def _header(length: int, digest: bytes) -> torch.Tensor:
    raw = length.to_bytes(8, "little") + digest[:8].ljust(8, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _broadcast_header(b: _Broadcaster, length: int, digest: bytes, root_rank: int) -> Tuple[int, bytes]:
    header = _header(length, digest)
    b.bytes(header, root_rank)
    raw = bytes(header.tolist())
    return int.from_bytes(raw[:8], "little"), raw[8:]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def _named_tensors(params) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    else:
        items = []
        for i, item in enumerate(params):
            if isinstance(item, torch.Tensor):
                items.append((str(i), item))
            else:
                name, t = item
                items.append((str(name), t))
    out = []
    for n, t in items:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {n!r} is a {type(t).__name__}, not a tensor "
                            "(use broadcast_object for other values)")
        out.append((n, t))
    return out


def broadcast_parameters(params, root_rank: int = 0, worker: Optional[psld.Worker] = None) -> None:
    """Gives every worker the root's values of ``params``, in place.

    ``params``: a state_dict (``model.state_dict()``: parameters and buffers),
    a module, ``model.named_parameters()``, or a list of tensors; every
    worker passes the same names, shapes and dtypes (checked: a difference
    raises ``psld.InvalidArgument`` on the workers that differ from the
    root). Any dtype travels bit for bit. Needs server.mode=sum (and BSP);
    with server.mode=optimizer only ``root_rank=0`` works (see the module
    notes), and :class:`DistributedOptimizer` already gives every worker
    worker 0's trained parameters there.
    """
    w = _worker(worker)
    _check_root(w, root_rank)
    tensors = _named_tensors(params)
    layout = hashlib.sha256()
    sizes = []
    for n, t in tensors:
        layout.update(f"{n}:{tuple(t.shape)}:{t.dtype};".encode())
        nbytes = t.numel() * t.element_size()
        sizes.append(-(-nbytes // 8) * 8)  # aligned for any dtype's view of its bytes
    total = sum(sizes)
    b = _broadcaster(w)
    root_total, root_digest = _broadcast_header(b, total, layout.digest(), root_rank)
    if (root_total, root_digest) != (total, layout.digest()[:8]):
        # Take part in the root's round all the same, so that the workers
        # that match are not left waiting for this one.
        b.bytes(torch.zeros(root_total, dtype=torch.uint8), root_rank)
        raise psld.InvalidArgument(
            f"broadcast_parameters: this worker's tensors ({len(tensors)}, {total} bytes) differ in "
            f"names, shapes or dtypes from worker {root_rank}'s ({root_total} bytes): every worker "
            "must pass the same model")
    data = torch.zeros(total, dtype=torch.uint8)
    offset = 0
    root = w.rank == root_rank
    for (n, t), size in zip(tensors, sizes):
        if root:
            raw = _as_bytes(t)
            data[offset:offset + raw.numel()].copy_(raw)
        offset += size
    b.bytes(data, root_rank)
    if root:
        return
    offset = 0
    with torch.no_grad():
        for (n, t), size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            value = data[offset:offset + nbytes].view(t.dtype).view(t.shape)
            t.copy_(value)
            offset += size


def broadcast_object(obj: Any = None, root_rank: int = 0, worker: Optional[psld.Worker] = None) -> Any:
    """Returns the root's ``obj`` on every worker (pickled with torch.save;
    tensors come back on the CPU). The other workers' ``obj`` is ignored."""
    w = _worker(worker)
    _check_root(w, root_rank)
    b = _broadcaster(w)
    payload = b""
    if w.rank == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = buf.getvalue()
    length, _ = _broadcast_header(b, len(payload), b"", root_rank)
    data = torch.zeros(length + (length & 1), dtype=torch.uint8)
    if w.rank == root_rank:
        data[:length].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    b.bytes(data, root_rank)
    if w.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(bytes(data[:length].numpy().tobytes())), map_location="cpu")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              worker: Optional[psld.Worker] = None) -> None:
    """Gives every worker the root's optimizer state (moments, step counters,
    and the parameter groups' hyperparameters such as lr), through
    :func:`broadcast_object`: any value, exactly. With a
    :class:`DistributedOptimizer` the wrapped optimizer's state."""
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    w = _worker(worker if worker is not None else
                (optimizer.worker if isinstance(optimizer, DistributedOptimizer) else None))
    state = broadcast_object(inner.state_dict() if w.rank == root_rank else None, root_rank, w)
    if w.rank != root_rank:
        optimizer.load_state_dict(state)
