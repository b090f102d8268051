"""Where a Triton kernel of ours beats eager PyTorch and torch.compile: a measured table,
shipped in the package (`crossover.json` beside this file) and rewritten from a
benchmark's JSON (`benchmarks/bench_norm_kernels.py --update-crossover`).

An entry is keyed by (kernel, device class, dtype, shape class, pass):

- kernel: one of `kernels()` ("rms_norm", ..., "softmax", "rope", "bias_gelu_cuda",
  "flash_attention", "bias_act", "bias_act:gelu_new", ...): the names each kernel module
  declares in its CROSSOVER, so that a new kernel adds its own and no list here names it;
  opswap::bias_act has one name per kind of site it replaces, since eager's cost differs:
  "bias_act" for an activation of x + b (two eager kernels), "bias_act:FORM" for a
  written-out formula (gelu_new is eight);
- device class: "sm90" for Hopper (H100, H200), "sm80" for the A100, ... (`device_class`);
- dtype: "bfloat16", "float16", "float32";
- shape class: the hidden size's bucket (the next power of two at or above it) and the
  row count's ("h<=4096,rows<=32768"; `shape_class`); for attention, the head dim, the
  query and key lengths' buckets and causality ("d=64,sq<=4096,sk<=4096,causal";
  `attention_shape`); for group_norm the "hidden size" is a group's element count
  (C/G x spatial) and the rows are the groups (N x G);
- pass: "forward" or "forward+backward".

and says `beats_eager` / `beats_compile` (true, false, or null when not measured), with
the measured speed-ups and `source`: "measured <file> <date>" or "none yet". Against eager
the call is timed as eager code runs it, host included; against torch.compile, the GPU
time of both (CUDA-graph replays) where the benchmark measured it. The rules consult
`lookup` for `beats_eager` when they plan for a CUDA target; with no measured entry they
fall back to the roofline prediction (bytes moved by the replaced ops against the
kernel's). `beats_compile` is read when torch.compile traces an op for Inductor
(kernels/_rows.py `compiles_to_reference`): where Inductor's code was faster, the op
traces its PyTorch reference and Inductor fuses that instead.
For flash_attention, "eager" is SDPA's fastest backend at the point (what eager PyTorch
runs for `scaled_dot_product_attention`), and `beats_compile` stays null.
Nothing in the table is estimated: an entry without a measurement says "none yet".
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from opswap.errors import OpswapError
from opswap.kernels._tables import merge_entries, read_entries

TABLE = Path(__file__).with_name("crossover.json")
PASSES = ("forward", "forward+backward")
#: row-count buckets: few rows are launch-bound, many are bandwidth-bound
ROW_BUCKETS = (256, 4096, 32768)
#: target profiles (opswap.targets) -> the device class their measurements carry
_TARGET_CLASS = {"h100": "sm90", "h200": "sm90", "a100": "sm80", "l4": "sm89", "rtx4090": "sm89"}


class CrossoverError(OpswapError, ValueError):
    """A crossover table or benchmark file that cannot be read."""


def kernels() -> tuple[str, ...]:
    """The kernel names the table is keyed on: the CROSSOVER of every public module of
    opswap.kernels (the names it is measured under), the modules in name order."""
    names: list[str] = []
    for m in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if m.name.startswith("_") or m.name == __name__.rpartition(".")[2]:
            continue
        module = importlib.import_module(f"{__package__}.{m.name}")
        names.extend(getattr(module, "CROSSOVER", ()))
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Entry:
    kernel: str
    device: str
    dtype: str
    shape: str
    pass_: str
    beats_eager: bool | None = None
    beats_compile: bool | None = None
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    source: str = "none yet"

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.kernel, self.device, self.dtype, self.shape, self.pass_)

    @property
    def measured(self) -> bool:
        return self.beats_eager is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        try:
            return cls(
                str(d["kernel"]),
                str(d["device"]),
                str(d["dtype"]),
                str(d["shape"]),
                str(d["pass"]),
                d.get("beats_eager"),
                d.get("beats_compile"),
                d.get("speedup_vs_eager"),
                d.get("speedup_vs_compile"),
                str(d.get("source", "none yet")),
            )
        except KeyError as e:
            raise CrossoverError(
                f"a crossover entry lacks the field {e}; each needs kernel, device, dtype, "
                "shape and pass."
            ) from None


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(hidden: int, rows: int) -> str:
    """'h<=4096,rows<=32768': the hidden size's power-of-two bucket and the row count's
    (ROW_BUCKETS; 'rows>32768' past the last)."""
    r = next((f"rows<={b}" for b in ROW_BUCKETS if rows <= b), f"rows>{ROW_BUCKETS[-1]}")
    return f"h<={_bucket(hidden)},{r}"


#: sequence-length buckets of attention: short, mid, long
SEQ_BUCKETS = (1024, 4096)


def attention_shape(sq: int, sk: int, head_dim: int, causal: bool) -> str:
    """'d=64,sq<=4096,sk<=4096,causal': the head dim, the query and key lengths' buckets
    (SEQ_BUCKETS; 'sq>4096' past the last) and whether the attention is causal."""

    def b(name: str, n: int) -> str:
        return next((f"{name}<={x}" for x in SEQ_BUCKETS if n <= x), f"{name}>{SEQ_BUCKETS[-1]}")

    return f"d={head_dim},{b('sq', sq)},{b('sk', sk)}" + (",causal" if causal else "")


def device_class(where: Any) -> str:
    """'sm90' for a Hopper target profile or CUDA device, 'sm80' for an A100, ...; a CPU
    (or any target without a CUDA class) gives its kind or name."""
    if isinstance(where, torch.device) or isinstance(where, str) and where.startswith("cuda"):
        dev = torch.device(where)
        if dev.type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(dev)
            return f"sm{major}{minor}"
        return dev.type
    name = str(getattr(where, "name", where))
    if name in _TARGET_CLASS:
        return _TARGET_CLASS[name]
    return str(getattr(where, "kind", name))


_LOADED: dict[tuple[str, int, int], list[Entry]] = {}


def load(path: Path | str | None = None) -> list[Entry]:
    """The table's entries (the shipped one by default), parsed once per version of the
    file (every planned site and every op traced for Inductor looks the table up)."""
    p = Path(path) if path is not None else TABLE
    try:
        st = p.stat()
    except OSError as e:
        raise CrossoverError(f"the crossover table {p} cannot be read ({e}).") from None
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        entries = read_entries(p, "crossover table", CrossoverError)
        _LOADED[key] = [Entry.from_json(d) for d in entries]
    return list(_LOADED[key])


def lookup(
    kernel: str,
    device: str,
    dtype: torch.dtype | str,
    hidden: int,
    rows: int,
    pass_: str = "forward",
    entries: list[Entry] | None = None,
    shape: str | None = None,
) -> Entry | None:
    """The measured entry for this kernel and shape, or None (no entry, or "none yet").
    `shape` names the class outright (attention's `attention_shape`); otherwise it is
    `shape_class(hidden, rows)`."""
    table = load() if entries is None else entries
    cls = shape if shape is not None else shape_class(hidden, rows)
    key = (kernel, device, str(dtype).removeprefix("torch."), cls, pass_)
    for e in table:
        if e.key == key and e.measured:
            return e
    return None


def entries_from_benchmark(result: dict[str, Any], source: str) -> list[Entry]:
    """Entries for every row of a bench_norm_kernels.py result: {"device_class", "rows":
    [{kernel, dtype, rows, hidden, pass, ours_ms, eager_ms, compile_ms}, ...]}; a row whose
    "shape" is a string names its class outright (bench_attention.py's); a list there is
    the tensor's shape (bench_kernels18.py's), and the class comes from hidden and rows. A row the
    benchmark could not time (no eager or no ours) gives no entry; one without a compile
    time leaves beats_compile null."""
    dev = result.get("device_class")
    if not dev:
        raise CrossoverError("the benchmark result has no device_class; rerun it on a GPU.")
    out: dict[tuple, Entry] = {}
    for r in result.get("rows", []):
        ours, eager, comp = r.get("ours_ms"), r.get("eager_ms"), r.get("compile_ms")
        if not ours or not eager:
            continue
        # against compiled code, the kernels' GPU time (CUDA-graph replays) where measured:
        # a compiled graph launches both without eager's host work, which on a slow host
        # decides calls of tens of microseconds
        if r.get("ours_graph_ms") and r.get("compile_graph_ms"):
            ours_c, comp = r["ours_graph_ms"], r["compile_graph_ms"]
        else:
            ours_c = ours
        e = Entry(
            r["kernel"],
            dev,
            r["dtype"],
            # a class named outright (bench_attention.py's); a list is a tensor's shape
            r["shape"] if isinstance(r.get("shape"), str) else shape_class(r["hidden"], r["rows"]),
            r["pass"],
            beats_eager=ours < eager,
            beats_compile=(ours_c < comp) if comp else None,
            speedup_vs_eager=round(eager / ours, 3),
            speedup_vs_compile=round(comp / ours_c, 3) if comp else None,
            source=source,
        )
        had = out.get(e.key)
        out[e.key] = e if had is None else _least(had, e)
    return list(out.values())


def _least(a: Entry, b: Entry) -> Entry:
    """Two shapes of one class measured in one run (the width sweep's 5120 and 8192 both
    fall in h<=8192): the class is won only where both won, at the smaller speed-up, so
    that a rule never picks the kernel for a width where it measured slower."""

    def low(x: float | None, y: float | None) -> float | None:
        return y if x is None else x if y is None else min(x, y)

    def both(x: bool | None, y: bool | None) -> bool | None:
        return y if x is None else x if y is None else x and y

    return Entry(
        a.kernel,
        a.device,
        a.dtype,
        a.shape,
        a.pass_,
        beats_eager=both(a.beats_eager, b.beats_eager),
        beats_compile=both(a.beats_compile, b.beats_compile),
        speedup_vs_eager=low(a.speedup_vs_eager, b.speedup_vs_eager),
        speedup_vs_compile=low(a.speedup_vs_compile, b.speedup_vs_compile),
        source=a.source,
    )


def update(result: dict[str, Any], source: str, path: Path | str | None = None) -> list[Entry]:
    """Rewrite the table with the benchmark's measurements: its entries replace those of
    the same key, the others stay. Returns the new entries."""
    p = Path(path) if path is not None else TABLE
    new = entries_from_benchmark(result, source)
    merge_entries(
        p,
        [e.to_json() for e in new],
        lambda d: Entry.from_json(d).key,
        "Where opswap's Triton kernels beat eager PyTorch and torch.compile; see "
        "opswap/kernels/crossover.py. Written by benchmarks/bench_norm_kernels.py "
        "--update-crossover; entries without a measurement say 'none yet'.",
        "crossover table",
        CrossoverError,
    )
    return new
