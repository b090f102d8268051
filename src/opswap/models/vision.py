"""torchvision and timm models, built with random weights (nothing is downloaded).

Both packages are optional: when one does not import (absent, or built against
another torch), the spec fails with a SpecError carrying the install hint.
Overrides: `batch`, `image_size` (input [batch, 3, image_size, image_size],
default [1, 3, 224, 224]), `num_classes`, `seed`; timm also takes `in_chans`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from opswap.errors import SpecError
from opswap.models._common import LoadedModel, coerce, seeded, unknown_key_error

_DEFAULTS: dict[str, dict[str, Any]] = {
    "torchvision": dict(batch=1, image_size=224, num_classes=None, seed=0),
    "timm": dict(batch=1, image_size=224, num_classes=None, in_chans=3, seed=0),
}
_INSTALL = {
    "torchvision": "pip install torchvision (the build matching your torch)",
    "timm": "pip install timm",
}


def _import(package: str):
    try:
        return importlib.import_module(package)
    except Exception as e:  # a torchvision built for another torch fails with RuntimeError etc.
        raise SpecError(
            f"{package}: models need {package}, which could not be imported "
            f"({type(e).__name__}: {e}); install it with {_INSTALL[package]}."
        ) from e


def _settings(source: str, name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    where = f"{source}:{name}"
    defaults = _DEFAULTS[source]
    settings = dict(defaults)
    for key, value in overrides.items():
        if key not in defaults:
            raise unknown_key_error(key, where, list(defaults))
        settings[key] = coerce(key, value, 1 if defaults[key] is None else defaults[key], where)
    for key in ("batch", "image_size"):
        if settings[key] < 1:
            raise SpecError(f"Override {key} for {where} must be at least 1, got {settings[key]}.")
    return settings


def _builder_kwargs(settings: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: settings[k] for k in keys if settings.get(k) is not None}


def load_torchvision(name: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """`torchvision:NAME` through torchvision.models.get_model(NAME, weights=None)."""
    settings = _settings("torchvision", name, overrides)
    tv = _import("torchvision")
    known = tv.models.list_models()
    if name not in known:
        close = [m for m in known if name.lower()[:4] in m][:8]
        raise SpecError(
            f"torchvision has no model '{name}'"
            + (
                f"; close names: {', '.join(close)}."
                if close
                else "; see torchvision.models.list_models()."
            )
        )
    with seeded(settings["seed"]):
        try:
            model = tv.models.get_model(
                name, weights=None, **_builder_kwargs(settings, ("num_classes",))
            )
        except (TypeError, ValueError) as e:
            raise SpecError(f"torchvision could not build {name} with these settings: {e}") from e
        inputs = (
            torch.randn(settings["batch"], 3, settings["image_size"], settings["image_size"]),
        )
    return LoadedModel(
        name=name,
        spec=spec,
        source="torchvision",
        module=model.eval(),
        example_inputs=inputs,
        description=f"torchvision {name}, random weights",
        settings=settings,
    )


def load_timm(name: str, spec: str, overrides: dict[str, Any]) -> LoadedModel:
    """`timm:NAME` through timm.create_model(NAME, pretrained=False)."""
    settings = _settings("timm", name, overrides)
    timm = _import("timm")
    if not timm.is_model(name):
        close = timm.list_models(f"*{name[:4]}*")[:8] if name else []
        raise SpecError(
            f"timm has no model '{name}'"
            + (f"; close names: {', '.join(close)}." if close else "; see timm.list_models().")
        )
    with seeded(settings["seed"]):
        try:
            model = timm.create_model(
                name, pretrained=False, **_builder_kwargs(settings, ("num_classes", "in_chans"))
            )
        except (TypeError, ValueError) as e:
            raise SpecError(f"timm could not build {name} with these settings: {e}") from e
        size = settings["image_size"]
        inputs = (torch.randn(settings["batch"], settings["in_chans"], size, size),)
    return LoadedModel(
        name=name,
        spec=spec,
        source="timm",
        module=model.eval(),
        example_inputs=inputs,
        description=f"timm {name}, random weights",
        settings=settings,
    )
