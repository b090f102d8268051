"""opswap.train.distributed: prepared models trained under DDP and FSDP2 (gloo, two
processes on the CPU) take the steps the single-process prepared model takes on the two
ranks' batches put together; BatchNorm, in-place ops, SyncBatchNorm conversion; the
orders and cases that cannot work refused in one sentence.

The two ranks run every case in one spawn (imports and `prepare` cost seconds a process);
each case records what it saw, or its traceback, and the tests below read the records.
While the ranks run, this process computes the single-process references."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from opswap.train import prepare
from opswap.train.distributed import (
    DistributedError,
    convert_sync_batchnorm,
    full_state_dict,
    wrap,
)
from opswap.train.optim import AdamW, OptimizerError
from opswap.train.prepare import LOSS_HEAD, PrepareError

WORLD = 2
VOCAB, HIDDEN, SEQ = 97, 48, 7
PER_RANK = 2  # sequences a rank takes a step
STEPS = 3
DEADLINE_S = 150  # a hung collective fails the tests instead of blocking the suite


class _Block(nn.Module):
    """RMSNorms, attention, a SwiGLU MLP; the second residual add written in place."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 80, bias=False)
        self.up = nn.Linear(d, 80, bias=False)
        self.down = nn.Linear(80, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 4, -1).transpose(1, 2) for z in self.qkv(self.n1(x)).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        out = self.down(F.silu(self.gate(h)) * self.up(h))
        out += x  # in place, on a tensor no backward reads
        return out


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.block = _Block(HIDDEN)
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.emb.weight  # tied, as Llama 3.2 1B's: two gradients add up

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.emb(ids))))


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class _CNN(nn.Module):
    """BatchNorm in train mode and an in-place ReLU; FX keeps the BatchNorm a module call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(6 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.bn(self.conv(x))).flatten(1))


class _CNNExported(_CNN):
    """The same, iterating over a tensor's pieces, which FX cannot trace: the capture falls
    back to torch.export, and BatchNorm becomes an ATen op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (t for t in self.act(self.bn(self.conv(x))).chunk(2, 1))
        return self.fc(torch.cat([b, a], 1).flatten(1))


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS whole batches (every rank's rows), drawn from a fixed generator."""
    g = torch.Generator().manual_seed(1234)
    n = WORLD * PER_RANK
    return [
        (
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _cnn_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randn(WORLD * 3, 3, 5, 5, generator=g),
            torch.randint(0, 5, (WORLD * 3,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _prepared_lm(rows: int) -> tuple[_LM, Any]:
    torch.manual_seed(0)
    model = _LM()
    ids, labels = _lm_batches()[0]
    # the GPU target plans the norm and SwiGLU kernels and the fused loss (their CPU paths
    # run here); the rules narrowed to those families to keep the planning short
    return model, prepare(
        model,
        (ids[:rows], labels[:rows]),
        _lm_loss,
        target="h100",
        fuse_loss=True,
        rules=["norm.*", "activation.*"],
    )


def _grads(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under the user's model's name, whole (a DTensor gathered)."""
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()  # type: ignore[union-attr]
        assert g is not None, name
        out[name[name.index(prefix) + len(prefix) :]] = g.detach().clone()
    return out


def _train(call: Any, module: nn.Module, batches: list, rows: slice, prefix: str) -> dict:
    """STEPS AdamW steps of `call` on `rows` of each batch; the first step's gradients."""
    opt = AdamW(module.parameters(), lr=1e-2)
    first: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(batches):
        loss = call(x[rows], y[rows])
        loss.backward()
        if i == 0:
            first = _grads(module, prefix)
        opt.step()
        opt.zero_grad()
    return first


def _case_ddp(rank: int) -> dict:
    model, prepared = _prepared_lm(PER_RANK)
    ddp = wrap(prepared, "ddp")
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    grads = _train(ddp, ddp, _lm_batches(), rows, "graph.model.")
    state = full_state_dict(ddp)
    users = all(state[n].data_ptr() == p.data_ptr() for n, p in model.named_parameters())
    replaced = sorted({r for r, _ in prepared.report.replaced})
    return {"grads": grads, "state": state, "users_own": users, "replaced": replaced}


def _case_fsdp2(rank: int) -> dict:
    from torch.distributed.tensor import DTensor

    _, prepared = _prepared_lm(PER_RANK)
    sharded = wrap(prepared, "fsdp2")
    seen: dict[str, str] = {}

    def look(module: nn.Module, args: Any) -> None:  # after FSDP2's own pre-hook: unsharded
        w = module.graph.model.lm_head.weight
        seen["lm_head"] = f"{type(w).__name__} {list(w.shape)}"
        seen["norm"] = type(module.graph.model.norm.weight).__name__

    sharded.register_forward_pre_hook(look)
    kinds = {type(p).__name__ for p in sharded.parameters()}
    local = list(sharded.graph.model.lm_head.weight.to_local().shape)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    grads = _train(sharded, sharded, _lm_batches(), rows, "graph.model.")
    state = full_state_dict(sharded)
    is_dtensor = isinstance(sharded.graph.model.lm_head.weight, DTensor)
    return {
        "grads": grads,
        "state": state,
        "kinds": sorted(kinds),
        "seen": seen,
        "local": local,
        "dtensor_after": is_dtensor,
    }


def _case_batchnorm(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(2)
    model, twin = _CNN(), _CNN()
    twin.load_state_dict(model.state_dict())
    x, y = _cnn_batches()[0]
    prepared = prepare(model, (x[:3], y[:3]), F.cross_entropy)
    ddp, eager = wrap(prepared, "ddp"), DistributedDataParallel(twin)
    rows = slice(rank * 3, (rank + 1) * 3)
    _train(ddp, ddp, _cnn_batches(), rows, "graph.")
    _train(lambda a, b: F.cross_entropy(eager(a), b), eager, _cnn_batches(), rows, "module.")
    return {"prepared": dict(model.state_dict()), "eager": dict(twin.state_dict())}


def _message(fn: Any) -> str:
    try:
        fn()
    except (PrepareError, DistributedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _case_errors(rank: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.nn.parallel import DistributedDataParallel

    from opswap.train._wrapped import fully_shard_function

    torch.manual_seed(3)
    x, y = _cnn_batches()[0]
    out: dict[str, Any] = {}
    out["prepare_ddp"] = _message(
        lambda: prepare(DistributedDataParallel(_CNN()), (x, y), F.cross_entropy)
    )
    out["prepare_fsdp2"] = _message(
        lambda: prepare(fully_shard_function()(_CNN()), (x, y), F.cross_entropy)
    )
    prepared = prepare(_CNN(), (x, y), F.cross_entropy, rules=["layout.*"])
    ddp = wrap(prepared, "ddp")
    out["wrap_twice"] = _message(lambda: wrap(ddp, "fsdp2"))
    out["wrap_plain"] = _message(lambda: wrap(_CNN(), "ddp"))
    out["bad_mode"] = _message(lambda: wrap(prepared, "zero3"))
    out["bad_option"] = _message(
        lambda: wrap(prepare(_CNN(), (x, y), F.cross_entropy), "ddp", no_such_option=1)
    )
    out["sync_cpu"] = _message(lambda: wrap(prepared, "ddp", sync_batchnorm=True))
    # a DTensor whose gradient is laid out unlike it: torch's steps on the DTensors
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    p = nn.Parameter(DTensor.from_local(full.chunk(WORLD)[rank].clone(), mesh, [Shard(0)]))
    opt = AdamW([p], lr=0.1)
    ref = nn.Parameter(full.clone())
    ref_opt = torch.optim.AdamW([ref], lr=0.1)
    for _ in range(2):
        p.grad = DTensor.from_local(grad.clone(), mesh, [Replicate()])
        ref.grad = grad.clone()
        opt.step()
        ref_opt.step()
    out["spread_error"] = float((p.full_tensor() - ref).abs().max())
    p.grad = torch.ones(6, 5)  # a plain gradient on a sharded parameter
    try:
        opt.step()
        out["plain_grad"] = "no error"
    except OptimizerError as e:
        out["plain_grad"] = str(e)
    return out


CASES = {
    "ddp": _case_ddp,
    "fsdp2": _case_fsdp2,
    "batchnorm": _case_batchnorm,
    "errors": _case_errors,
}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    results: dict[str, Any] = {}
    try:
        for name, case in CASES.items():
            try:
                results[name] = case(rank)
            except Exception:  # recorded: the test of that case fails with it
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _references() -> dict:
    """The single-process runs: the prepared model on every rank's rows at once, and eager."""
    batches, every = _lm_batches(), slice(0, WORLD * PER_RANK)
    model, prepared = _prepared_lm(WORLD * PER_RANK)
    grads = _train(prepared, prepared, batches, every, "graph.model.")
    torch.manual_seed(0)
    eager = _LM()
    eager_grads = _train(lambda i, y: _lm_loss(eager(i), y), eager, batches, every, "")
    return {
        "grads": grads,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "eager_grads": eager_grads,
        "eager_state": {k: v.detach().clone() for k, v in eager.state_dict().items()},
        "no_group": _message(lambda: wrap(prepared, "ddp")),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("dist")
    # the spawned ranks import this module by the name pytest gave it (importlib mode):
    # they inherit sys.path, so the folder that name starts from goes on it
    root = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])
    sys.path.insert(0, root)
    try:
        ctx = mp.start_processes(
            _worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn"
        )
    finally:
        sys.path.remove(root)
    torch.set_num_threads(1)
    try:
        ref = _references()
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the two gloo ranks did not finish in {DEADLINE_S} s")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"ref": ref, "ranks": ranks}


def _case(runs: dict, name: str) -> list[dict]:
    got = [r[name] for r in runs["ranks"]]
    for r in got:
        assert "error" not in r, r.get("error")
    return got


_TIED = ("emb.weight", "lm_head.weight")


def _close(got: dict, want: dict, rtol: float, atol: float) -> None:
    for d in (got, want):  # the tied weight, named once by named_parameters: both names
        if _TIED[0] in d or _TIED[1] in d:
            d[_TIED[0]] = d[_TIED[1]] = d.get(_TIED[0], d.get(_TIED[1]))
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


def test_ddp_trains_as_one_process_on_every_ranks_rows(runs: dict) -> None:
    ref = runs["ref"]
    for r in _case(runs, "ddp"):
        assert {LOSS_HEAD, "norm.rms_norm", "norm.add_rms_norm", "activation.swiglu"} <= set(
            r["replaced"]
        )
        assert r["users_own"]  # DDP trains the model's own parameters
        # all-reduced gradients against one process's: rounding apart, the same
        _close(r["grads"], ref["grads"], rtol=1e-5, atol=1e-6)
        _close(r["state"], ref["state"], rtol=1e-5, atol=1e-6)
        # and against eager's, within the gradient check's tolerance
        _close(r["grads"], ref["eager_grads"], rtol=1e-4, atol=1e-5)
        # Adam divides by sqrt(v): a near-zero gradient magnifies rounding
        _close(r["state"], ref["eager_state"], rtol=1e-3, atol=2e-4)


def test_fsdp2_shards_and_the_kernels_see_whole_plain_tensors(runs: dict) -> None:
    ref = runs["ref"]
    for rank, r in enumerate(_case(runs, "fsdp2")):
        assert r["kinds"] == ["DTensor"] and r["dtensor_after"]
        assert r["local"] == [(VOCAB + 1) // 2 if rank == 0 else VOCAB // 2, HIDDEN]  # 97 rows
        # in forward the ops get the all-gathered weight as a plain tensor
        assert r["seen"] == {"lm_head": f"Parameter [{VOCAB}, {HIDDEN}]", "norm": "Parameter"}
        _close(r["grads"], ref["grads"], rtol=1e-5, atol=1e-6)
        _close(r["state"], ref["state"], rtol=1e-5, atol=1e-6)


def test_batchnorm_and_in_place_relu_under_ddp_match_eager_ddp(runs: dict) -> None:
    got = _case(runs, "batchnorm")
    for r in got:  # parameters, and each rank's running statistics
        _close(r["prepared"], r["eager"], rtol=1e-5, atol=1e-6)
    # DDP copies rank 0's buffers before each forward: the ranks' statistics differ by
    # their last batch only
    assert not torch.equal(
        got[0]["prepared"]["bn.running_mean"], got[1]["prepared"]["bn.running_mean"]
    )


def test_sync_batchnorm_conversion_keeps_the_models_tensors_and_its_loss() -> None:
    torch.manual_seed(4)
    model = _CNN()
    x, y = _cnn_batches()[0]
    prepared = prepare(model, (x, y), F.cross_entropy)
    torch.manual_seed(5)
    before = prepared(x, y)
    model.bn.running_mean.zero_()  # the statistics that one call moved, put back
    model.bn.running_var.fill_(1.0)
    model.bn.num_batches_tracked.zero_()
    # torch's conversion and opswap's both reach the BatchNorm the FX graph calls
    torch_way = nn.SyncBatchNorm.convert_sync_batchnorm(prepared)
    assert torch_way is prepared and isinstance(prepared.graph.model.bn, nn.SyncBatchNorm)
    assert convert_sync_batchnorm(prepared) is prepared
    bn = prepared.graph.model.bn
    assert bn.weight is model.bn.weight and bn.running_mean is model.bn.running_mean
    torch.manual_seed(5)
    after = prepared(x, y)  # no process group: SyncBatchNorm normalises as BatchNorm does
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    exported = prepare(_CNNExported(), (x, y), F.cross_entropy)
    with pytest.raises(DistributedError, match="computes BatchNorm as ATen ops"):
        convert_sync_batchnorm(exported)


def test_fused_adamw_steps_a_dtensor_whose_gradient_is_laid_out_otherwise(runs: dict) -> None:
    for r in _case(runs, "errors"):
        assert r["spread_error"] < 1e-6
        assert r["plain_grad"].startswith("A sharded (DTensor) parameter has a plain tensor")


def test_orders_that_cannot_work_are_refused_in_one_sentence(runs: dict) -> None:
    for r in _case(runs, "errors"):
        assert r["prepare_ddp"].startswith(
            "PrepareError: DistributedDataParallel is already wrapped in DistributedDataParallel;"
        )
        assert "prepare the model first" in r["prepare_ddp"]
        assert "sharded by fully_shard (FSDP2)" in r["prepare_fsdp2"]
        assert (
            r["wrap_twice"].startswith("DistributedError:") and "already wrapped" in r["wrap_twice"]
        )
        assert "wrap takes the module opswap.train.prepare returns" in r["wrap_plain"]
        assert "mode must be one of ddp, fsdp2" in r["bad_mode"]
        assert "refused the options ['no_such_option']" in r["bad_option"]
        assert r["sync_cpu"].startswith("DistributedError: SyncBatchNorm runs on GPUs only")
        for k in ("prepare_ddp", "prepare_fsdp2", "wrap_twice", "wrap_plain", "bad_mode"):
            assert r[k].count(". ") == 0 and "\n" not in r[k], r[k]  # one sentence


def test_wrap_without_a_process_group_says_so(runs: dict) -> None:
    assert runs["ref"]["no_group"] == (
        "DistributedError: torch.distributed is not initialised: call "
        "torch.distributed.init_process_group in every process before wrap."
    )
