"""Keyword example inputs: a model whose forward needs keywords, called positionally.

opswap's stages work on a tuple of positional tensors: capture, shape probes,
random verification samples and timing all take `inputs[i]` and vary its sizes.
A model called as `model(x, mask=m, scale=2.0)` is wrapped in a `KeywordCall`:
its forward takes the tensors positionally, in a recorded order (the positional
tensors first, then the keyword tensors in the order given), and calls the model
with their keyword names; every value that is not a tensor (a bool, int, float,
string, None, dtype, or a tuple of those) is bound as a constant. The wrapper is
what capture sees, so the optimized and the saved model take their inputs
positionally in that order, and the constants are baked in; `KeywordCall.order`
and `describe()` say which.

The wrapper holds the user's model at `.model` and neither calls nor changes it;
copies of it (graph.copies.private_copy) are deep copies of the model inside, so
the user's hooks are dropped or kept there exactly as for an unwrapped model.
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from opswap.errors import OpswapError

_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def split_inputs(value: Any) -> tuple[tuple, dict] | None:
    """(args, kwargs) when `value` carries keyword inputs: a dict of keyword inputs, or an
    (args, kwargs) pair whose args are a tuple or list; None for positional inputs."""
    if isinstance(value, Mapping):
        return (), dict(value)
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple | list)
        and isinstance(value[1], Mapping)
    ):
        return tuple(value[0]), dict(value[1])
    return None


def _constant(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return all(_constant(v) for v in value)
    return isinstance(value, _CONSTANTS)


def _check(name: str, value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor) or _constant(value):
        return
    inner = ""
    if isinstance(value, tuple | list | Mapping):
        inner = (
            " holding tensors"
            if any(
                isinstance(v, torch.Tensor)
                for v in (value.values() if isinstance(value, Mapping) else value)
            )
            else ""
        )
    raise OpswapError(
        f"The {name} input in {where} is a {type(value).__name__}{inner}; opswap takes each "
        "tensor as its own argument, and binds bools, numbers, strings and None as "
        "constants: pass the tensors one by one."
    )


def _forward_names(model: nn.Module) -> list[str]:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _usable(name: Any, taken: set[str]) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and name != "self"
        and name not in taken
    )


def _fresh(wish: str, fallback: str, taken: set[str]) -> str:
    name = wish if _usable(wish, taken) else fallback
    while not _usable(name, taken):
        name = "_" + name
    taken.add(name)
    return name


# A layout is one (kind, key, param) per argument of the call: kind "arg" (key "#i") or
# "kw" (key: the keyword); param is the forward parameter feeding it, None for a constant.
Layout = tuple[tuple[str, str, str | None], ...]
_CLASSES: dict[Layout, type[KeywordCall]] = {}


def _class_for(layout: Layout) -> type[KeywordCall]:
    """The KeywordCall subclass whose forward has one named parameter per input: FX traces
    a module's class forward and names placeholders after its parameters, and `*inputs`
    would reach the model as one tuple proxy."""
    if layout in _CLASSES:
        return _CLASSES[layout]
    params, call = [], []
    for kind, key, param in layout:
        expr = f"self.bound[{key!r}]" if param is None else param
        if param is not None:
            params.append(param)
        if kind == "arg":
            call.append(expr)
        elif _usable(key, set()):
            call.append(f"{key}={expr}")
        else:  # a keyword no Python name can spell
            call.append(f"**{{{key!r}: {expr}}}")
    source = (
        f"def forward(self{''.join(', ' + p for p in params)}):\n"
        f"    return self.model({', '.join(call)})\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "<opswap.graph.keywords>", "exec"), namespace)  # noqa: S102
    cls = cast(
        type[KeywordCall],
        type(
            "KeywordCall",
            (KeywordCall,),
            {"forward": namespace["forward"], "__module__": __name__, "_layout": layout},
        ),
    )
    _CLASSES[layout] = cls
    return cls


def _rebuild(layout: Layout) -> KeywordCall:
    cls = _class_for(layout)
    return cls.__new__(cls)


def _make(layout: Layout, model: nn.Module, bound: dict[str, Any]) -> KeywordCall:
    wrapper = _class_for(layout)()
    wrapper.model = model
    wrapper.bound = bound
    wrapper.training = model.training  # not .eval()/.train(): the user's model is left alone
    return wrapper


class KeywordCall(nn.Module):
    """`model` called with keywords from inputs given positionally (see the module doc).

    Build one with `KeywordCall.wrap(model, args, kwargs)`; `order` names the inputs
    in the order forward takes them, `bound` holds the constants.
    """

    _layout: Layout = ()
    model: nn.Module
    bound: dict[str, Any]

    @staticmethod
    def wrap(
        model: nn.Module, args: tuple, kwargs: Mapping[str, Any], where: str = "the example inputs"
    ) -> tuple[KeywordCall, tuple]:
        """(wrapper, positional inputs): the tensors of `args` and `kwargs` in the order the
        wrapper takes them. Raises OpswapError on a value that is neither a tensor nor a
        constant."""
        if not isinstance(model, nn.Module):
            raise OpswapError(
                f"Keyword inputs need an nn.Module to call, got {type(model).__name__}."
            )
        for name in kwargs:
            if not isinstance(name, str):
                raise OpswapError(f"Keyword input names in {where} must be strings, got {name!r}.")
        names = _forward_names(model)
        # keyword tensors keep their own names; positional ones take the forward's
        taken = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and _usable(k, set())}
        layout: list[tuple[str, str, str | None]] = []
        inputs, bound = [], {}
        for i, value in enumerate(args):
            label = names[i] if i < len(names) else f"input{i}"
            _check(f"positional argument {i} ({label})", value, where)
            if isinstance(value, torch.Tensor):
                layout.append(("arg", f"#{i}", _fresh(label, f"input{i}", taken)))
                inputs.append(value)
            else:
                layout.append(("arg", f"#{i}", None))
                bound[f"#{i}"] = value
        for j, (name, value) in enumerate(kwargs.items()):
            _check(f"keyword '{name}'", value, where)
            if isinstance(value, torch.Tensor):
                taken.discard(name)
                layout.append(("kw", name, _fresh(name, f"input{len(args) + j}", taken)))
                inputs.append(value)
            else:
                layout.append(("kw", name, None))
                bound[name] = value
        if not inputs:
            raise OpswapError(
                f"{where} hold no tensor; opswap needs at least one tensor input to trace and vary."
            )
        return _make(tuple(layout), model, bound), tuple(inputs)

    @property
    def order(self) -> list[str]:
        """The inputs in the order forward takes them: the keyword names, and for positional
        inputs the model's parameter names."""
        return [
            key if kind == "kw" else param for kind, key, param in self._layout if param is not None
        ]

    @property
    def keywords(self) -> bool:
        """Whether the model is called with keywords (not only with bound positional values)."""
        return any(kind == "kw" for kind, _, _ in self._layout)

    @property
    def config(self):  # the model's config (a Hugging Face model), for who looks for one
        return getattr(self.model, "config", None)

    def describe(self) -> str:
        """One sentence: the positional order the saved model takes, and the constants."""
        text = "takes its inputs positionally in this order: " + ", ".join(self.order)
        if self.bound:
            consts = ", ".join(
                f"{k if not k.startswith('#') else 'argument ' + k[1:]}={v!r}"
                for k, v in self.bound.items()
            )
            text += f" ({consts} bound as {'a constant' if len(self.bound) == 1 else 'constants'})"
        return text

    def __reduce_ex__(self, protocol):
        # the class is made at run time: rebuild it from the layout, then restore the state
        return _rebuild, (self._layout,), self.__dict__


def has_constants(args: Any) -> bool:
    """True when positional inputs hold a value that is not a tensor (a bool, a number, a
    string, None): a graph would bake it in and answer for it whatever is passed later."""
    return isinstance(args, tuple | list) and any(
        not isinstance(v, torch.Tensor) and _constant(v) for v in args
    )


def keyword_call(
    model: nn.Module, example_inputs: Any, where: str = "the example inputs"
) -> tuple[nn.Module, Any]:
    """(model, inputs) unchanged for positional tensor inputs; (KeywordCall, positional
    tensors) for a dict of keyword inputs, an (args, kwargs) pair, or positional inputs
    that hold constants (bound as constants, so that the optimized model takes only the
    tensors and a call with other values is refused by the argument count)."""
    split = split_inputs(example_inputs)
    if split is None:
        if isinstance(model, nn.Module) and has_constants(example_inputs):
            return KeywordCall.wrap(model, tuple(example_inputs), {}, where=where)
        return model, example_inputs
    if split[0] and not split[1] and not has_constants(split[0]):  # (args, {}): positional
        return model, split[0]
    return KeywordCall.wrap(model, *split, where=where)


def positional(fn: Any, like: nn.Module) -> Any:
    """`fn` made to take the inputs `like` (a KeywordCall, or any module) takes: opswap's own
    graphs and other KeywordCalls already do; any other module is wrapped the same way."""
    import torch.fx as fx

    if (
        not isinstance(like, KeywordCall)
        or isinstance(fn, KeywordCall | fx.GraphModule)
        or not isinstance(fn, nn.Module)
    ):
        return fn
    return _make(like._layout, fn, dict(like.bound))
