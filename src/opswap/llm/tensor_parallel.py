"""Tensor-parallel serving (chapter 29): one model's layers split over N GPUs of one host
(or N CPU processes with gloo), driven by one scheduler.

    engine = LLMEngine(model, tensor_parallel=2, device="cuda")   # rank r on cuda:r
    ...                                                            # as with one GPU
    engine.close()                                                 # stops the other ranks

The split (Megatron-style, written for each runner: `SPLITS`):

- attention: the packed q/k/v projection is column-parallel by heads (rank r keeps query
  heads [r H/N, (r+1) H/N) and KV heads [r H_kv/N, (r+1) H_kv/N), so each GQA group stays
  whole on one rank); the o projection is row-parallel (its input columns of those heads);
- MLP: gate and up (GPT-2's c_fc) column-parallel by intermediate columns, down (c_proj)
  row-parallel by the same columns;
- one all-reduce (a sum) after each row-parallel projection: two per layer. Biases of the
  row-parallel projections are added on rank 0 only, so the sum counts them once;
- the paged KV cache of each rank holds only its KV heads (its blocks are 1/N the bytes,
  so the same memory holds N times the blocks); the block tables are the same on every
  rank, since one block manager on rank 0 hands the blocks out;
- the embedding and the LM head are replicated, and only rank 0 computes logits: the
  sampler runs on rank 0 alone, so a vocab-parallel head would add an all-gather of
  [rows, vocab] to every step to save 1/N of two matrices' memory.

Why plain `torch.distributed.all_reduce` and not `torch.distributed.tensor.parallel`:
`parallelize_module` shards `nn.Linear`/`nn.Embedding` submodules of an `nn.Module` into
DTensors; a runner holds plain (possibly low-bit, llm/quant.py) weight tensors and calls
the paged-attention kernels on plain tensors, so DTensor would have to be converted back
at every kernel call, and the two sums per layer are all it would insert.

The worker protocol. Rank 0 is the caller's process: it runs the scheduler, the sampler
and (for `opswap serve`) the HTTP server; ranks 1..N-1 are processes spawned with
torch.multiprocessing, each mapping the model from a file rank 0 saved (not through
/dev/shm) and building the same engine with its shard. Every step rank 0
puts a small header (the op and the shapes) down each worker's pipe and then broadcasts
the step's batch (token ids, positions, slot mapping, block tables, context lengths,
prefill offsets) as one int64 tensor; the workers run the same forward on their shard
(the all-reduces keep them in step) and return to their pipe. A CUDA-graph step sends the
bucket's padded inputs instead and every rank replays its own graph of that bucket.

Failure is one sentence on rank 0, never a hang: a worker that raises reports its error
on a queue and exits; rank 0 checks the workers before each step and turns a collective
that fails or outlasts `timeout_s` (the process group's timeout) into a `TPError` naming
the rank and its error. Workers watch rank 0 too, and exit when it is gone.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from opswap.errors import OpswapError
from opswap.llm.hf_decoder import linear
from opswap.llm.runner import Attend, ModelRunner

#: a test hook: "RANK:STEP:raise" or "RANK:STEP:hang" makes that worker fail at that step
FAULT_ENV = "OPSWAP_TP_FAULT"

#: how long rank 0 waits for the workers to start and to build their shards (a process
#: that dies meanwhile is noticed at once); the steps' own timeout is `timeout_s`
START_TIMEOUT_S = 600.0


class TPError(OpswapError, ValueError):
    """A model or setting that cannot be split, or a rank that failed."""


# -- devices ------------------------------------------------------------------------------


def rank_device(device: torch.device | str, rank: int, world: int) -> torch.device:
    """Rank `rank`'s device for a run on `device` split `world` ways: cuda:rank on CUDA
    (refusing more ranks than visible GPUs), the CPU otherwise."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise TPError(f"tensor-parallel serving runs on cuda or cpu, not {dev.type}.")
    if dev.index not in (None, 0):
        raise TPError(
            f"with tensor_parallel {world} pass device 'cuda' (rank r runs on cuda:r), "
            f"not {device}."
        )
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world > seen:
        raise TPError(
            f"tensor_parallel {world} needs {world} GPUs of this host and torch sees {seen}; "
            f"use tensor_parallel <= {seen} or device 'cpu'."
        )
    return torch.device("cuda", rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# -- the split ----------------------------------------------------------------------------


def _move(obj: Any, device: torch.device) -> None:
    """Every tensor attribute of obj onto device (a no-op where it is there already)."""
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device))


def _rows(t: torch.Tensor, spans: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in spans]).to(device).contiguous()


def _cols(t: torch.Tensor, a: int, b: int, device: torch.device) -> torch.Tensor:
    return t[:, a:b].to(device).contiguous()


def _qkv_spans(r: int, world: int, heads: int, kv_heads: int, d: int) -> list[tuple[int, int]]:
    """Rows of rank r's heads in a packed [q; k; v] projection."""
    hl, kl = heads // world, kv_heads // world
    q0, k0, v0 = 0, heads * d, (heads + kv_heads) * d
    return [
        (q0 + r * hl * d, q0 + (r + 1) * hl * d),
        (k0 + r * kl * d, k0 + (r + 1) * kl * d),
        (v0 + r * kl * d, v0 + (r + 1) * kl * d),
    ]


def _check_divisible(what: str, n: int, world: int) -> None:
    if n % world:
        raise TPError(
            f"the model's {n} {what} do not divide by tensor_parallel {world}; use a "
            f"tensor_parallel that divides {n}."
        )


@dataclass(frozen=True)
class Split:
    """How to split one runner class: `check(runner, N)` refuses what cannot be split,
    `shard(runner, rank, N, device)` keeps rank's part on device (in place), and
    `layer(runner, i, x, positions, attend, reduce, rank)` is the sharded layer."""

    check: Callable[[Any, int], None]
    shard: Callable[[Any, int, int, torch.device], None]
    layer: Callable[
        [Any, int, torch.Tensor, torch.Tensor, Attend, Callable[[torch.Tensor], torch.Tensor], int],
        torch.Tensor,
    ]


def _llama_check(runner: Any, world: int) -> None:
    _check_divisible("attention heads", runner.heads, world)
    _check_divisible("KV heads", runner.kv_heads, world)
    _check_divisible("MLP columns", runner.net.layers[0].wgu.shape[0] // 2, world)


def _llama_shard(runner: Any, r: int, world: int, device: torch.device) -> None:
    net = runner.net
    h, hk, d = net.heads, net.kv_heads, net.head_dim
    spans = _qkv_spans(r, world, h, hk, d)
    for layer in net.layers:
        inter = layer.wgu.shape[0] // 2
        il = inter // world
        mlp = [(r * il, (r + 1) * il), (inter + r * il, inter + (r + 1) * il)]
        layer.wqkv = _rows(layer.wqkv, spans, device)
        if layer.bqkv is not None:
            layer.bqkv = _rows(layer.bqkv, spans, device)
        layer.wgu = _rows(layer.wgu, mlp, device)
        if layer.bgu is not None:
            layer.bgu = _rows(layer.bgu, mlp, device)
        layer.wo = _cols(layer.wo, r * (h // world) * d, (r + 1) * (h // world) * d, device)
        layer.wdown = _cols(layer.wdown, r * il, (r + 1) * il, device)
        if r:  # the row-parallel biases: added once, on rank 0
            layer.bo = layer.bdown = None
        _move(layer, device)
    net.heads, net.kv_heads = runner.heads, runner.kv_heads = h // world, hk // world
    net.device = runner.device = device
    _move(net, device)


def _llama_layer(
    runner: Any,
    i: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    rank: int,
) -> torch.Tensor:
    # LlamaRunner.layer with a sum after o and after down (the biases are rank 0's)
    net, layer = runner.net, runner.net.layers[i]
    t = x.shape[0]
    h = net.rms_norm(x, layer.ln1, layer.eps1)
    q, k, v = net.qkv(h[None], layer, positions[None])
    o = attend(i, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
    a = reduce(linear(o.reshape(t, -1), layer.wo, layer.bo))
    h, x = net.add_rms_norm(a, x, layer.ln2, layer.eps2)
    return x + reduce(net.mlp(h, layer))


def _gpt2_check(runner: Any, world: int) -> None:
    _check_divisible("attention heads", runner.heads, world)
    _check_divisible("MLP columns", runner.blocks[0].wfc.shape[0], world)


def _gpt2_shard(runner: Any, r: int, world: int, device: torch.device) -> None:
    h, d = runner.heads, runner.head_dim
    spans = _qkv_spans(r, world, h, h, d)
    for b in runner.blocks:
        il = b.wfc.shape[0] // world
        b.wqkv, b.bqkv = _rows(b.wqkv, spans, device), _rows(b.bqkv, spans, device)
        b.wfc = _rows(b.wfc, [(r * il, (r + 1) * il)], device)
        b.bfc = _rows(b.bfc, [(r * il, (r + 1) * il)], device)
        b.wo = _cols(b.wo, r * (h // world) * d, (r + 1) * (h // world) * d, device)
        b.wproj = _cols(b.wproj, r * il, (r + 1) * il, device)
        _move(b, device)
    runner.heads = runner.kv_heads = h // world
    runner.device = device
    _move(runner, device)


def _gpt2_layer(
    runner: Any,
    i: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    rank: int,
) -> torch.Tensor:
    # GPT2Runner.layer with a sum after c_proj of attention and of the MLP
    b, t = runner.blocks[i], x.shape[0]
    h = runner._ln(x, b.ln1_w, b.ln1_b)
    q, k, v = linear(h, b.wqkv, b.bqkv).view(t, 3, runner.heads, runner.head_dim).unbind(1)
    o = attend(i, q, k, v)
    x = x + reduce(linear(o.reshape(t, -1), b.wo, b.bo if rank == 0 else None))
    h = runner._ln(x, b.ln2_w, b.ln2_b)
    m = linear(runner.act(linear(h, b.wfc, b.bfc)), b.wproj, b.bproj if rank == 0 else None)
    return x + reduce(m)


#: runner class name -> its split; a runner without one is refused in one sentence
SPLITS: dict[str, Split] = {
    "LlamaRunner": Split(_llama_check, _llama_shard, _llama_layer),
    "GPT2Runner": Split(_gpt2_check, _gpt2_shard, _gpt2_layer),
}


def split_for(runner: Any, world: int) -> Split:
    """The runner's split, after checking that it divides `world` ways."""
    name = type(runner).__name__
    split = SPLITS.get(name)
    if split is None:
        raise TPError(
            f"tensor-parallel serving has a split for {', '.join(SPLITS)}; the model's "
            f"runner {name} has none written, so serve it with tensor_parallel 1."
        )
    split.check(runner, world)
    return split


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


class ShardedRunner:
    """A ModelRunner holding rank `rank`'s shard of `inner` (split in place): local head
    counts (the KV cache's geometry), the sharded layer, and logits on rank 0 only."""

    def __init__(
        self,
        inner: Any,
        rank: int,
        world: int,
        device: torch.device,
        reduce: Callable[[torch.Tensor], torch.Tensor] = _all_reduce,
    ) -> None:
        self.split = split_for(inner, world)
        self.split.shard(inner, rank, world, device)
        self.inner, self.rank, self.world, self.reduce = inner, rank, world, reduce
        self.num_layers = inner.num_layers
        self.heads, self.kv_heads, self.head_dim = inner.heads, inner.kv_heads, inner.head_dim
        self.scale, self.vocab = inner.scale, inner.vocab
        self.device, self.dtype = device, inner.dtype

    def projections(self) -> list[tuple[object, str]]:
        out: list[tuple[object, str]] = self.inner.projections()
        return out

    def head(self) -> tuple[object, str]:
        out: tuple[object, str] = self.inner.head()
        return out

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.embed(ids, positions)
        return out

    def layer(
        self, i: int, x: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        return self.split.layer(self.inner, i, x, positions, attend, self.reduce, self.rank)

    def logits(self, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if self.rank:  # only rank 0 samples
            return x.new_empty((0, self.vocab))
        out: torch.Tensor = self.inner.logits(x, rows)
        return out


def shard_runner(inner: ModelRunner, rank: int, world: int, device: torch.device) -> ShardedRunner:
    return ShardedRunner(inner, rank, world, device)


# -- the worker protocol ------------------------------------------------------------------

_DTYPES = {0: torch.int64, 1: torch.int32}
_CODES = {v: k for k, v in _DTYPES.items()}

#: a header: (op, ints, [(dtype code, shape) or None per tensor])
Header = tuple[str, list[int], list[tuple[int, tuple[int, ...]] | None]]


def _header(op: str, tensors: Sequence[torch.Tensor | None], ints: Sequence[int] = ()) -> Header:
    shapes: list[tuple[int, tuple[int, ...]] | None] = [
        None if t is None else (_CODES[t.dtype], tuple(t.shape)) for t in tensors
    ]
    return op, list(ints), shapes


def _unpack(flat: torch.Tensor, header: Header) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    at = 0
    for shape in header[2]:
        if shape is None:
            out.append(None)
            continue
        code, dims = shape
        n = 1
        for s in dims:
            n *= s
        out.append(flat[at : at + n].view(dims).to(_DTYPES[code]))
        at += n
    return out


def _payload_size(header: Header) -> int:
    total = 0
    for shape in header[2]:
        if shape is not None:
            n = 1
            for s in shape[1]:
                n *= s
            total += n
    return total


class TPGroup:
    """Rank 0's side: the spawned workers, their pipes, and the step broadcast."""

    def __init__(
        self,
        world: int,
        device: torch.device,
        procs: list[Any],
        inboxes: list[Any],
        errors: Any,
        store_dir: str,
        timeout_s: float,
    ) -> None:
        self.world, self.device = world, device
        self.procs, self.inboxes, self.errors = procs, inboxes, errors
        self.store_dir, self.timeout_s = store_dir, timeout_s
        self.closed = False
        self.broken = False  # a step failed: a worker may never read its pipe again
        self.steps = 0

    # -- failures -------------------------------------------------------------------------

    def _reported(self, wait_s: float = 0.0) -> str | None:
        """A worker's error sentence, waiting up to wait_s for one."""
        try:
            kind, rank, text = (
                self.errors.get(timeout=wait_s) if wait_s else self.errors.get_nowait()
            )
        except (queue_mod.Empty, EOFError, OSError):
            return None
        if kind == "error":
            return f"tensor-parallel rank {rank} failed ({text.rstrip('.')})."
        return None

    def check(self) -> None:
        """Raise TPError when a worker reported an error or is gone."""
        if self.closed:
            raise TPError("the tensor-parallel workers are stopped; build a new engine.")
        if self.broken:
            raise TPError("an earlier tensor-parallel step failed; build a new engine.")
        said = self._reported()
        if said is not None:
            raise TPError(said)
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                raise TPError(
                    f"tensor-parallel rank {r} exited (code {p.exitcode}) without a word; "
                    "build a new engine."
                )

    def explain(self, e: BaseException) -> TPError:
        """One sentence for a collective that failed on rank 0 (a worker's error if one
        came, else the collective's own)."""
        self.broken = True
        said = self._reported(wait_s=2.0)
        if said is not None:
            return TPError(said)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's [file:line] prefix
        return TPError(
            f"a tensor-parallel step failed on rank 0 ({first.rstrip('.')}) under the "
            f"{self.timeout_s:g} s step timeout, and the ranks are out of step: build a new "
            "engine."
        )

    # -- a step ---------------------------------------------------------------------------

    def send(
        self, op: str, tensors: Sequence[torch.Tensor | None], ints: Sequence[int] = ()
    ) -> None:
        """Tell every worker to run `op` on these tensors (which are broadcast from here)."""
        self.check()
        header = _header(op, tensors, ints)
        for conn in self.inboxes:
            conn.send(header)  # a pipe: written here, no feeder thread to wake
        parts = [t.reshape(-1).to(self.device, torch.int64) for t in tensors if t is not None]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self.device)
        dist.broadcast(flat, src=0)
        self.steps += 1

    def close(self, join_s: float = 10.0) -> None:
        """Stop the workers (a clean exit, else terminated after join_s) and the group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.inboxes:
            try:
                conn.send(("stop", [], []))
            except (OSError, ValueError, BrokenPipeError):
                pass
        end = time.monotonic() + (min(join_s, 1.0) if self.broken else join_s)
        for p in self.procs:
            p.join(max(0.1, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a failed rank: nothing left to free
                pass
        shutil.rmtree(self.store_dir, ignore_errors=True)


def _init_group(
    store_dir: str, rank: int, world: int, device: torch.device, timeout_s: float
) -> None:
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def launch(
    engine_class: type,
    model: Any,
    engine_kwargs: dict[str, Any],
    world: int,
    device: torch.device,
    timeout_s: float,
) -> TPGroup:
    """Spawn ranks 1..world-1 (each builds an `engine_class` with its shard: the engine
    passes its own class, so this module needs no import of it), join the process group
    as rank 0; the caller builds its own shard next and then calls `wait_ready`."""
    if dist.is_initialized():
        raise TPError(
            "a torch.distributed process group is already running in this process; close "
            "the other tensor-parallel engine first (engine.close())."
        )
    ctx = torch.multiprocessing.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="opswap-tp-")
    # the model goes to the workers as a file they map, not through /dev/shm (often a
    # few MiB in containers, where sharing a model's tensors fails or kills rank 0)
    model_path = os.path.join(store_dir, "model.pt")
    try:
        torch.save(model, model_path)
    except Exception as e:
        shutil.rmtree(store_dir, ignore_errors=True)
        raise TPError(
            f"the model could not be saved for the other ranks ({type(e).__name__}: {e})."
        ) from e
    errors = ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world - 1)]  # (worker's end, rank 0's)
    inboxes = [send for _, send in pipes]
    procs = []
    for r in range(1, world):
        p = ctx.Process(
            target=_worker_main,
            args=(
                engine_class,
                r,
                world,
                model_path,
                engine_kwargs,
                store_dir,
                pipes[r - 1][0],
                errors,
                timeout_s,
                torch.get_num_threads(),
            ),
            daemon=True,
            name=f"opswap-tp-{r}",
        )
        p.start()
        procs.append(p)
    group = TPGroup(world, device, procs, inboxes, errors, store_dir, timeout_s)
    _wait_for(group, "joining")  # the workers' imports done: the rendezvous is quick now
    try:
        _init_group(store_dir, 0, world, device, timeout_s)
    except Exception as e:
        said = group._reported(wait_s=1.0)
        group.close(join_s=2.0)
        raise TPError(
            said or f"the tensor-parallel ranks did not meet within {timeout_s:g} s ({e})."
        ) from e
    return group


def wait_ready(group: TPGroup) -> None:
    """Wait until every worker built its engine (or one reported why it could not)."""
    _wait_for(group, "ready")


def _wait_for(group: TPGroup, what: str) -> None:
    """Wait until every worker said `what` (or one reported why it could not)."""
    seen: set[int] = set()
    end = time.monotonic() + START_TIMEOUT_S
    while len(seen) < group.world - 1:
        left = end - time.monotonic()
        if left <= 0:
            group.close(join_s=2.0)
            raise TPError(
                f"the tensor-parallel workers were not {what} within {START_TIMEOUT_S:g} s."
            )
        try:
            kind, rank, text = group.errors.get(timeout=min(left, 0.5))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(group.procs, 1) if not p.is_alive()]
            if dead:
                group.close(join_s=2.0)
                raise TPError(f"tensor-parallel rank {dead[0]} exited while starting.") from None
            continue
        if kind == what:
            seen.add(rank)
        else:
            group.close(join_s=2.0)
            raise TPError(f"tensor-parallel rank {rank} failed ({text.rstrip('.')}).")


def _fault(rank: int) -> tuple[int, str] | None:
    spec = os.environ.get(FAULT_ENV, "")
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == str(rank):
        return int(parts[1]), parts[2]
    return None


def _worker_main(
    engine_class: type,
    rank: int,
    world: int,
    model_path: str,
    engine_kwargs: dict[str, Any],
    store_dir: str,
    inbox: Any,
    errors: Any,
    timeout_s: float,
    threads: int,
) -> None:
    """A worker rank: build the sharded engine, then run what rank 0 sends until "stop".
    It takes rank 0's intra-op thread count (a CPU run's ranks share the cores)."""
    torch.set_num_threads(threads)
    import multiprocessing

    parent = multiprocessing.parent_process()
    fault = _fault(rank)
    try:
        device = rank_device(engine_kwargs["device"], rank, world)
        model = torch.load(model_path, map_location="cpu", mmap=True, weights_only=False)
        errors.put(("joining", rank, ""))
        _init_group(store_dir, rank, world, device, timeout_s)
        engine = engine_class(model, **engine_kwargs, tensor_parallel=world, _tp_rank=rank)
        del model
        errors.put(("ready", rank, ""))
        steps = 0
        with torch.inference_mode():
            while True:
                if not inbox.poll(0.5):
                    if parent is not None and not parent.is_alive():
                        return  # rank 0 is gone: nothing will come
                    continue
                header = inbox.recv()
                op = header[0]
                if op == "stop":
                    break
                flat = torch.empty(_payload_size(header), dtype=torch.int64, device=device)
                dist.broadcast(flat, src=0)
                if fault is not None and fault[0] == steps:
                    if fault[1] == "hang":
                        time.sleep(3600)
                    raise RuntimeError(f"injected fault at step {steps}")
                engine.run_remote(op, header[1], _unpack(flat, header))
                steps += 1
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        errors.put(("error", rank, f"{type(e).__name__}: {text}"))
        return
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
