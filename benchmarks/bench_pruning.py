"""Structured pruning (chapter 7): opswap.train.prune against Torch-Pruning (the
`torch-pruning` package, DepGraph) at the same ratios and the same importance (L1
magnitude), on the same models: what each removes and what that buys in measured time.

    PYTHONPATH=src python3 benchmarks/bench_pruning.py                 # CPU
    PYTHONPATH=src python3 benchmarks/bench_pruning.py --device cuda   # GPU (the suite)

Models: the zoo's ResNet-style CNN (width 32, 64 x 64 images, batch 8), its BERT-style
classifier (hidden 256, 4 heads, 4 layers, FFN 1024, 128 tokens, batch 8; hand-written
LayerNorm and a raw-parameter pooler), and a BERT-style encoder of the same sizes built from
nn modules only (the layout Torch-Pruning's examples use), at ratios 0.25 and 0.5. Each pruned model's parameters and MACs (PyTorch's flop counter) beside its
latency measured against the unpruned model in one interleaved loop (the speed-up next
to the MAC reduction: the figure that counts is the measured one). On the digits CNN,
top-1 on the 360 held-out images after pruning and after one epoch of fine-tuning, for
both tools.

Writes DIR/pruning_<device>.json (cpu, h100 or h200) with the date, device and versions.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import card, compare_variants, write_results  # noqa: E402

from opswap.train.prune import count_macs, count_params, prune  # noqa: E402

RATIOS = (0.25, 0.5)


class Attention(nn.Module):
    """BERT's self-attention with nn modules only (the layout Torch-Pruning's examples use)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.output = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q, k, v = (
            f(x).view(b, s, self.heads, -1).transpose(1, 2)
            for f in (self.query, self.key, self.value)
        )
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.norm(x + self.output(ctx.transpose(1, 2).reshape(b, s, -1)))


class Encoder(nn.Module):
    def __init__(self, hidden: int = 256, heads: int = 4, layers: int = 4, ffn: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, hidden)
        self.attn = nn.ModuleList(Attention(hidden, heads) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(hidden, ffn) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(ffn, hidden) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.classifier = nn.Linear(hidden, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for attn, up, down, norm in zip(self.attn, self.up, self.down, self.norm, strict=True):
            h = attn(h)
            h = norm(h + down(torch.nn.functional.gelu(up(h))))
        return self.classifier(h[:, 0])


def _models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], list[str]]]:
    from opswap.models.zoo_cnn import resnet
    from opswap.models.zoo_transformer import bert

    torch.manual_seed(0)
    cnn, cnn_x = resnet(batch=8, image_size=64, width=32)[:2]
    enc, enc_x = bert(batch=8, seq=128, hidden=256, heads=4, layers=4, intermediate=1024)[:2]
    std = Encoder().eval()
    ids = torch.randint(0, 1000, (8, 128))
    return {
        "resnet": (cnn.eval(), cnn_x, ["fc"]),
        "bert_zoo": (enc.eval(), enc_x, ["classifier"]),
        "bert_nn_modules": (std, (ids,), ["classifier"]),
    }


def torch_pruning(model: nn.Module, x: tuple, ratio: float, ignore: list[str]) -> nn.Module | str:
    """Torch-Pruning's MagnitudePruner (L1, the same ratio per layer), or why it failed.
    Attention modules with a `heads` attribute get num_heads and whole-head pruning."""
    try:
        import torch_pruning as tp

        work = copy.deepcopy(model)
        heads: dict[nn.Module, int] = {}
        owners = []
        for mod in work.modules():
            n = getattr(mod, "heads", None)
            if isinstance(n, int) and all(hasattr(mod, a) for a in ("query", "key", "value")):
                for a in ("query", "key", "value"):
                    heads[getattr(mod, a)] = n
                owners.append(mod)
        # a raw weight used as x @ W ([in, out], the zoo BERT's pooler): its input dim is
        # the one tied to the hidden width (Torch-Pruning's default is the last dim)
        raw = [(p, 0) for n, p in work.named_parameters(recurse=False) if p.dim() == 2]
        pruner = tp.pruner.MagnitudePruner(
            work,
            x,
            importance=tp.importance.MagnitudeImportance(p=1),
            pruning_ratio=ratio,
            ignored_layers=[work.get_submodule(p) for p in ignore],
            num_heads=heads,
            prune_num_heads=bool(heads),
            prune_head_dims=False,
            head_pruning_ratio=ratio,
            unwrapped_parameters=raw or None,
        )
        pruner.step()
        for mod in owners:  # the head count the forward reads, as Torch-Pruning's docs do
            mod.heads = pruner.num_heads[mod.query]
        with torch.no_grad():
            work(*x)
        return work
    except Exception as exc:  # noqa: BLE001 - a peer that fails says why
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def speed_rows(device: str, quick: bool) -> list[dict]:
    out = []
    for name, (model, x, ignore) in _models().items():
        model = model.to(device)
        x = tuple(t.to(device) for t in x)
        for ratio in RATIOS[:1] if quick else RATIOS:
            fns: dict[str, Any] = {"unpruned": model}
            info: dict[str, dict] = {"unpruned": {}}
            ours = prune(model, x, ratio, keep=ignore)
            fns["opswap"] = ours.model.eval()
            info["opswap"] = {
                "groups_pruned": sum(g.blocked is None and g.kept < g.size for g in ours.groups),
                "groups_kept_whole": {g.name: g.blocked for g in ours.groups if g.blocked},
            }
            peer = torch_pruning(model, x, ratio, ignore)
            if isinstance(peer, str):
                info["torch_pruning"] = {"error": peer}
            else:
                fns["torch_pruning"] = peer.eval()
            rows = compare_variants(
                fns, x, "unpruned", device=device, min_time_s=1.0, max_time_s=8.0
            )
            base_params, base_macs = count_params(model), count_macs(model, x)
            for r in rows:
                m = fns[r["name"]]
                r.update(
                    kind="speed",
                    model=name,
                    ratio=ratio,
                    params=count_params(m),
                    macs=count_macs(m, x),
                    params_ratio=count_params(m) / base_params,
                    macs_reduction=base_macs / max(count_macs(m, x), 1),
                    **info.get(r["name"], {}),
                )
                print({k: v for k, v in r.items() if k != "groups_kept_whole"}, flush=True)
            out += rows
            if "error" in info.get("torch_pruning", {}):
                out.append(
                    {
                        "kind": "speed",
                        "model": name,
                        "ratio": ratio,
                        "name": "torch_pruning",
                        **info["torch_pruning"],
                    }
                )
                print(out[-1], flush=True)
    return out


def accuracy_rows(quick: bool) -> list[dict]:
    from opswap.models.zoo_digits import digits_cnn
    from opswap.train.finetune_pooling import digits_batches
    from opswap.train.finetune_sparse import fine_tune_masked

    model, example, task = digits_cnn()
    batches = digits_batches(shape=(1, 8, 8))
    out = [
        {
            "kind": "accuracy",
            "model": "digits_cnn",
            "name": "unpruned",
            "ratio": 0.0,
            "top1": task.evaluate(model),
        }
    ]
    for ratio in RATIOS[:1] if quick else (*RATIOS, 0.75):
        candidates: dict[str, nn.Module | str] = {
            "opswap": prune(model, example, ratio, keep=["head"]).model,
            "torch_pruning": torch_pruning(model, example, ratio, ["head"]),
        }
        for name, m in candidates.items():
            if isinstance(m, str):
                out.append(
                    {
                        "kind": "accuracy",
                        "model": "digits_cnn",
                        "name": name,
                        "ratio": ratio,
                        "error": m,
                    }
                )
                continue
            before = task.evaluate(m.eval())
            torch.manual_seed(0)
            fine_tune_masked(m, batches, epochs=1.0)
            out.append(
                {
                    "kind": "accuracy",
                    "model": "digits_cnn",
                    "name": name,
                    "ratio": ratio,
                    "params": count_params(m),
                    "top1_pruned": before,
                    "top1_fine_tuned_1_epoch": task.evaluate(m),
                }
            )
            print(out[-1], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="one ratio (a smoke run)")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    rows = speed_rows(args.device, args.quick)
    if not args.skip_accuracy:
        rows += accuracy_rows(args.quick)
    try:
        import torch_pruning as tp

        tp_version = tp.__version__
    except Exception:  # noqa: BLE001
        tp_version = None
    if args.device == "cpu":
        device, tag = f"cpu ({torch.get_num_threads()} threads)", "cpu"
    else:
        device, tag = torch.cuda.get_device_name(0), card()
    write_results(args.out, f"pruning_{tag}.json", device, rows, torch_pruning=tp_version)


if __name__ == "__main__":
    main()
