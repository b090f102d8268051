"""Where timing jobs run: local processes, or a Ray cluster (chapter 25).

A `Job` is one measurement: a picklable function and its arguments, returning seconds
per call and their spread (timing a plan candidate applied to a model, or a site's
candidate). An executor runs a batch of jobs and hands back a `Timing` per job, in
order; only the driver writes them to the tuning database (`record`), so the file has
one writer however many workers time.

- `LocalExecutor`: a pool of spawned processes, each pinned to one CPU core and one
  torch thread (a time on one thread, as the tuning keys say).
- `RayExecutor`: Ray tasks, each asking for one unit of the custom resource
  `opswap_device_<kind>` (`resource_name`): only a node that advertises the device kind
  the run targets runs them, so a CPU laptop driving a cluster never times a GPU plan on
  itself. A node joins with, for the H100s of a cluster,

      ray start --address HEAD:6379 --resources '{"opswap_device_cuda_nvidia_h100": 1}'

  (one unit per GPU: one measurement at a time per GPU). `--ray auto` joins the cluster
  this machine belongs to, or starts a local Ray instance advertising this machine's kind.

`executor(None)` is the local pool; `executor("auto")` or `executor(ADDRESS)` Ray's. A
missing Ray or an address nothing answers at is one sentence (`ScaleError`).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from opswap.errors import OpswapError

RAY_EXTRA = "pip install 'opswap[ray]'"


class ScaleError(OpswapError):
    """Timing jobs cannot run where they were asked to."""


@dataclass(frozen=True)
class Job:
    """One measurement: `fn(*args)` returns (seconds per call, relative spread). `key`
    names it for the caller (a plan's decision set, a site's candidate)."""

    key: str
    fn: Callable[..., tuple[float, float]]
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Timing:
    """A job's result, or why it has none; `where` names the worker that timed it."""

    key: str
    seconds: float | None
    noise: float | None
    where: str
    error: str | None = None


def device_kind(device: str = "cpu") -> str:
    """The device kind a measurement needs, as a resource-name word: `cpu`, or `cuda_`
    and the GPU's name (cuda_nvidia_h100_80gb_hbm3)."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(torch.device(device))
            return "cuda_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        return "cuda"
    return "cpu"


def resource_name(kind: str) -> str:
    """The Ray custom resource a node advertises to take measurements of `kind`."""
    return f"opswap_device_{kind}"


def _run_job(job: Job) -> Timing:
    where = f"{socket.gethostname()}:{os.getpid()}"
    try:
        secs, noise = job.fn(*job.args)
    except Exception as e:  # a job's failure is its result, not the batch's
        return Timing(job.key, None, None, where, f"{type(e).__name__}: {e}")
    return Timing(job.key, float(secs), float(noise), where)


class Executor(Protocol):
    name: str

    def map(self, jobs: Sequence[Job]) -> list[Timing]: ...

    def close(self) -> None: ...


class InProcess:
    """Jobs timed here, one after another: what the others are checked against."""

    name = "in-process"

    def map(self, jobs: Sequence[Job]) -> list[Timing]:
        return [_run_job(j) for j in jobs]

    def close(self) -> None:
        pass


def _pin(cores: list[int], counter: Any) -> None:
    """A worker's start: one torch thread, on its own core when there are enough."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    import torch

    torch.set_num_threads(1)
    with counter.get_lock():
        i = counter.value
        counter.value += 1
    if hasattr(os, "sched_setaffinity") and cores:
        os.sched_setaffinity(0, {cores[i % len(cores)]})


@dataclass
class LocalExecutor:
    """A pool of `workers` spawned processes (default: one per core this process may
    use), each pinned to one core and one torch thread."""

    workers: int | None = None
    name: str = "local"
    _pool: ProcessPoolExecutor | None = field(default=None, repr=False)

    def _start(self) -> ProcessPoolExecutor:
        if self._pool is None:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            n = self.workers or max(1, len(cores) or (os.cpu_count() or 1))
            ctx = multiprocessing.get_context("spawn")
            counter = ctx.Value("i", 0)
            self._pool = ProcessPoolExecutor(
                n, mp_context=ctx, initializer=_pin, initargs=(cores, counter)
            )
        return self._pool

    def map(self, jobs: Sequence[Job]) -> list[Timing]:
        return list(self._start().map(_run_job, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something answers at a Ray address's host and port (ray://h:p or h:p)."""
    hostport = address.removeprefix("ray://").rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ScaleError(
            f"--ray {address!r} is not a Ray address; give auto, HOST:PORT (the head's GCS "
            "port, 6379) or ray://HOST:PORT (the Ray client, 10001)."
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class RayExecutor:
    """Ray tasks on the nodes that advertise `resource_name(kind)`."""

    name = "ray"

    def __init__(
        self, address: str = "auto", kind: str = "cpu", num_cpus: int | None = None
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ScaleError(
                f"--ray needs Ray, which is not installed; {RAY_EXTRA}, or drop --ray to "
                "time in local processes."
            ) from None
        self.ray, self.kind, self.resource = ray, kind, resource_name(kind)
        self.started = False
        if not ray.is_initialized():
            if address != "auto" and not _reachable(address):
                raise ScaleError(
                    f"No Ray cluster answers at {address}; start one there (`ray start "
                    "--head`), give its address, or use --ray auto."
                )
            if address == "auto":
                try:  # the cluster this machine belongs to
                    ray.init(address="auto", log_to_driver=False)
                except ConnectionError:  # none: a local one advertising this machine's kind
                    ray.init(
                        num_cpus=num_cpus,
                        resources={self.resource: float(num_cpus or os.cpu_count() or 1)},
                        include_dashboard=False,
                        log_to_driver=False,
                    )
            else:
                ray.init(address=address, log_to_driver=False)
            self.started = True
        have = ray.cluster_resources().get(self.resource, 0)
        if not have:
            raise ScaleError(
                f"No node of the Ray cluster advertises {self.resource}; start the "
                f"workers of that kind with `ray start --address HEAD:6379 --resources "
                f"'{{\"{self.resource}\": 1}}'`."
            )
        self._task = ray.remote(_run_job).options(
            num_cpus=1, resources={self.resource: 1}, max_retries=0
        )

    def map(self, jobs: Sequence[Job]) -> list[Timing]:
        return list(self.ray.get([self._task.remote(j) for j in jobs]))

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


def executor(ray: str | None, device: str = "cpu", workers: int | None = None) -> Executor:
    """Where timing jobs run: local processes (`ray` None), else Ray (`auto` or an
    address), the tasks asking for nodes of `device`'s kind."""
    if ray is None:
        return LocalExecutor(workers)
    return RayExecutor(ray, device_kind(device), workers)


def record(timings: Sequence[Timing], write: Callable[[Timing], Any]) -> int:
    """Hand each timing that has seconds to `write` (which puts it in the tuning
    database), here in the driver: the one writer. The number written."""
    n = 0
    for t in timings:
        if t.seconds is not None:
            write(t)
            n += 1
    return n


def time_call(fn: Callable[[], Any], repeats: int = 5, warmup: int = 2) -> tuple[float, float]:
    """A job's usual body: `fn`'s median seconds per call over `repeats` calls after
    `warmup`, and the interquartile range over the median."""
    import statistics

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    median = statistics.median(times)
    return median, (q[2] - q[0]) / max(median, 1e-30)


def time_module(module: Any, inputs: tuple[Any, ...], repeats: int = 5) -> tuple[float, float]:
    """A plan candidate's job: `module(*inputs)` timed by `time_call`, without autograd,
    on the inputs' device (a CUDA call synchronised, so the time is the GPU's)."""
    import torch

    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)

    def call() -> Any:
        with torch.no_grad():
            out = module(*inputs)
        if cuda:
            torch.cuda.synchronize()
        return out

    return time_call(call, repeats=repeats)
