"""psld: an elastic parameter server for data-parallel training.

The Python package over psld's C++ library (docs/python.md)::

    import numpy as np, psld

    with psld.Worker() as w:                 # under `psld launch`: all from the environment
        grad = w.zeros(1 << 20)              # or any float32/float16 array or torch tensor
        t = w.register("grad", grad)         # no copy: psld uses grad's own memory
        for step in range(100):
            grad[:] = compute_gradient()
            w.push_pull(t).wait()            # grad now holds the sum over the workers

`psld.torch` has the PyTorch integration (DistributedOptimizer, a DDP
communication hook, broadcasts).
"""

from __future__ import annotations

import os
import tomllib
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from . import _psld

__version__ = _psld.version()
__all__ = [
    "Error", "Config", "load_config", "Worker", "Tensor", "Request", "Server", "Coordinator",
]


# --- errors ----------------------------------------------------------------

class Error(Exception):
    """A psld failure. ``code`` names the status ("Unavailable"); the message is psld's."""

    code = "Unknown"


_DOCS = {
    "InvalidArgument": "The caller passed a bad value; retrying will not help.",
    "NotFound": "A name, key or peer that does not exist.",
    "AlreadyExists": "Something registered twice with a different meaning.",
    "OutOfRange": "An offset, index or length outside its bounds.",
    "FailedPrecondition": "The object is not in a state that allows the call (e.g. shut down).",
    "ResourceExhausted": "A bounded ring, pool or credit window is full.",
    "Unavailable": "The peer is gone or unreachable.",
    "Timeout": "The operation did not complete in time.",
    "Aborted": "The operation was cancelled (shutdown, a failed job).",
    "DataLoss": "A message failed validation.",
    "Moved": "A key is owned by another server in a newer epoch.",
    "Unimplemented": "The backend or build lacks the feature.",
    "Internal": "A broken invariant of psld itself: please report it.",
}


def _make_error_classes() -> dict:
    classes = {}
    for name in _psld.status_code_names():
        bases = (Error, TimeoutError) if name == "Timeout" else (Error,)
        cls = type(name, bases, {"code": name, "__doc__": _DOCS.get(name, name),
                                 "__module__": __name__})
        classes[name] = cls
        globals()[name] = cls
        __all__.append(name)
    return classes


_ERRORS = _make_error_classes()
_psld._set_error_classes(_ERRORS)


def _error(code: str, message: str) -> Error:
    return _ERRORS[code](message)


# --- configuration ---------------------------------------------------------

def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in settings.items():
        if not isinstance(key, str):
            raise _error("InvalidArgument", f"setting names are strings, not {key!r}")
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, full + ".")
        else:
            yield full, value


class Config:
    """The effective configuration of one psld process (what ``psld config`` prints).

    ``cfg["server.mode"]`` reads one key, typed as in the TOML; ``str(cfg)``
    is the TOML document with where each value came from.
    """

    def __init__(self, native: "_psld.Config", flags: list):
        self._native = native
        self._flags = flags  # what it was built from, besides files and the environment
        self._values = None

    @property
    def launcher(self) -> str:
        """The launcher whose environment was read ("psld", "openmpi", "slurm", "torchrun", "none")."""
        return self._native.launcher

    def _flat(self) -> dict:
        if self._values is None:
            self._values = dict(_flatten(tomllib.loads(self._native.to_string(False))))
        return self._values

    def __getitem__(self, key: str) -> Any:
        values = self._flat()
        if key not in values:
            raise KeyError(f"{key!r} is not a psld configuration key (see `psld config`)")
        return values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._flat().get(key, default)

    def keys(self):
        return self._flat().keys()

    def __str__(self) -> str:
        return self._native.to_string(True)

    def __repr__(self) -> str:
        return f"<psld.Config launcher={self.launcher!r}>"


ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], Config]


def load_config(config: ConfigLike = None, *, args: Optional[Iterable[str]] = None,
                **settings: Any) -> Config:
    """Builds a Config as the C++ ``load_config`` does.

    Sources, each overriding the one before: the defaults; a TOML file
    (``config`` as a path, else ``PSLD_CONFIG``); the environment a launcher
    sets (``psld launch``, mpirun, srun, torchrun); ``PSLD_*`` variables; then
    ``config`` as a dict, ``settings`` and ``args`` (flags such as
    ``"--server.mode=sum"``). Settings are named by their key, nested or
    dotted: ``load_config(job={"num_workers": 4})`` or
    ``load_config(**{"job.num_workers": 4})``. A Config with more settings
    is rebuilt from the same sources with them added. A wrong or unknown key raises
    ``psld.InvalidArgument`` naming it and what is accepted.
    """
    flags = []
    if isinstance(config, Config):
        if not args and not settings:
            return config
        flags += config._flags  # rebuilt, with what is added here winning
    elif isinstance(config, (str, os.PathLike)):
        flags.append(f"--config={os.fspath(config)}")
    elif isinstance(config, Mapping):
        flags += [f"--{k}={_flag_value(v)}" for k, v in _flatten(config)]
    elif config is not None:
        raise _error("InvalidArgument",
                     f"config must be a path, a dict of settings or a psld.Config, not {type(config).__name__}")
    flags += [f"--{k}={_flag_value(v)}" for k, v in _flatten(settings)]
    flags += list(args or [])
    return Config(_psld.load_config(flags), flags)


# --- tensors and requests ---------------------------------------------------

class Request:
    """A push, pull or push_pull in flight."""

    __slots__ = ("_native",)

    def __init__(self, native: "_psld.Request"):
        self._native = native

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until the request completed (seconds; None: no limit).

        Raises ``psld.Timeout`` when the time passed first (the request stays
        in flight), or the request's error. The GIL is released meanwhile.
        """
        self._native.wait(timeout)

    def done(self) -> bool:
        """True once the request is complete, successfully or not."""
        return self._native.done()


class Tensor:
    """A registered tensor: ``name``, ``nbytes``, ``dtype`` and the array it lives in."""

    __slots__ = ("name", "nbytes", "dtype", "array", "_index")

    def __init__(self, name: str, index: int, array: Any, nbytes: int, dtype: str):
        self.name, self._index, self.array, self.nbytes, self.dtype = name, index, array, nbytes, dtype

    def __repr__(self) -> str:
        return f"<psld.Tensor {self.name!r} {self.dtype} {self.nbytes} bytes>"


def _describe(array: Any) -> tuple[Any, str, int]:
    """(what to hand to the native module, dtype name, bytes) after the checks
    whose errors Python can say best; raises psld.InvalidArgument."""
    module = type(array).__module__
    if module.startswith("torch"):
        import torch  # only when a torch tensor is passed
        if not isinstance(array, torch.Tensor):
            raise _error("InvalidArgument", f"cannot register a {type(array).__name__}")
        if array.is_sparse:
            raise _error("InvalidArgument", "a sparse tensor cannot be registered; psld takes dense tensors")
        if not array.is_contiguous():
            raise _error("InvalidArgument",
                         "the tensor is not contiguous: psld reads and writes the tensor's own memory, "
                         "so it needs a contiguous tensor (register t.contiguous() and use that one)")
        dtype = str(array.dtype).replace("torch.", "")
        # detach() shares the memory; DLPack refuses tensors that require grad.
        return array.detach(), dtype, array.numel() * array.element_size()
    if hasattr(array, "__array_interface__") or hasattr(array, "__dlpack__"):
        flags = getattr(array, "flags", None)
        if flags is not None:
            if not flags["C_CONTIGUOUS"]:
                raise _error("InvalidArgument",
                             "the array is not C-contiguous: psld reads and writes the array's own memory, "
                             "so it needs a C-contiguous one (np.ascontiguousarray, then use that one)")
            if not flags["WRITEABLE"]:
                raise _error("InvalidArgument",
                             "the array is read-only: pulls write into the registered memory")
        dtype = str(getattr(array, "dtype", "unknown"))
        return array, dtype, int(getattr(array, "nbytes", 0))
    raise _error("InvalidArgument",
                 f"cannot register a {type(array).__name__}: psld takes numpy arrays, torch tensors "
                 "and other DLPack or buffer-protocol arrays")


class Worker:
    """A worker of a psld job: registers tensors and pushes and pulls them.

    ``Worker(config=None, *, args=None, **settings)`` loads the configuration
    as :func:`load_config` does and joins the job: it blocks until every
    worker and server joined (``liveness.connect_timeout_ms``). Use it as a
    context manager, or call :meth:`shutdown`.
    """

    def __init__(self, config: ConfigLike = None, *, args: Optional[Iterable[str]] = None,
                 **settings: Any):
        self.config = load_config(config, args=args, **settings)
        role = self.config["job.role"]
        if role not in ("auto", "worker"):
            raise _error("InvalidArgument",
                         f"job.role is {role!r}: psld.Worker runs a worker "
                         "(psld.Server and psld.Coordinator run the other roles)")
        self._native = _psld.Worker(self.config._native)
        self._tensors: dict[str, Tensor] = {}
        self._by_index: dict[int, Tensor] = {}

    # -- facts
    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def num_workers(self) -> int:
        return self._native.num_workers

    @property
    def gpu_path(self) -> str:
        """How tensors in CUDA memory travel in this process, and why."""
        return self._native.gpu_path

    # -- memory and tensors
    def allocate(self, nbytes: int):
        """``nbytes`` of zero-filled transport memory as a uint8 numpy array.

        Servers on the same host reach it directly (UCX shared memory), which
        makes pulls into it much faster than into malloc'd memory. It stays
        valid while the array or this Worker lives.
        """
        if nbytes < 0:
            raise _error("InvalidArgument", f"cannot allocate {nbytes} bytes")
        return self._native.allocate(int(nbytes))

    def zeros(self, numel: int, dtype: str = "float32", *, like: str = "numpy"):
        """A zero-filled 1-D array (``like="numpy"``) or tensor (``like="torch"``)
        of ``numel`` elements in the transport's memory (see :meth:`allocate`)."""
        import numpy as np
        if like not in ("numpy", "torch"):
            raise _error("InvalidArgument", f"like must be 'numpy' or 'torch', not {like!r}")
        if like == "torch":
            import torch
            tdtype = getattr(torch, dtype.replace("torch.", ""), None)
            if not isinstance(tdtype, torch.dtype):
                raise _error("InvalidArgument", f"unknown torch dtype {dtype!r}")
            size = torch.empty((), dtype=tdtype).element_size()
            raw = self.allocate(numel * size)
            return torch.from_numpy(raw).view(tdtype) if numel else torch.zeros(0, dtype=tdtype)
        npdtype = np.dtype(dtype)
        raw = self.allocate(numel * npdtype.itemsize)
        return raw.view(npdtype)

    def register(self, name: str, tensor: Any, *, init: bool = False) -> Tensor:
        """Registers ``tensor`` (numpy array or torch tensor) under ``name``, without copying.

        psld reads pushes from and writes pulls into the tensor's own memory;
        the Worker keeps a reference to it until shutdown. It must be
        C-contiguous, writable and float32, float16 or bfloat16. With
        ``init=True`` worker 0's contents are the initial value (call
        :meth:`barrier` before other workers pull it). Registering a name
        again with the same memory returns the same Tensor; with another
        shape, dtype or memory it raises ``psld.AlreadyExists``.
        """
        if not isinstance(name, str):
            raise _error("InvalidArgument", f"a tensor name is a str, not {type(name).__name__}")
        native_array, dtype, nbytes = _describe(tensor)
        index = self._native.register_tensor(name, native_array, bool(init))
        t = self._by_index.get(index)
        if t is None:
            t = Tensor(name, index, tensor, nbytes, dtype)
            self._tensors[name] = t
            self._by_index[index] = t
        return t

    def tensor(self, name: str) -> Tensor:
        """The registered Tensor called ``name``."""
        try:
            return self._tensors[name]
        except KeyError:
            raise _error("NotFound", f"no tensor '{name}' is registered by this worker") from None

    def _index(self, tensor: Union[Tensor, str]) -> int:
        if self._native.is_shut_down:
            raise _error("FailedPrecondition", "the worker was shut down")
        if isinstance(tensor, Tensor):
            if self._by_index.get(tensor._index) is not tensor:
                raise _error("InvalidArgument", f"tensor '{tensor.name}' was registered by another Worker")
            return tensor._index
        if isinstance(tensor, str):
            return self.tensor(tensor)._index
        raise _error("InvalidArgument", f"expected a psld.Tensor or a tensor name, not {type(tensor).__name__}")

    # -- communication
    # Each takes one tensor (a Request back) or a list or tuple of them (a
    # list of Requests, in order): submitted together, the small chunks among
    # them that go to one server travel as one batch (data.batch_chunk_bytes).
    def push(self, tensor: Union[Tensor, str, Sequence[Union[Tensor, str]]]):
        """Sends the tensor's contents (a gradient) for the next round."""
        return self._submit(tensor, self._native.push, self._native.push_many)

    def pull(self, tensor: Union[Tensor, str, Sequence[Union[Tensor, str]]]):
        """Fetches the result of the round this worker last pushed into the tensor's memory."""
        return self._submit(tensor, self._native.pull, self._native.pull_many)

    def push_pull(self, tensor: Union[Tensor, str, Sequence[Union[Tensor, str]]]):
        """push, then the round's result (sum, or new parameters) written back into the tensor."""
        return self._submit(tensor, self._native.push_pull, self._native.push_pull_many)

    def _submit(self, tensor, one, many):
        if isinstance(tensor, (list, tuple)):
            # Every name and handle is checked before anything is submitted.
            indices = [self._index(t) for t in tensor]
            return [Request(r) for r in many(indices)]
        return Request(one(self._index(tensor)))

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Returns once every worker called barrier() as often (seconds; None: no limit)."""
        self._native.barrier(timeout)

    def set_learning_rate(self, lr: float) -> None:
        """server.mode=optimizer: the learning rate of the updates the pushes from now on are
        part of, instead of the servers' ``optimizer.lr`` (0 goes back to it). Every worker sets
        the same rate before the same step (an LR scheduler stepped on every worker does);
        where they differ, the lowest rank's wins. No effect with server.mode=sum."""
        self._native.set_learning_rate(float(lr))

    def round(self, tensor: Union[Tensor, str]) -> int:
        """Rounds of the tensor pushed so far: its next push is of round + 1. In a job resumed
        from a checkpoint (``checkpoint.resume``, ``psld launch --resume DIR``) every tensor
        starts at the checkpoint's round and ``register`` has pulled that round's parameters
        into it: skip the trainer's data ahead to there (docs/checkpoint.md)."""
        return self._native.round(self._index(tensor))

    def health(self) -> None:
        """Returns while the job runs; raises its failure (naming the process) otherwise."""
        self._native.health()

    def server_loads(self) -> list:
        """Per server: bytes this worker pushed, chunks answered, mean answer time (µs)."""
        return self._native.server_loads()

    def shutdown(self) -> None:
        """Tells the coordinator this worker is done. Idempotent; requests in flight fail with Aborted."""
        if self._native.is_shut_down:
            return
        try:
            self._native.shutdown()
        finally:
            self._tensors.clear()
            self._by_index.clear()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._native.is_shut_down else f"rank {self.rank} of {self.num_workers}"
        return f"<psld.Worker {state}>"


class _Member:
    """A Server or Coordinator run by this process."""

    _role = ""
    _native_class: Any = None

    def __init__(self, config: ConfigLike = None, *, args: Optional[Iterable[str]] = None,
                 **settings: Any):
        self.config = load_config(config, args=list(args or []) + [f"--job.role={self._role}"],
                                  **settings)
        self._native = self._native_class(self.config._native)

    @property
    def address(self) -> str:
        """Where the job's members reach it."""
        return self._native.address

    def wait(self, timeout: Optional[float] = None) -> None:
        """Blocks until every worker finished (returns), the job failed (raises why) or
        ``timeout`` seconds passed (psld.Timeout)."""
        self._native.wait(timeout)

    def shutdown(self) -> None:
        """Stops it (a Coordinator: ends the job for everyone); idempotent."""
        self._native.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class Server(_Member):
    """A parameter server in this process: ``Server(config=None, **settings)``
    listens, joins the job and serves on its own threads until the job ends."""

    _role, _native_class = "server", _psld.Server

    @property
    def rank(self) -> int:
        return self._native.rank


class Coordinator(_Member):
    """The job's control plane in this process: ``Coordinator(config=None, **settings)``
    listens on ``job.coordinator`` (a real port) and admits the job's workers and servers."""

    _role, _native_class = "coordinator", _psld.Coordinator
