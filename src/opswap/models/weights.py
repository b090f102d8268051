"""`--weights FILE`: a state dict loaded into the architecture a spec builds.

The file is a `.safetensors` file or a `torch.save` state dict; the latter is read
with `torch.load(weights_only=True)`, so no pickled code runs, and a file that
holds anything but named tensors is refused. A state dict may come from the bare
model or from the wrapper opswap builds around it (`hf:` models sit at `.model`
of an `HFModule`), or from a `DataParallel` / `torch.compile` copy (`module.`,
`_orig_mod.`): the keys are read under the prefix change (strip one, add one)
that lets most of them name a tensor of the model. Tied weights (an LM head
sharing the embedding's tensor) count as present when any of their names is in
the file, and a file holding different values under two names of one tied
tensor is refused (copying both in, the last would win and the other be lost).
Values are copied into the model's own tensors, so they take the
model's dtype.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opswap.errors import SpecError

_FIRST = 3  # keys named in a message
# not a size: knobs that shape the example inputs or the random weights
_NOT_SIZES = {"batch", "seq", "seq_len", "image_size", "seed"}
_LAYERISH = re.compile(r"layer|depth|block", re.I)
_GENERIC = {"model", "weight", "bias", "size", "num", "max", "n", "dim"}


@dataclass(frozen=True)
class Fit:
    """How a file's keys are read: drop `strip` from the front, then put `add` there."""

    strip: str = ""
    add: str = ""

    def key(self, k: str) -> str | None:
        if not k.startswith(self.strip):
            return None
        return self.add + k[len(self.strip) :]

    def describe(self) -> str:
        parts = []
        if self.strip:
            parts.append(f"'{self.strip}' removed")
        if self.add:
            parts.append(f"'{self.add}' added")
        return " and ".join(parts)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The named tensors of a .safetensors or torch.save file; SpecError for anything else."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise SpecError(f"Weights file {path} does not exist; check the path after --weights.")
    if path.endswith(".pt2"):
        raise SpecError(
            f"{name} is a saved program, not a weights file; give it as the model "
            "spec itself (it carries its weights)."
        )
    if path.endswith(".safetensors") or _looks_like_safetensors(path):
        return _read_safetensors(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found:
            raise SpecError(
                f"{name} holds a pickled {found[1]}, which opswap does not unpickle; save "
                "model.state_dict() alone (or convert the file to safetensors with code you "
                "trust)."
            ) from e
        why = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        raise SpecError(
            f"{name} is neither a safetensors file nor a torch.save file of "
            f"tensors ({why[1].strip() if why else 'unreadable pickle'})."
        ) from e
    except Exception as e:  # torch raises RuntimeError, KeyError, EOFError ... on non-checkpoints
        raise SpecError(
            f"{name} is neither a safetensors file nor a torch.save file "
            f"({type(e).__name__}: {str(e)[:120]})."
        ) from e
    return _tensors_only(data, name)


def _looks_like_safetensors(path: str) -> bool:
    # 8 bytes of little-endian header length, then the JSON header
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    name = os.path.basename(path)
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise SpecError(
            f"Reading {name} needs the safetensors package; install it with "
            "pip install safetensors."
        ) from e
    try:
        return load_file(path, device="cpu")
    except Exception as e:  # SafetensorError on a damaged or foreign file
        raise SpecError(f"{name} could not be read as a safetensors file ({str(e)[:120]}).") from e


def _tensors_only(data: Any, name: str) -> dict[str, torch.Tensor]:
    if not isinstance(data, Mapping):
        raise SpecError(
            f"{name} holds a {type(data).__name__}, not a state dict; save "
            "model.state_dict() to it."
        )
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            hint = " (a training checkpoint?)" if isinstance(value, Mapping) else ""
            raise SpecError(
                f"{name} holds {key!r} (a {type(value).__name__}) besides tensors{hint}; save "
                "model.state_dict() alone."
            )
    return dict(data)


def _prefixes(keys: Iterable[str], depth: int = 2) -> set[str]:
    """The first one or two parts of the keys, each leaving at least `module.tensor`
    behind: a prefix change never maps a bare 'weight' onto some module's weight."""
    out = {""}
    for k in keys:
        parts = k.split(".")
        for i in range(1, min(depth, len(parts) - 2) + 1):
            out.add(".".join(parts[:i]) + ".")
    return out


def best_fit(file_keys: Iterable[str], model_keys: Iterable[str]) -> Fit:
    """The prefix change under which most file keys name a model key (no change on a tie)."""
    file_keys, model_keys = list(file_keys), set(model_keys)
    best, score = Fit(), -1
    for strip in sorted(_prefixes(file_keys), key=len):
        for add in sorted(_prefixes(model_keys), key=len):
            if strip and add and strip == add:
                continue
            fit = Fit(strip, add)
            n = sum(fit.key(k) in model_keys for k in file_keys)
            if n > score:
                best, score = fit, n
    return best


def _tie_groups(module: nn.Module) -> dict[str, set[str]]:
    """Each state-dict key and the keys naming the same tensor (tied weights)."""
    by_tensor: dict[int, set[str]] = {}
    state = module.state_dict(keep_vars=True)
    for k, v in state.items():
        by_tensor.setdefault(id(v), set()).add(k)
    return {k: by_tensor[id(v)] for k, v in state.items()}


def _size(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _listed(n: int, what: str, items: list[str]) -> str:
    plural = what if n == 1 else what.replace("key", "keys").replace("mismatch", "mismatches")
    shown = ", ".join(items[:_FIRST]) + (", ..." if n > _FIRST else "")
    return f"{n} {plural} ({shown})"


def _block_counts(keys: Iterable[str]) -> dict[str, int]:
    """'encoder.layer' -> 12 for keys 'encoder.layer.0.' ... 'encoder.layer.11.'."""
    counts: dict[str, int] = {}
    for k in keys:
        parts = k.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i].isdigit():
                prefix = ".".join(parts[:i])
                counts[prefix] = max(counts.get(prefix, 0), int(parts[i]) + 1)
    return counts


def _hint(pairs: list[tuple[str, int, int, str]], sizes: Mapping[str, Any]) -> str:
    """'--set vocab_size=30522 --set hidden_size=768' from (kind, model size, file size, key)
    pairs and the builder's integer knobs. A size points at the knob holding it; when
    several hold it (intermediate_size and max_position_embeddings both 128), at the one
    sharing a word with the tensor's name; a knob is named only when it gets one value."""
    knobs = {
        k: v
        for k, v in sizes.items()
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and k not in _NOT_SIZES
    }
    found: dict[str, set[int]] = {}
    for kind, have, want, key in pairs:
        if kind == "dim" and have == 1:
            continue
        names = [
            k
            for k, v in knobs.items()
            if v == have and bool(_LAYERISH.search(k)) == (kind == "count")
        ]
        if len(names) > 1:
            words = set(re.split(r"[._]", key.lower())) - _GENERIC
            names = [k for k in names if words & set(k.lower().split("_"))]
        if len(names) == 1:
            found.setdefault(names[0], set()).add(want)
    return " ".join(f"--set {k}={next(iter(v))}" for k, v in found.items() if len(v) == 1)


def _refuse_split_ties(
    ties: Mapping[str, set[str]],
    mapped: Mapping[str, torch.Tensor],
    file_key: Mapping[str | None, str],
    name: str,
    where: str,
    module: nn.Module,
) -> None:
    """Refuse a file holding different values under names the model ties into one tensor:
    load_state_dict would copy each into it in turn, the last one winning."""
    for key in mapped:
        group = sorted(ties.get(key, {key}) & mapped.keys())
        if group[0] != key:
            continue  # each group once, from its first name
        differ = [k for k in group[1:] if not torch.equal(mapped[k], mapped[key])]
        if differ:
            a, b = file_key[key], file_key[differ[0]]
            config = getattr(module, "config", None)
            untie = (
                " (--set tie_word_embeddings=false)"
                if hasattr(config, "tie_word_embeddings")
                else ""
            )
            raise SpecError(
                f"{name} holds different tensors for {a} and {b}, which {where} ties into one "
                f"(loading both would keep one and lose the other) — build the model with "
                f"them untied{untie}, or save one tensor for both."
            )


def load_weights(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    path: str,
    where: str,
    sizes: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Copy `tensors` (read from `path` by read_state_dict) into `module`, in place and in
    the module's dtypes.

    `where` names the architecture in messages (the spec); `sizes` are the builder's
    settings, from which a shape mismatch's message suggests `--set` values. Returns a
    record for LoadedModel.settings; raises SpecError when the file does not fit.
    """
    name = os.path.basename(path)
    if not tensors:
        raise SpecError(f"{name} holds no tensors; save model.state_dict() to it.")
    model_state = module.state_dict()
    fit = best_fit(tensors, model_state)
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []  # named as read, in the model's namespace
    for k, v in tensors.items():
        mk = fit.key(k)
        if mk is None or mk not in model_state:
            unexpected.append(k if mk is None else mk)
        else:
            mapped[mk] = v
    ties = _tie_groups(module)
    missing = [
        k
        for k in model_state
        if k not in mapped
        and not (ties.get(k, {k}) & mapped.keys())
        and not k.endswith("num_batches_tracked")
    ]  # an eval-mode no-op counter
    mismatched = [
        k
        for k, t in model_state.items()
        if k in mapped and tuple(mapped[k].shape) != tuple(t.shape)
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(_listed(len(missing), "missing key", missing))
        if unexpected:
            parts.append(_listed(len(unexpected), "unexpected key", unexpected))
        pairs: list[tuple[str, int, int, str]] = []
        if mismatched:
            shown = [
                f"{k}: file {_size(mapped[k])}, model {_size(model_state[k])}" for k in mismatched
            ]
            parts.append(_listed(len(mismatched), "shape mismatch", shown))
            for k in mismatched:
                a, b = model_state[k].shape, mapped[k].shape
                if len(a) == len(b):
                    pairs += [("dim", x, y, k) for x, y in zip(a, b, strict=True) if x != y]
        file_counts = _block_counts(fit.key(k) or k for k in tensors)
        model_counts = _block_counts(model_state)
        blocks = [
            (p, model_counts[p], n)
            for p, n in file_counts.items()
            if p in model_counts and model_counts[p] != n
        ]
        for p, have, want in blocks[:1]:
            parts.append(f"the file has {want} {p} blocks, the model {have}")
        pairs += [("count", have, want, p) for p, have, want in blocks]
        how = f" (its keys read with {fit.describe()})" if fit.describe() else ""
        hint = _hint(pairs, sizes or {}) if pairs else ""
        heads = [
            k for k in (sizes or {}) if "heads" in k and "kv" not in k and "key_value" not in k
        ]
        widths = re.search(r"--set (?!\w*layer)\w*(hidden|dim|embd|d_model)\w*=", hint)
        if widths and heads:  # the weights' shapes say nothing of how they split into heads
            hint += f" (and {heads[0]}, which the weights do not show)"
        advice = (
            "build the model with the file's sizes, e.g. " + hint
            if hint
            else "build the model with the file's sizes (--set KEY=VALUE)"
            if pairs
            else "check that the file was saved from this architecture"
        )
        raise SpecError(f"{name} does not fit {where}{how}: {', '.join(parts)} — {advice}.")
    _refuse_split_ties(ties, mapped, {fit.key(k): k for k in tensors}, name, where, module)
    with torch.no_grad():
        module.load_state_dict(mapped, strict=False)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values()})
    return {
        "file": path,
        "tensors": len(tensors),
        "keys": fit.describe() or "as saved",
        "file_dtypes": dtypes,
    }


def describe_record(record: Mapping[str, Any]) -> str:
    """One line on the weights file a model was given, from the record its loader keeps in
    settings["weights"]: 'weights: FILE (N tensors, stored as float32)'."""
    n = record["tensors"]
    keys = f", keys read with {record['keys']}" if record["keys"] != "as saved" else ""
    return (
        f"weights: {record['file']} ({n} tensor{'' if n == 1 else 's'}{keys}, "
        f"stored as {', '.join(record['file_dtypes'])})"
    )
