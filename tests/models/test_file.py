"""path/to/file.py:function specs."""

from __future__ import annotations

import textwrap

import pytest
import torch

from opswap.errors import SpecError
from opswap.models import load

HEADER = """
import torch
from torch import nn
"""


def write(tmp_path, body: str, name: str = "mymodel.py"):
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def test_function_returning_module_and_inputs(tmp_path):
    path = write(
        tmp_path,
        """
        def build(width=8, batch=2):
            '''A two-layer MLP.'''
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(5, width), nn.Dropout(0.5), nn.ReLU(), nn.Linear(width, 3))
            return model, (torch.randn(batch, 5),)
    """,
    )
    loaded = load(f"{path}:build")
    assert loaded.source == "file" and loaded.name == "mymodel:build"
    assert loaded.description == "A two-layer MLP."
    assert not loaded.module.training  # put in eval mode, so Dropout is inert
    (x,) = loaded.example_inputs
    assert x.shape == (2, 5)
    with torch.no_grad():
        torch.testing.assert_close(loaded.module(x), loaded.module(x))
    wider = load(f"{path}:build", {"width": "16", "batch": "4"})
    assert wider.module[0].out_features == 16 and wider.example_inputs[0].shape == (4, 5)


def test_module_with_example_inputs_function(tmp_path):
    path = write(
        tmp_path,
        """
        def model():
            return nn.Conv2d(3, 4, 3)

        def example_inputs(batch=1, size=9):
            return torch.randn(batch, 3, size, size)
    """,
    )
    loaded = load(f"{path}:model", {"size": "12"})
    assert loaded.example_inputs[0].shape == (1, 3, 12, 12)
    assert loaded.module(*loaded.example_inputs).shape == (1, 4, 10, 10)


def test_module_with_example_inputs_attribute(tmp_path):
    path = write(
        tmp_path,
        """
        example_inputs = (torch.randn(2, 4), torch.randn(2, 4))

        class Add(nn.Module):
            def forward(self, a, b):
                return a + b

        def make():
            return Add()
    """,
    )
    loaded = load(f"{path}:make")
    a, b = loaded.example_inputs
    torch.testing.assert_close(loaded.module(a, b), a + b)


def test_module_without_inputs_is_refused(tmp_path):
    path = write(tmp_path, "def make():\n    return nn.Linear(2, 2)\n")
    with pytest.raises(SpecError, match="returned a module without inputs.*example_inputs"):
        load(f"{path}:make")


def test_missing_file_and_function(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load(f"{tmp_path / 'nope.py'}:build")
    path = write(tmp_path, "def alpha():\n    pass\n\ndef beta():\n    pass\n")
    with pytest.raises(SpecError, match="defines no function 'gamma'; it defines: alpha, beta"):
        load(f"{path}:gamma")
    with pytest.raises(SpecError, match="not a Python function name"):
        load(f"{path}:not-a-name")


@pytest.mark.parametrize(
    "body, words",
    [
        ("def f():\n    return 3\n", "returned int; it must return an nn.Module"),
        ("def f():\n    return nn.Linear(2, 2), 'x'\n", "tensor or a tuple of tensors.*got str"),
        ("def f():\n    return nn.Linear(2, 2), ()\n", "got tuple \\(empty\\)"),
        (
            "def f():\n    return nn.Linear(2, 2), (torch.ones(2), object())\n",
            "got tuple of Tensor, object",
        ),
        ("def f():\n    raise RuntimeError('boom')\n", "f\\(\\) in .* raised RuntimeError: boom"),
        (
            "import not_a_module_anywhere\ndef f():\n    pass\n",
            "Importing .* failed with ModuleNotFoundError",
        ),
    ],
)
def test_wrong_results_and_failures(tmp_path, body, words):
    path = write(tmp_path, body)
    with pytest.raises(SpecError, match=words):
        load(f"{path}:f")


def test_unknown_override_names_parameters(tmp_path):
    path = write(
        tmp_path,
        """
        def build(width=8):
            return nn.Linear(3, width), torch.randn(1, 3)
    """,
    )
    with pytest.raises(SpecError, match="Unknown override 'depth'.*accepted keys: width"):
        load(f"{path}:build", {"depth": "2"})


def test_kwargs_function_accepts_any_override(tmp_path):
    path = write(
        tmp_path,
        """
        def build(**opts):
            return nn.Linear(3, int(opts.get('width', 2))), torch.randn(1, 3)
    """,
    )
    assert load(f"{path}:build", {"width": "5"}).module.out_features == 5


def test_file_is_not_imported_without_a_function(tmp_path):
    marker = tmp_path / "imported"
    path = write(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(SpecError, match="file.py:function"):
        load(str(path))
    assert not marker.exists()
    with pytest.raises(SpecError):
        load(f"{path}:")
    assert not marker.exists()


KEYWORD_MODEL = """
class Masked(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(4, width)

    def forward(self, x, *, mask=None, scale=1.0):
        y = self.proj(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)
"""


@pytest.mark.parametrize(
    "returns",
    [
        "Masked(width), (x,), {'mask': mask, 'scale': 0.5}",
        "Masked(width), {'x': x, 'mask': mask, 'scale': 0.5}",
        "Masked(width), ((x,), {'mask': mask, 'scale': 0.5})",
    ],
)
def test_function_returning_keyword_inputs(tmp_path, returns):
    path = write(
        tmp_path,
        KEYWORD_MODEL
        + f"""
def build(width=3, batch=2):
    torch.manual_seed(0)
    x, mask = torch.randn(batch, 4), torch.rand(batch, width) > 0.5
    return {returns}
""",
    )
    loaded = load(f"{path}:build", {"batch": "4"})
    assert loaded.settings["inputs"] == ["x", "mask"]
    assert loaded.settings["constants"] == {"scale": 0.5}
    assert loaded.settings["width"] == 3 and loaded.settings["batch"] == 4  # defaults recorded
    x, mask = loaded.example_inputs
    assert x.shape == (4, 4) and mask.dtype == torch.bool
    user = loaded.module.model
    assert not user.training and not loaded.module.training
    with torch.no_grad():
        assert torch.equal(loaded.module(x, mask), user(x, mask=mask, scale=0.5))


def test_example_inputs_function_may_return_keywords(tmp_path):
    path = write(
        tmp_path,
        KEYWORD_MODEL
        + """
def model():
    return Masked(2)

def example_inputs(batch=1):
    return {"x": torch.randn(batch, 4), "scale": 3.0}
""",
    )
    loaded = load(f"{path}:model", {"batch": "5"})
    assert loaded.settings["inputs"] == ["x"] and loaded.settings["constants"] == {"scale": 3.0}
    (x,) = loaded.example_inputs
    assert x.shape == (5, 4)


def test_keyword_inputs_holding_tensors_in_a_list_are_refused(tmp_path):
    path = write(
        tmp_path,
        KEYWORD_MODEL
        + """
def build():
    return Masked(2), (torch.randn(1, 4),), {"mask": [torch.ones(1, 2, dtype=torch.bool)]}
""",
    )
    with pytest.raises(
        SpecError,
        match="keyword 'mask' input in build\\(\\) in .* is a list "
        "holding tensors; .*pass the tensors one by one",
    ):
        load(f"{path}:build")


def test_a_training_mode_module_is_loaded_for_inference_and_says_so(tmp_path):
    # one policy: every spec is loaded for inference (eval mode), and the loader says when
    # it changed the mode; opswap.optimize on a module keeps the mode it was given
    path = write(
        tmp_path,
        """
        def build():
            return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train(), (torch.randn(2, 4),)
    """,
    )
    loaded = load(f"{path}:build")
    assert not loaded.module.training and loaded.settings["mode"].startswith("eval:")
    quiet = write(
        tmp_path,
        """
        def build():
            return nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(2, 4),)
    """,
        name="quiet.py",
    )
    assert "mode" not in load(f"{quiet}:build").settings


def test_positional_constants_are_bound_not_refused(tmp_path):
    path = write(
        tmp_path,
        """
import torch
from torch import nn

class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, flag, scale):
        y = self.fc(x) * scale
        return y.relu() if flag else y.tanh()

def build():
    torch.manual_seed(0)
    return Gate(), (torch.randn(2, 4), True, 2.0)
""",
    )
    loaded = load(f"{path}:build")
    (x,) = loaded.example_inputs
    user = loaded.module.model
    with torch.no_grad():
        assert torch.equal(loaded.module(x), user(x, True, 2.0))
