"""Chapter 27: a prepared model trained by two processes (DDP, or FSDP2 with --fsdp2).

Each of two processes (gloo on the CPU; NCCL and one GPU a process in real use) builds
the same small language model, prepares it with its loss (opswap's fused linear +
cross-entropy and RMSNorm kernels planned, gradients checked against eager), wraps the
prepared module with opswap.train.distributed.wrap and trains it with opswap's fused
AdamW on its own half of each batch. Then both ranks gather the trained weights under the
model's own names (`full_state_dict`) and rank 0 checks them against one process that
took the same steps on the whole batches.

    python examples/ch27_ddp.py            # DDP
    python examples/ch27_ddp.py --fsdp2    # FSDP2: the parameters sharded across the ranks
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ, ROWS, STEPS = 61, 32, 9, 2, 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.norm1 = nn.RMSNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 64), nn.GELU(), nn.Linear(64, HIDDEN))
        self.norm2 = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.mlp(self.norm1(h))
        return self.lm_head(self.norm2(h))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole batches: two rows a rank, a repeating pattern to learn."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (2 * ROWS, 1), generator=g)
        ids = (start + torch.arange(SEQ + 1)) % VOCAB
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def train(
    call: Callable[..., torch.Tensor], params: Iterable[torch.Tensor], rows: slice
) -> list[float]:
    from opswap.train.optim import AdamW

    opt = AdamW(params, lr=1e-2)
    losses = []
    for ids, labels in batches():
        loss = call(ids[rows], labels[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def rank_main(rank: int, port: int, mode: str) -> None:
    import opswap.train
    from opswap.train.distributed import full_state_dict, wrap

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = TinyLM()
    ids, labels = batches()[0]
    # the GPU target plans the kernels (their CPU paths run here)
    prepared = opswap.train.prepare(model, (ids[:ROWS], labels[:ROWS]), loss_fn, target="h100")
    wrapped = wrap(prepared, mode)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    losses = train(wrapped, wrapped.parameters(), mine)
    trained = full_state_dict(wrapped)  # every rank calls it: under FSDP2 it gathers
    if rank == 0:
        print(f"rank 0 of 2, {mode}: replaced", sorted({r for r, _ in prepared.report.replaced}))
        print("  its losses (its half of each batch):", " ".join(f"{x:.3f}" for x in losses))
        torch.manual_seed(0)
        one = TinyLM()
        alone = opswap.train.prepare(one, (ids, labels), loss_fn, target="h100")
        train(alone, one.parameters(), slice(0, 2 * ROWS))  # one process, whole batches
        worst = max(float((trained[k] - v).abs().max()) for k, v in one.state_dict().items())
        print(f"  trained weights against one process on the whole batches: max |diff| {worst:.1e}")
        assert worst < 1e-5, worst
    dist.destroy_process_group()


def main() -> None:
    mode = "fsdp2" if "--fsdp2" in sys.argv else "ddp"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    mp.start_processes(rank_main, args=(port, mode), nprocs=2, start_method="spawn")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
