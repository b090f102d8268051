"""Spec strings and --set values: bad ones give a SpecError that says what to write instead."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opswap.errors import SpecError
from opswap.models import LoadedModel, list_zoo, load, parse_value

FORMS = ("zoo:NAME", "hf:MODEL_TYPE", "torchvision:NAME", "timm:NAME", "file.py:function", ".pt2")


@pytest.mark.parametrize(
    "spec, why",
    [
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("resnet", "no source prefix"),
        ("foo:bar", "unknown source 'foo'"),
        ("zoo:", "nothing follows 'zoo:'"),
        ("hf:", "nothing follows 'hf:'"),
        ("timm:", "nothing follows 'timm:'"),
        ("model.py", "needs the function"),
        ("dir/model.py:", "no function after"),
        ("weights.pt", "holds no model code"),
        ("weights.safetensors", "holds no model code"),
    ],
)
def test_malformed_specs_name_the_accepted_forms(spec, why):
    with pytest.raises(SpecError) as info:
        load(spec)
    message = str(info.value)
    assert why in message
    for form in FORMS:
        assert form in message
    assert message.count(".") >= 1 and "\n" not in message


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        load("nonsense")


def test_unknown_zoo_name_lists_the_zoo():
    with pytest.raises(SpecError) as info:
        load("zoo:resnet50")
    message = str(info.value)
    assert "Unknown zoo model 'resnet50'" in message
    for entry in list_zoo():
        assert entry.name in message


def test_overrides_must_be_a_mapping():
    with pytest.raises(SpecError, match="mapping"):
        load("zoo:resnet", ["batch=2"])


def test_loaded_model_fields():
    loaded = load(" zoo:seq ", {"batch": "3"})
    assert isinstance(loaded, LoadedModel)
    assert (loaded.name, loaded.spec, loaded.source) == ("seq", "zoo:seq", "zoo")
    assert loaded.description and loaded.settings["batch"] == 3
    assert loaded.example_inputs[0].shape[0] == 3


# --------------------------------------------------------------------------- --set values


@pytest.mark.parametrize(
    "text, value",
    [
        ("true", True),
        ("False", False),
        ("yes", True),
        ("off", False),
        ("none", None),
        ("null", None),
        ("12", 12),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-5", 1e-5),
        ("[16, 32]", [16, 32]),
        ('{"a": 1}', {"a": 1}),
        ("gelu_new", "gelu_new"),
        ("[unclosed", "[unclosed"),
        (" 7 ", 7),
    ],
)
def test_parse_value_examples(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


@given(st.integers())
def test_parse_value_ints_round_trip(n):
    assert parse_value(str(n)) == n and isinstance(parse_value(str(n)), int)


@given(st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()))
def test_parse_value_floats_round_trip(x):
    assert parse_value(repr(x)) == x


@given(
    st.text(alphabet=st.characters(categories=["L"]), min_size=1).filter(
        lambda s: (
            s.strip().lower()
            not in {
                "true",
                "false",
                "yes",
                "no",
                "on",
                "off",
                "none",
                "null",
                "nan",
                "inf",
                "infinity",
            }
        )
    )
)
def test_parse_value_words_stay_strings(word):
    assert parse_value(word) == word.strip()


def test_parse_value_passes_non_strings_through():
    marker = object()
    assert parse_value(marker) is marker
    assert parse_value(3) == 3
    assert math.isinf(parse_value("inf"))
