"""Running ONNX models in ONNX Runtime on CPU: sessions, random inputs at chosen sizes,
output comparison with opswap's metrics and one interleaved timing loop (bench.timing).

The reference is the original file in ONNX Runtime with its graph optimizations off, so
that what is compared is the file as written; candidates run as a user would run them,
with ORT's optimizations on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from opswap.errors import VerificationError

if TYPE_CHECKING:
    import onnx

    from opswap.onnx.model import InputSpec, OnnxModel


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - the extra is installed in CI
        raise VerificationError(
            "Running .onnx models needs onnxruntime: pip install 'opswap[onnx]'."
        ) from None
    return ort


def session(model: onnx.ModelProto | bytes | str, *, optimize: bool = True, threads: int = 0):
    """An ORT CPU session of a model (a proto, its bytes or a path)."""
    ort = _ort()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if threads:
        opts.intra_op_num_threads = threads
    src = model if isinstance(model, (bytes, str)) else model.SerializeToString()
    try:
        return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise VerificationError(
            f"ONNX Runtime cannot load the model ({str(e).splitlines()[0][:300]})."
        ) from None


def reference(model: OnnxModel):
    """The ORT session of `model`'s file as given, graph optimizations off (made once)."""
    if model._reference is None:
        model._reference = session(model.as_given, optimize=False)
    return model._reference


def random_inputs(
    specs: list[InputSpec], sizes: dict[str, int], seed: int
) -> dict[str, np.ndarray]:
    """Fresh inputs at `sizes`: normal floats; ones for masks; ids below the rows of the
    table they index, else small enough for any vocabulary (type ids 0 or 1, others
    below 64)."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in specs:
        shape = s.shape(sizes)
        dt = np.dtype(s.dtype)
        low = s.name.lower()
        if dt == np.bool_:
            out[s.name] = np.ones(shape, dtype=bool)
        elif np.issubdtype(dt, np.integer):
            if "mask" in low:
                out[s.name] = np.ones(shape, dtype=dt)
            else:
                high = s.high or (2 if "type" in low else 64)
                out[s.name] = rng.integers(0, high, size=shape).astype(dt)
        else:
            out[s.name] = rng.standard_normal(shape).astype(dt)
    return out


@dataclass
class Check:
    """The candidate against the reference at every size tried."""

    passed: bool
    metrics: dict[str, Any]
    shapes: list[dict[str, int]]
    reasons: list[str] = field(default_factory=list)
    ran: bool = True  # False: the candidate did not load or run (reasons say why)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.metrics,
            "passed": self.passed,
            "shapes": self.shapes,
            "reasons": self.reasons,
        }


def verify(
    loaded: OnnxModel,
    candidate: onnx.ModelProto,
    sizes: list[dict[str, int]],
    exactness: str = "exact",
    samples: int = 2,
) -> Check:
    """Run the file as given (ORT optimizations off) and `candidate` on the same fresh
    inputs at each of `sizes`, `samples` draws each; compare every output with
    verify.metrics. A candidate ORT cannot load or run fails, with the reason; the
    original failing to run is refused (VerificationError)."""
    import torch

    from opswap.verify.metrics import combine, compare
    from opswap.verify.tolerance import Tolerance

    ref = reference(loaded)
    names = [o.name for o in ref.get_outputs()]
    try:
        cand = session(candidate)
    except VerificationError as e:
        return _failed(sizes, f"the model does not load in ONNX Runtime: {e}")
    got = []
    for k, sz in enumerate(sizes):
        for j in range(samples):
            feeds = random_inputs(loaded.inputs, sz, seed=1000 * k + j)
            try:
                r = ref.run(names, feeds)
            except Exception as e:
                raise VerificationError(
                    f"the original model does not run at sizes {sz} ({str(e).splitlines()[0][:200]}); "
                    "give sizes it accepts with --set NAME=SIZE."
                ) from None
            try:
                c = cand.run(names, feeds)
            except Exception as e:
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                return _failed(sizes, f"the model does not run at sizes {sz}: {first}")
            got += [
                compare(torch.from_numpy(np.asarray(a)), torch.from_numpy(np.asarray(b)))
                for a, b in zip(r, c, strict=True)
            ]
    m = combine(got)
    passed, reasons = Tolerance.for_exactness(exactness).check(m)
    return Check(passed, m.to_json(), sizes, reasons)


def _failed(sizes: list[dict[str, int]], reason: str) -> Check:
    nan = float("nan")
    metrics = {"max_abs": nan, "max_rel": nan, "cosine": nan, "sqnr_db": nan, "rel_l2": nan}
    return Check(False, metrics, sizes, [reason], ran=False)


def time_models(
    models: dict[str, onnx.ModelProto],
    loaded: OnnxModel,
    sizes: dict[str, int],
    *,
    min_time_s: float = 1.0,
    max_time_s: float = 20.0,
    threads: int = 0,
):
    """The models timed in one interleaved loop (bench.timing.benchmark) on the same
    inputs, each session on `threads` intra-op threads (0: ORT's default); the
    BenchResult."""
    from opswap.bench.timing import benchmark

    feeds = random_inputs(loaded.inputs, sizes, seed=7)

    def call(s) -> Callable[[], Any]:
        return lambda: s.run(None, feeds)

    fns = {name: call(session(proto, threads=threads)) for name, proto in models.items()}
    return benchmark(fns, warmup=3, repeats=10, min_time_s=min_time_s, max_time_s=max_time_s)
