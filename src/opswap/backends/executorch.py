"""ExecuTorch as a place to run the model: the program model.pt2 holds, lowered to an
ExecuTorch program (a .pte file) with the XNNPACK delegate, loaded in ExecuTorch's
runtime and wrapped as a module that takes and returns torch tensors, so that
verification and the race treat it like any other variant. This is the edge path
(phones, ARM boards); XNNPACK's x86 kernels run the same file here.

    from opswap.backends.executorch import executorch_artifact
    art = executorch_artifact(model, inputs, captured.dynamic)   # model.pte, loaded
    y = art.module(x)                                            # runs in ExecuTorch

What the lowering does, in order:

1. The program is exported again from its own graph (backends.aten.to_aten, shared
   with the TVM path), with two changes. opswap's own ops (`torch.ops.opswap.*`) call
   the Python definitions they were registered with, so the export traces them into
   the ATen ops they are made of (and makes an in-place write in one functional, as
   for the model's own): an ExecuTorch runtime has no kernel for an op it was not
   built with, and XNNPACK fuses a convolution with its ReLU by itself. An op whose
   definition does not trace to ATen ops ExecuTorch runs fails the lowering with its
   reason. And ExecuTorch plans all memory ahead of time, so every dynamic size needs
   an upper bound: each axis the file keeps dynamic is bounded by `upper_bound` (four
   times the example's size, at least 8 and at least the size verification probes).
   The module refuses a larger size in one sentence; the note names the bounds.
2. opswap's lowerings (`for_executorch`, traced in place of the ATen call): each
   scaled_dot_product_attention call is written out as two matmuls and a softmax
   (`attention_for_xnnpack`), which XNNPACK takes; ExecuTorch's own decomposition of
   the op leaves its scaling, copies and empty-row guard on the portable kernels. And
   split_with_sizes becomes one slice per piece, whose outputs keep their dynamic
   sizes in the .pte (ExecuTorch's split_with_sizes_copy kept the example's). And in the
   edge dialect a reshape with one symbolic size is written with -1 for it
   (backends._edge_views), which XNNPACK's reshape takes.
3. `to_edge_transform_and_lower` with the XnnpackPartitioner (the delegate takes what
   XNNPACK runs; the rest stays on ExecuTorch's portable kernels), then
   `to_executorch()`, written as one .pte file.

The runtime (`executorch.runtime.Runtime`) runs XNNPACK on a thread pool sized to
torch's thread count here, so that it races the PyTorch variants on the same cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from opswap.backends.aten import to_aten
from opswap.backends.pt2 import Artifact
from opswap.backends.registry import Deploy, Runtime, holds, register
from opswap.backends.runtime_module import (
    RuntimeModule,
    failed,
    first_line,
    program_file,
    require,
    tensors,
)
from opswap.backends.runtime_module import quiet as _quiet
from opswap.errors import ExportError, InputError

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from opswap.backends.pt2 import Exported
    from opswap.graph.dynamic import Axis, Dynamic


def _first(e: BaseException, limit: int = 200) -> str:
    return first_line(e, limit, innermost=True)


def _require() -> None:
    require("ExecuTorch", "executorch", "executorch", "executorch.exir")


def upper_bound(axis: Axis) -> int:
    """The largest size of a dynamic axis the .pte file accepts (memory is planned for it)."""
    return max(4 * axis.size, axis.probe, 8)


def lower_to_edge(
    program: ExportedProgram, kept: Dynamic | None = None, *, lowerings: bool = True
) -> Any:
    """`program` (an ExportedProgram, dynamic along `kept`'s axes) lowered to ExecuTorch's
    edge dialect with the XNNPACK delegate (an EdgeProgramManager). `lowerings`: attention
    written out for XNNPACK (attention_for_xnnpack); off, ExecuTorch's own decomposition,
    as a user without opswap gets."""
    _require()
    with _quiet():
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower

        from opswap.backends._edge_views import one_inferred_dim

        lower = for_executorch if lowerings else None
        program = to_aten(program, kept, upper_bound, "ExecuTorch", lower=lower)
        passes = [one_inferred_dim] if lowerings else None
        return to_edge_transform_and_lower(
            program, transform_passes=passes, partitioner=[XnnpackPartitioner()]
        )


def to_pte(
    program: ExportedProgram,
    path: str | Path,
    kept: Dynamic | None = None,
    *,
    lowerings: bool = True,
) -> Path:
    """`lower_to_edge`'s program as an ExecuTorch program, written to `path`. Raises
    ExportError with the reason."""
    path = Path(path)
    try:
        edge = lower_to_edge(program, kept, lowerings=lowerings)
        with _quiet():
            path.write_bytes(edge.to_executorch().buffer)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"ExecuTorch could not lower the model: {_first(e)}.") from e
    return path


def _attention_written_out(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    heads_inner: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention as two matmuls and a softmax, the ops XNNPACK takes.

    ExecuTorch's own decomposition of the op scales q and k apart, copies both for the
    batched matmul and guards the rows a mask empties with four element-wise passes over
    the scores, all on its portable kernels. Here the guard works on the mask, which
    seldom has a head axis (one per batch, or one for all): a row whose every key is
    masked out (-inf, or False) is given a zero mask, so its softmax stays finite, and its
    output row is multiplied by 0, which is what the op returns for it. A row that keeps a
    key gets the op's softmax unchanged; a causal row always keeps its first key.

    `heads_inner`: the op's output was laid out [batch, queries, heads, dim] in memory (as
    PyTorch's CPU kernel writes it when q is a transposed [batch, queries, heads, dim]
    tensor), and the program after it relies on that (a view of its transpose); the
    written-out output is laid out the same way."""
    s = scale if scale is not None else q.size(-1) ** -0.5
    w = torch.matmul(q, k.transpose(-2, -1)) * s
    keep = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            kept = attn_mask.any(dim=-1, keepdim=True)
            bias = torch.zeros(attn_mask.shape, dtype=w.dtype, device=w.device)
            bias = bias.masked_fill(~attn_mask, -torch.inf)
        else:
            bias = attn_mask.to(w.dtype)
            kept = (bias != -torch.inf).any(dim=-1, keepdim=True)
        w = w + bias.masked_fill(~kept, 0.0)
        keep = kept.to(w.dtype)
    elif is_causal:
        n, m = q.size(-2), k.size(-2)
        upper = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        w = w + torch.zeros(n, m, dtype=w.dtype, device=q.device).masked_fill(upper, -torch.inf)
    out = torch.matmul(torch.softmax(w, dim=-1), v)
    out = out if keep is None else out * keep
    return out.transpose(1, 2).contiguous().transpose(1, 2) if heads_inner else out


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def attention_for_xnnpack(node: fx.Node) -> Any:
    """`_attention_written_out` for a call of scaled_dot_product_attention without dropout
    or grouped heads (where it computes what the op computes), else None."""
    if node.target is not _SDPA:
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    given = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    if given.get("dropout_p", 0.0) != 0.0 or given.get("enable_gqa", False):
        return None
    if given.get("attn_mask") is not None and given.get("is_causal", False):
        return None  # the op refuses the two together; leave it to say so
    if _heads_inner(node.meta.get("val")):
        return _attention_written_out_heads_inner
    return _attention_written_out


def _attention_written_out_heads_inner(*args: Any, **kwargs: Any) -> torch.Tensor:
    """`_attention_written_out` with its output laid out as the op laid out its own (a
    function of its own: the graph calls it by name)."""
    return _attention_written_out(*args, **kwargs, heads_inner=True)


_SPLIT = torch.ops.aten.split_with_sizes.default


def _split_as_slices(
    x: torch.Tensor, split_sizes: Sequence[int], dim: int = 0
) -> tuple[torch.Tensor, ...]:
    """split_with_sizes as one slice per piece. ExecuTorch runs the op as
    split_with_sizes_copy, whose list of outputs kept the example's sizes in the .pte: a
    file lowered from a program that splits a [batch, seq, 3 * hidden] projection (what
    fusion.parallel_linear makes) refused every batch but the example's at a later
    select_copy ("Attempted to resize a static tensor"), with or without XNNPACK."""
    out, start = [], 0
    for size in split_sizes:
        out.append(x.narrow(dim, start, size))
        start = start + size
    return tuple(out)


def for_executorch(node: fx.Node) -> Any:
    """opswap's lowering of an ATen call for ExecuTorch, or None: attention written out
    for XNNPACK (attention_for_xnnpack), and split_with_sizes as slices."""
    if node.target is _SPLIT:
        return _split_as_slices
    return attention_for_xnnpack(node)


def _heads_inner(val: object) -> bool:
    """Whether the op's output (its FakeTensor `val`) is [batch, heads, queries, dim] laid
    out as [batch, queries, heads, dim], known without adding a guard on a symbolic size."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return False
    st, sz = val.stride(), val.shape
    return (
        statically_known_true(st[3] == 1)
        and statically_known_true(st[1] == sz[3])
        and statically_known_true(st[2] == sz[1] * sz[3])
        and not statically_known_true(sz[1] == 1)
    )


def _set_threads(threads: int) -> None:
    """XNNPACK's thread pool in this process, to `threads` threads."""
    from executorch.extension.pybindings import portable_lib

    reset = getattr(portable_lib, "_unsafe_reset_threadpool", None)
    get = getattr(portable_lib, "_threadpool_get_thread_count", None)
    if reset is not None and (get is None or get() != threads):
        reset(threads)


class ExecuTorchModule(RuntimeModule):
    """An ExecuTorch program's `forward` called like the module it was lowered from:
    positional tensors in (the program's inputs, in order), the model's output structure
    out."""

    def __init__(
        self,
        path: str | Path,
        out_spec: Any = None,
        threads: int | None = None,
        names: list[str] | None = None,
        bounds: dict[str, int] | None = None,
        limits: list[dict[int, tuple[str, int]]] | None = None,
    ):
        super().__init__(path, out_spec, threads)
        _require()
        self.bounds = dict(bounds or {})
        self.limits = list(limits or [])  # per input: {dim: (axis name, upper bound)}
        with _quiet():
            from executorch.runtime import Runtime as Loader

            _set_threads(self.session_threads)
            try:
                program = Loader.get().load_program(self.path)
                self.method = program.load_method("forward")
            except Exception as e:
                raise ExportError(
                    f"ExecuTorch could not load {self.path.name}: {_first(e)}."
                ) from e
        meta = self.method.metadata
        self.input_names = list(names or [f"arg{i}" for i in range(meta.num_inputs())])
        if not self.limits:  # a file loaded on its own: the sizes its memory is planned for
            self.limits = [
                {d: (f"dim {d}", n) for d, n in enumerate(meta.input_tensor_meta(i).sizes())}
                for i in range(meta.num_inputs())
            ]
        self.reopen = {"names": self.input_names, "bounds": self.bounds, "limits": self.limits}

    def run(self, args: tuple) -> list[torch.Tensor]:
        name = self.path.name
        leaves = tensors(name, self.input_names, args)
        for i, x in enumerate(leaves):
            if x.device.type != "cpu":
                raise InputError(
                    f"{name} runs in ExecuTorch on the CPU; input {self.input_names[i]} "
                    f"is on {x.device}."
                )
            lim = self.limits[i] if i < len(self.limits) else {}
            for d, (axis, top) in lim.items():
                if d < x.dim() and x.shape[d] > top:
                    raise InputError(
                        f"{name} accepts {axis} up to {top} (ExecuTorch plans its memory "
                        f"for that size); input {self.input_names[i]} has {x.shape[d]}."
                    )
        _set_threads(self.session_threads)
        feed = [x.detach().contiguous() for x in leaves]
        try:
            outs = self.method.execute(feed)
        except Exception as e:
            raise InputError(f"{name} refused the inputs: {_first(e, 240)}.") from e
        return [o.clone() for o in outs]


def executorch_artifact(
    model: nn.Module | None,
    inputs: tuple,
    dynamic: Dynamic | None = None,
    directory: str | Path | None = None,
    *,
    exported: Any = None,
    name: str = "model.pte",
    lowerings: bool = True,
) -> Artifact:
    """`model` (or `exported`, backends.pt2's (program, note, kept) of it) lowered to an
    ExecuTorch program with the XNNPACK delegate and loaded in ExecuTorch's runtime: an
    Artifact whose `module` is the ExecuTorchModule over the file that is timed; never
    raises (its `error` says why)."""
    got = program_file(
        model,
        inputs,
        dynamic,
        exported,
        directory,
        name,
        reason=_first,
        needs="executorch_artifact",
    )
    if isinstance(got, Artifact):
        return got
    program, note, kept, path = got
    bounds = {a.name: upper_bound(a) for a in kept.axes} if kept is not None else {}
    if bounds:
        said = ", ".join(f"{k} up to {v}" for k, v in bounds.items())
        note = "; ".join(filter(None, [note, f"{name} accepts {said}"]))
    try:
        to_pte(program, path, kept, lowerings=lowerings)
        limits: list[dict[int, tuple[str, int]]] = [{} for _ in program.graph_signature.user_inputs]
        for a in kept.axes if kept is not None else []:
            for i, d in a.dims:
                if i < len(limits):
                    limits[i][d] = (a.name, bounds[a.name])
        module = ExecuTorchModule.of_program(path, program, bounds=bounds, limits=limits)
    except ExportError as e:
        return failed(path, e, note, kept)
    return Artifact(path, module, note=note, kept=kept)


@register
class ExecuTorch(Runtime):
    """ExecuTorch with the XNNPACK delegate, the edge path: `executorch` and
    `opswap+executorch` (with opswap's lowerings for XNNPACK); `--export executorch|pte`
    saves model.pte."""

    name = "executorch"
    title = "ExecuTorch"
    rank = 30
    file = "model.pte"
    needs = ("executorch",)
    extra = "executorch"
    runs = "ExecuTorch runs"
    exports = ("executorch", "pte")
    saves = "a .pte file"
    exported_as = "an ExecuTorch program"
    no_layers = "keeps its intermediate values inside the XNNPACK delegate"
    # measured: BERT-base's own attention made one scaled_dot_product_attention by the rule
    # ran 0.84x as fast in ExecuTorch; XNNPACK takes the matmuls and softmax the model had
    left_out = (
        ("attention.sdpa",),
        "a .pte file, and XNNPACK runs the model's own attention faster than one "
        "scaled_dot_product_attention call (an existing one is written out for it)",
    )

    def build(
        self,
        model: nn.Module | None,
        inputs: tuple,
        dynamic: Dynamic | None = None,
        *,
        exported: Exported | None = None,
        mine: bool = True,
        export: bool = False,
        portable: bool = False,
    ) -> Artifact:
        return executorch_artifact(model, inputs, dynamic, exported=exported, lowerings=mine)

    def load(self, path: Path) -> nn.Module:
        return ExecuTorchModule(path)  # a tensor or a tuple: the file has no pytree

    def deploy(self, mine: bool, file: str) -> Deploy:
        return Deploy(
            holds(mine, "lowered to an ExecuTorch program (XNNPACK delegate)"),
            f'executorch.runtime.Runtime.get().load_program("DIR/{file}")'
            '.load_method("forward").execute([...]) on the device (an ExecuTorch runtime built '
            "with the XNNPACK backend), or opswap.load_optimized(DIR) here",
            "executorch (XNNPACK delegate, CPU)",
        )
