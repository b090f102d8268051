"""What the row-wise Triton kernels (rms_norm, layer_norm, swiglu) share: whether a tensor
takes the Triton path, the block and warp count of a row, the grid of a backward that
sums weight gradients per program, and the lazy `triton.jit` that lets tests set
TRITON_INTERPRET=1 after opswap is imported.

A row kernel holds one whole row in registers (BLOCK = the next power of two of the row
length), so it reads each element once and writes each once; up to MAX_ROW elements
(64 K fp32 values over 32 warps: 64 registers a thread) it fits.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels._tables import merge_entries, read_entries

try:  # Triton is optional: without it every op runs its PyTorch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every supported environment has Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# -inf inside a kernel is written `float("-inf")` there: a compiled kernel reads no plain
# float global, and inductor, which copies a kernel's constexpr globals into its own
# source by repr, writes a constexpr -inf as the undefined name `inf`.
#: the longest row one program holds in registers
MAX_ROW = 65536
#: elements per program of the elementwise (gated activation) kernels
ELEMENTWISE_BLOCK = 1024


class KernelError(OpswapError, ValueError):
    """A tensor or setting a row kernel cannot take."""


#: Triton reads TRITON_INTERPRET when a kernel is decorated; read once here too, since every
#: eager call asks (an environment lookup per call was a measurable part of its host time)
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when opswap was
    imported), on CPU tensors."""
    return _INTERPRETING


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))


def runs_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` launches its Triton kernel: a CUDA tensor (real, or fake while
    torch.compile / torch.export trace the op, so that the kernel is what they record), or
    a real CPU tensor under the interpreter. Anything else runs the PyTorch reference."""
    if triton is None:
        return False
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and interpreting() and not _is_fake(t)


def row_settings(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of n elements: one row per program, 4 warps up to 2 K
    elements and more warps for longer rows, so that each thread keeps at most 64 fp32
    values of a row."""
    if n > MAX_ROW:
        raise KernelError(
            f"a row of {n} elements is longer than the {MAX_ROW} a row kernel holds; "
            "use the PyTorch op for this size."
        )
    block = max(16, 1 << (n - 1).bit_length())
    return block, _warps(block)


def _warps(elements: int) -> int:
    """Warps for a program holding `elements` fp32 values of a row tile: at most 64 values
    a thread."""
    return 4 if elements < 2048 else 8 if elements < 8192 else 16 if elements < 32768 else 32


@dataclass(frozen=True)
class BackwardGrid:
    """How a row kernel's backward is launched: `programs`, each taking `rows` consecutive
    rows (a multiple of `rb`) in steps of `rb` rows held as an [rb, block] tile, and
    writing one partial weight gradient that PyTorch sums afterwards."""

    programs: int
    rows: int
    rb: int
    block: int
    warps: int


#: (rows a step, programs a multiprocessor) the backward uses; benchmarks set it through
#: `backward_tuning` to sweep the choices
_TUNING: dict[str, int] = {}


@contextlib.contextmanager
def backward_tuning(rb: int | None = None, per_sm: int | None = None) -> Iterator[None]:
    """Within the block, `backward_grid` uses these (for benchmark sweeps)."""
    old = dict(_TUNING)
    _TUNING.update({k: v for k, v in (("rb", rb), ("per_sm", per_sm)) if v is not None})
    try:
        yield
    finally:
        _TUNING.clear()
        _TUNING.update(old)


#: measured backward launches per GPU class, kernel and shape class, written by
#: benchmarks/bench_row_backward.py --sweep --update-table (or --apply FILE)
BACKWARD_TABLE = Path(__file__).with_name("backward_launch.json")
_LAUNCH_MEMO: dict[tuple, tuple[int, int] | None] = {}


def backward_launches(path: Path | None = None) -> dict[tuple[str, str, str], tuple[int, int]]:
    """The table's (rows a step, programs a multiprocessor) by (device class, kernel, shape
    class); empty without a table."""
    entries = read_entries(path or BACKWARD_TABLE, "backward launch table", KernelError)
    try:
        return {_launch_key(e): (int(e["rb"]), int(e["per_sm"])) for e in entries}
    except (KeyError, TypeError, ValueError) as e:
        raise KernelError(
            f"the backward launch table {path or BACKWARD_TABLE} has an entry without its "
            f"launch ({e}); restore it from the package."
        ) from None


def _launch_key(e: dict[str, Any]) -> tuple[str, str, str]:
    return (e["device"], e["kernel"], e["shape"])


def backward_launch(kernel: str, device: torch.device, rows: int, n: int) -> tuple[int, int] | None:
    """The measured launch of `kernel`'s backward for this shape class on this GPU, or None
    (no entry: the defaults). Asked on every backward, so answers are kept."""
    if device.type != "cuda":
        return None
    from opswap.kernels.crossover import device_class, shape_class

    key = (BACKWARD_TABLE, device.index, kernel, shape_class(n, rows))
    if key not in _LAUNCH_MEMO:
        _LAUNCH_MEMO[key] = backward_launches().get((device_class(device), kernel, key[-1]))
    return _LAUNCH_MEMO[key]


def pick_backward_launches(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table entries from a sweep's rows ({case, device, hidden, rows, rb, per_sm, ms}): per
    device, kernel and shape class, the launch whose time summed over the class's shapes,
    each relative to that shape's fastest launch, is least, so that where two widths share
    a class neither is given a launch that only suits the other."""
    from opswap.kernels.crossover import shape_class

    timed = [r for r in sweep if r.get("ms")]
    best: dict[tuple, float] = {}
    for r in timed:
        k = (r["device"], r["case"], r["hidden"], r["rows"])
        best[k] = min(best.get(k, float("inf")), r["ms"])
    score: dict[tuple, dict[tuple[int, int], list[float]]] = {}
    for r in timed:
        cls = (r["device"], r["case"], shape_class(r["hidden"], r["rows"]))
        rel = r["ms"] / best[(r["device"], r["case"], r["hidden"], r["rows"])]
        score.setdefault(cls, {}).setdefault((r["rb"], r["per_sm"]), []).append(rel)
    entries = []
    for (dev, case, shape), by_launch in sorted(score.items()):
        n = max(len(v) for v in by_launch.values())
        full = {k: v for k, v in by_launch.items() if len(v) == n}  # timed at every shape
        (rb, per_sm), rels = min(full.items(), key=lambda kv: (sum(kv[1]), kv[0]))
        entries.append(
            {
                "device": dev, "kernel": case, "shape": shape, "rb": rb, "per_sm": per_sm,
                "worst_vs_fastest": round(max(rels), 4),
                "shapes": n,
            }
        )  # fmt: skip
    return entries


def update_backward_launches(
    entries: list[dict[str, Any]], source: str, path: Path | None = None
) -> int:
    """Write entries (pick_backward_launches') into the table, replacing those of the same
    key; returns how many were written."""
    merge_entries(
        path or BACKWARD_TABLE,
        [{**e, "source": source} for e in entries],
        _launch_key,
        "Measured launches of the row kernels' backward (kernels/_rows.py BACKWARD_TABLE): "
        "rb rows a step, per_sm programs a multiprocessor; written by "
        "benchmarks/bench_row_backward.py --sweep --update-table.",
        "backward launch table",
        KernelError,
    )
    _LAUNCH_MEMO.clear()
    return len(entries)


def backward_grid(
    rows: int, n: int, device: torch.device, kernel: str | None = None
) -> BackwardGrid:
    """The launch of a backward over `rows` rows of `n` elements. Each program takes a
    contiguous share of the rows, so the partial weight gradients are a few hundred rows,
    not one per input row. Where the launch table has `kernel` at this shape class on this
    GPU, its measured (rows a step, programs a multiprocessor); otherwise 4 programs a
    multiprocessor (4 in the interpreter), and rows up to 2 K elements 2 to 4 a step, so
    that each step has as many bytes in flight as a 4 K row."""
    block, _ = row_settings(n)
    measured = None if _TUNING or kernel is None else backward_launch(kernel, device, rows, n)
    rb_default = max(1, min(4, 4096 // block))
    rb = _TUNING.get("rb") or (measured[0] if measured else rb_default)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = _TUNING.get("per_sm") or (measured[1] if measured else 4)
        want *= sms
    else:
        want = 4
    per = -(-max(rows, 1) // max(1, min(rows, want)))  # rows a program
    per = -(-per // rb) * rb
    return BackwardGrid(-(-max(rows, 1) // per), per, rb, block, _warps(rb * block))


def _hint(n: Any) -> int | None:
    """A size as a plain int without adding a guard: a SymInt's hint (None if it has none)."""
    if isinstance(n, int):
        return n
    node = getattr(n, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else None


def last_dim_rows(shape: list[int]) -> tuple[int, int]:
    """(hidden, rows) of a tensor reduced or normalised over its last dim."""
    n = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return n, rows


def compiles_to_reference(
    kernel: str,
    x: torch.Tensor,
    shape_class: Callable[[list[int]], tuple[int, int]] = last_dim_rows,
) -> bool:
    """Whether an op should trace its PyTorch reference instead of its kernel: only while
    torch.compile traces the op for Inductor (AOTAutograd functionalises the graph, so x
    is a FunctionalTensor), and only on a device class where the crossover table measured
    Inductor's own code for the same function faster than the kernel at this shape class
    (`beats_compile` false; kernels/crossover.py). Inductor then fuses the reference itself,
    so a compiled model is never slower at the site than compiling the function the rule
    replaced. Eager calls, torch.export (which keeps the op) and unmeasured shapes take the
    kernel. `shape_class` maps x's sizes (plain ints: a symbolic size is read through its
    hint, adding no guard) to the table's (hidden, rows)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    if not isinstance(x, FunctionalTensor) or x.device.type != "cuda":
        return False
    sizes = [_hint(d) for d in x.shape]
    if any(d is None for d in sizes):
        return False
    from opswap.kernels import crossover

    h, r = shape_class([int(d) for d in sizes if d is not None])
    entry = crossover.lookup(kernel, crossover.device_class(x.device), x.dtype, h, r)
    return entry is not None and entry.beats_compile is False


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as a 2-D [M, N] view with unit column stride (a copy only if needed)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


_JITTED: dict[tuple[Callable[..., Any], bool], Any] = {}


def jitted(fn: Callable[..., Any]) -> Any:
    """`triton.jit(fn)`, built on first use per interpreter setting: the interpreter is
    chosen at decoration time."""
    key = (fn, interpreting())
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


# The function is named `rn` where it is defined, not only bound to that name: Inductor,
# compiling a graph that calls these kernels, copies each helper's source under the name
# its `def` gives, and the kernels call `rn` (a `_rn_fn` aliased to `rn` failed there
# with "rn is not defined", torch 2.11 on the H200).
if triton is not None:

    @triton.jit
    def rn(v, RN: tl.constexpr):
        # Triton 3.9's interpreter truncates fp32 -> bf16 casts; a GPU rounds to nearest even.
        # With RN (set only under the interpreter, for a bf16 destination) round the fp32
        # value to bf16's precision first, so the truncating cast that follows is exact.
        if RN:
            b = v.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            v = b.to(tl.float32, bitcast=True)
        return v

else:  # pragma: no cover
    rn = None  # type: ignore[assignment]


def rn_flag(dtype: torch.dtype) -> bool:
    """The RN setting for stores of `dtype` (see `rn`)."""
    return interpreting() and dtype == torch.bfloat16
