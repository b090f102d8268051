"""torchvision:NAME and timm:NAME: optional packages, clear errors when they do not import."""

from __future__ import annotations

import sys

import pytest
import torch

from opswap.errors import SpecError
from opswap.models import load, vision


@pytest.mark.parametrize(
    "package, hint", [("torchvision", "pip install torchvision"), ("timm", "pip install timm")]
)
def test_missing_package_gives_install_hint(monkeypatch, package, hint):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    with pytest.raises(SpecError, match=f"{package}: models need {package}.*{hint}"):
        load(f"{package}:resnet18")


def test_broken_package_is_reported_not_raised(monkeypatch):
    # torchvision built for another torch fails at import with RuntimeError, not ImportError.
    def broken(name):
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(vision.importlib, "import_module", broken)
    with pytest.raises(SpecError, match="RuntimeError: operator torchvision::nms does not exist"):
        load("torchvision:resnet18")


@pytest.mark.parametrize(
    "spec, key", [("torchvision:resnet18", "in_chans"), ("timm:resnet18", "depth")]
)
def test_unknown_override_is_refused_before_import(monkeypatch, spec, key):
    monkeypatch.setitem(sys.modules, spec.split(":")[0], None)
    with pytest.raises(SpecError, match=f"Unknown override '{key}'.*batch, image_size"):
        load(spec, {key: "1"})


def test_bad_override_type(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(SpecError, match="image_size for timm:resnet18 must be an integer"):
        load("timm:resnet18", {"image_size": "big"})


def test_torchvision_real():
    pytest.importorskip("torchvision")
    loaded = load("torchvision:resnet18", {"image_size": "64", "num_classes": "7"})
    assert loaded.source == "torchvision" and not loaded.module.training
    assert loaded.example_inputs[0].shape == (1, 3, 64, 64)
    with torch.no_grad():
        assert loaded.module(*loaded.example_inputs).shape == (1, 7)
    with pytest.raises(SpecError, match="torchvision has no model 'resnet19'"):
        load("torchvision:resnet19")


def test_timm_real():
    pytest.importorskip("timm")
    loaded = load("timm:resnet18", {"image_size": "64", "batch": "2"})
    assert loaded.source == "timm" and not loaded.module.training
    assert loaded.example_inputs[0].shape == (2, 3, 64, 64)
    with torch.no_grad():
        assert loaded.module(*loaded.example_inputs).shape == (2, 1000)
    with pytest.raises(SpecError, match="timm has no model"):
        load("timm:not_a_model_xyz")
