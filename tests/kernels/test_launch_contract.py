"""What every Triton kernel of opswap must keep for torch.compile to take it.

Under torch.compile, inductor re-binds a `wrap_triton` launch by the kernel's parameter
names and drops any default: a constexpr left to its default reaches the compiled kernel
missing ("Incorrect number of arguments passed to kernel"), which the interpreter never
shows. So no kernel declares a default, and a launch that forgets a flag fails here, in
the interpreter, as it would under compile on a GPU.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import opswap.kernels as kernels  # noqa: E402


def _kernel_functions() -> list[tuple[str, object]]:
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"opswap.kernels.{info.name}")
        for name, fn in vars(module).items():
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            params = inspect.signature(fn).parameters.values()
            if any(p.annotation in (tl.constexpr, "tl.constexpr") for p in params):
                found.append((f"{info.name}.{name}", fn))
    return found


KERNELS = _kernel_functions()


def test_the_kernels_are_found():
    names = {n.split(".")[0] for n, _ in KERNELS}
    assert {
        "decode_attention",
        "_flash_fwd",
        "_flash_bwd",
        "softmax",
        "rms_norm",
        "group_norm",
        "activation",
    } <= names


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_no_constexpr_has_a_default(name, fn):
    defaults = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    ]
    assert not defaults, f"{name}: pass {defaults} at every launch instead of defaulting them"


@pytest.mark.parametrize("name,fn", KERNELS, ids=[n for n, _ in KERNELS])
def test_constexpr_globals_survive_inductors_copy(name, fn):
    """Inductor pastes a kernel's constexpr globals into its own source by repr; a value
    whose repr is no Python literal (-inf is written `inf`) breaks the compiled model."""
    for g in fn.__code__.co_names:
        value = fn.__globals__.get(g)
        if isinstance(value, tl.constexpr):
            text = repr(value.value)
            assert eval(text, {}) == value.value, f"{name}: global {g} is written {text}"


#: the kernels' float scalars (every other scalar is a size or a stride)
FLOAT_ARGS = ("qk_scale", "scale", "eps", "offset", "factor", "slope")
_POINTERS = {
    "len_ptr": "*i32",
    "pos_ptr": "*i32",
    "w_ptr": "*fp32",
    # the fused AdamW's tables of tensor addresses, element counts and work items
    "tab_ptr": "*i64",
    "num_ptr": "*i64",
    "work_ptr": "*i64",
}


def _constexpr_value(name: str):
    """A value each constexpr takes in some launch: tiles of 32, head dim 64, the flags
    on (more of the body is built), TMA and the fp32 dots off, op codes 0."""
    if name in ("PREC",):
        return "tf32"
    if name in ("USE_TMA", "DOT_F32"):
        return False
    if name.startswith("BLOCK") or name in ("D", "CBLOCK"):
        return 32 if name != "D" else 64
    if name in ("OP", "ACT"):
        return 0
    if name in ("ROWS", "SPLIT_K"):
        return 1
    if name == "BITS":
        return 8
    if name == "GROUP":
        return 32
    return True


def _ttir(fn) -> str:
    """`fn` built to Triton IR for an sm_90 target with every float scalar typed fp64,
    as inductor types a float it traced as a SymFloat."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    params = [p.name for p in inspect.signature(fn).parameters.values()]
    consts, sig = {}, {}
    for p in inspect.signature(fn).parameters.values():
        if p.annotation in (tl.constexpr, "tl.constexpr"):
            consts[p.name] = _constexpr_value(p.name)
            sig[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            sig[p.name] = _POINTERS.get(p.name, "*fp32")
        else:
            sig[p.name] = "fp64" if p.name in FLOAT_ARGS else "i32"
    assert params
    src = triton.compiler.ASTSource(triton.jit(fn), sig, consts)
    options = backend.parse_options({"num_warps": 4})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
        context,
    )  # fmt: skip
    return str(module)


FLOAT_KERNELS = [
    (n, fn)
    for n, fn in KERNELS
    if any(p in FLOAT_ARGS for p in inspect.signature(fn).parameters)
    and not n.startswith("weight_only")
]


def test_the_float_kernels_are_found():
    names = {n for n, _ in FLOAT_KERNELS}
    assert {"decode_attention._decode_split_fn", "_flash_fwd._flash_fwd_fn"} <= names
    assert {"rms_norm._rms_fwd_fn", "layer_norm._ln_bwd_fn", "softmax._softmax_fwd_fn"} <= names
    assert {"activation._bias_act_fwd_fn", "activation._bias_act_bwd_fn"} <= names


@pytest.mark.parametrize("name,fn", FLOAT_KERNELS, ids=[n for n, _ in FLOAT_KERNELS])
def test_a_float_scalar_typed_fp64_keeps_the_math_fp32(name, fn):
    """Inductor passes a float that dynamo did not specialise (a SymFloat: scale, eps) as
    fp64. A kernel that multiplies its fp32 tiles by it computes in fp64 (slow on the
    GPU) or fails to build where the product is loop-carried (the decode kernel's
    running max under torch.compile). Each kernel casts its float scalars to fp32 first."""
    text = _ttir(fn)
    f64_math = [
        line.strip()
        for line in text.splitlines()
        if "f64" in line and "tt.func" not in line and "arith.truncf" not in line
    ]
    assert not f64_math, f"{name} computes in fp64 from a float scalar: {f64_math[:3]}"
