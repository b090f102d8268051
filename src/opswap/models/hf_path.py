"""`hf:PATH`: a local checkpoint directory saved with `save_pretrained`, loaded for inference.

The directory is checked before transformers reads it, so that a damaged one is
refused in one sentence: a config.json that is not a JSON object, a `model_type`
transformers does not know, a weights file that cannot be read (a truncated
safetensors file). Safetensors weights are used when present; a pytorch_model.bin
is read with torch.load(weights_only=True), so no pickled code runs.

Every tensor the architecture holds must be in the checkpoint: transformers would
fill a missing one with random values and only log it, so opswap refuses the
checkpoint naming the missing keys, as `--weights` does; `--set missing=random`
loads it anyway and records the keys in the settings (`missing_weights`).

The model is loaded the way `hf:MODEL_TYPE` builds one: `use_cache=False` (and
eager attention unless `--set attn_implementation=...`), so the traced call
returns tensors, not a cache object that capture cannot follow. A checkpoint saved
for generation says `use_cache: true`; the settings record both (`use_cache`,
`checkpoint_use_cache`), and `--set use_cache=true` keeps the checkpoint's.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import pickle
from collections.abc import Iterator
from typing import Any

from opswap.errors import SpecError
from opswap.models import hf_small
from opswap.models._common import LoadedModel, coerce, seeded
from opswap.models.hf import (
    HFModule,
    _check_config_keys,
    _check_lengths,
    _first_line,
    _image_size,
    _shape_settings,
    _split,
    _transformers,
)
from opswap.models.hf_inputs import input_names, make_inputs

_FIRST = 3  # keys named in a message
_MISSING = ("refuse", "random")  # --set missing=...


def _read_config(path: str) -> dict[str, Any]:
    """config.json as a dict, or SpecError saying what is wrong with it."""
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = (
            f" (line {e.lineno}, column {e.colno}: {e.msg})"
            if isinstance(e, json.JSONDecodeError)
            else ""
        )
        raise SpecError(
            f"{file} is not valid JSON{where}; save the checkpoint again with save_pretrained."
        ) from e
    if not isinstance(data, dict):
        raise SpecError(
            f"{file} holds a JSON {type(data).__name__}, not the object "
            "save_pretrained writes; save the checkpoint again."
        )
    return data


def _check_model_type(tf, data: dict[str, Any], path: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpecError(
            f"{path}/config.json names no model_type, so transformers cannot tell "
            "which architecture to build; save the checkpoint with save_pretrained."
        )
    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise SpecError(
            f"{path}/config.json has model_type '{model_type}', which transformers "
            f"{tf.__version__} does not know{hint}; fix the config or upgrade "
            "transformers."
        )


def _check_safetensors(path: str, files: list[str]) -> None:
    """Open every safetensors file's header: a truncated or foreign file fails here, named."""
    from safetensors import safe_open

    for name in sorted(files):
        if not name.endswith(".safetensors"):
            continue
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                f.keys()
        except Exception as e:  # SafetensorError, OSError
            raise SpecError(
                f"{name} in {path} cannot be read as a safetensors file "
                f"({_first_line(e)}); it may be truncated: save or copy the "
                "checkpoint again."
            ) from e


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:_FIRST]) + (", ..." if len(keys) > _FIRST else "")


def _no_cache(config) -> bool | None:
    """Set use_cache=False on the config and its sub-configs; the checkpoint's own value."""
    saved = getattr(config, "use_cache", None)
    for c in (config, *(getattr(config, n, None) for n in ("text_config", "decoder"))):
        if c is not None and hasattr(c, "use_cache"):
            c.use_cache = False
    return saved


@contextlib.contextmanager
def _quiet(tf) -> Iterator[None]:
    """transformers' progress bars and load report off while it loads: opswap says what
    matters (a missing tensor) itself, in one sentence."""
    log = tf.utils.logging
    verbosity, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(verbosity)
        if bars:
            log.enable_progress_bar()


def load_hf_path(path: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """Load a local checkpoint directory saved with save_pretrained, for inference."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SpecError(
            f"{path} is not a Hugging Face checkpoint directory: it has no config.json."
        )
    files = os.listdir(path)
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    has_bin = any(f.endswith(".bin") for f in files)
    if not has_safetensors and not has_bin:
        raise SpecError(f"{path} has a config.json but no weights (*.safetensors or *.bin).")
    tf = _transformers()
    where = spec
    overrides = dict(overrides)
    missing_ok = overrides.pop("missing", "refuse")
    if missing_ok not in _MISSING:
        raise SpecError(
            f"Override missing for {where} must be refuse or random, got {missing_ok!r}."
        )
    inputs, config_overrides = _split(overrides)
    if "size" in inputs:
        raise SpecError(f"Override size does not apply to {where}: a checkpoint has its own sizes.")
    batch, seq, image, attn, seed, mask = _shape_settings(inputs, where)
    _check_model_type(tf, _read_config(path), path)
    if has_safetensors:
        _check_safetensors(path, files)
    try:
        config = tf.AutoConfig.from_pretrained(path)
    except Exception as e:  # a config transformers' own checks reject
        raise SpecError(
            f"transformers could not read {path}/config.json ({_first_line(e)})."
        ) from e
    saved_cache = _no_cache(config)
    _check_config_keys(config_overrides, config, where)
    for key, value in config_overrides.items():
        setattr(config, key, coerce(key, value, getattr(config, key, None), where))
    _check_lengths(config, seq, where)
    image = _image_size(config, inputs, image)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(tf, arch, None) if arch else None
    cls = cls or tf.AutoModel
    try:
        with _quiet(tf):
            model, info = cls.from_pretrained(
                path,
                config=config,
                attn_implementation=attn,
                use_safetensors=has_safetensors,
                weights_only=True,
                output_loading_info=True,
            )
    except pickle.UnpicklingError as e:
        raise SpecError(
            f"{path} holds a .bin file with pickled objects other than tensors, which opswap "
            f"refuses to load; convert it to safetensors with code you trust."
        ) from e
    except ImportError as e:
        raise SpecError(f"{where} needs a package that is not installed ({_first_line(e)}).") from e
    except Exception as e:  # OSError, ValueError, RuntimeError, a damaged .bin's EOFError ...
        raise SpecError(f"Could not load the checkpoint in {path} ({_first_line(e)}).") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing and missing_ok != "random":
        raise SpecError(
            f"{path} does not hold every tensor of {type(model).__name__}: {len(missing)} missing "
            f"key{'s' if len(missing) > 1 else ''} ({_listed(missing)}), which would be left "
            "random — save the whole model, or --set missing=random to load it so."
        )
    kind = hf_small.kind(getattr(config, "model_type", ""), config)[0]
    if kind == "encoder" and getattr(model, "main_input_name", "") == "pixel_values":
        kind = "vision"
    names = input_names(model, kind, mask, where)
    wrapped = HFModule(model, names).eval()
    with seeded(seed):
        example = make_inputs(names, config, batch, seq, image, where)
    # a model that fails here is refused by the capture, in its own words
    with contextlib.suppress(Exception):
        wrapped.name_outputs(example)
    name = os.path.basename(os.path.normpath(path))
    settings = dict(
        config_overrides,
        batch=batch,
        seq=seq,
        image_size=image,
        attn_implementation=attn,
        seed=seed,
        mask="padded" if mask else "none",
        kind=kind,
        inputs=list(names),
    )
    if saved_cache is not None:
        settings.setdefault("use_cache", config.use_cache)
        settings["checkpoint_use_cache"] = saved_cache
    description = f"{type(model).__name__} loaded from {path}"
    if missing:
        settings["missing_weights"] = missing
        description += f", {len(missing)} tensors missing from it left random"
    unused = sorted(info.get("unexpected_keys") or ())
    if unused:
        settings["unused_weights"] = unused
    return LoadedModel(
        name=name,
        spec=spec,
        source="hf",
        module=wrapped,
        example_inputs=example,
        description=description,
        settings=settings,
    )
