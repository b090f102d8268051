"""Built-in targets, lookup, dtype keys and the measured-and-cached CPU target."""

from __future__ import annotations

import json

import pytest
import torch

import opswap.targets.cpu as cpu
from opswap.errors import TargetError
from opswap.targets import Target, dtype_key, get_target, list_targets, register_target


def test_list_targets():
    assert {"cpu", "h100", "h200", "a100"} <= set(list_targets())


@pytest.mark.parametrize("name", ["h100", "h200", "a100"])
def test_gpu_targets_cite_their_datasheet(name):
    t = get_target(name)
    assert t.kind == "cuda"
    assert "datasheet" in t.source.lower() and "NVIDIA" in t.source
    assert t.layout == "channels_last" and t.preferred_dtype == "bfloat16"
    # dense tensor-core rates: half precision is 2x TF32, and TF32 beats CUDA-core FP32
    assert t.peak("float16") == t.peak("bfloat16")
    assert t.peak("float16") == pytest.approx(2 * t.peak("tf32"), rel=1e-3)  # datasheet rounding
    assert t.peak("tf32") > t.peak("float32")


def test_h100_sxm_figures():
    t = get_target("h100")
    assert t.peak("bfloat16") == pytest.approx(989.5e12)
    assert t.peak("tf32") == pytest.approx(494.5e12)
    assert t.peak("float8") == t.peak("int8") == pytest.approx(1979e12)
    assert t.peak("float32") == pytest.approx(67e12)
    assert t.mem_bandwidth == 3.35e12 and t.memory_bytes == 80e9
    assert t.ridge_point(torch.bfloat16) == pytest.approx(989.5e12 / 3.35e12)


def test_h200_is_an_h100_with_more_and_faster_memory():
    h100, h200 = get_target("h100"), get_target("h200")
    assert dict(h200.peak_flops) == dict(h100.peak_flops)
    assert h200.mem_bandwidth == 4.8e12 and h200.memory_bytes == 141e9
    assert h200.ridge_point("bfloat16") < h100.ridge_point("bfloat16")


def test_a100_figures_and_no_fp8():
    t = get_target("a100")
    assert t.peak("bfloat16") == 312e12 and t.peak("tf32") == 156e12
    assert t.peak("int8") == 624e12 and t.peak("float32") == 19.5e12
    assert t.mem_bandwidth == 2.039e12
    assert not t.supports("float8") and "float8" not in t.peak_flops
    assert t.peak(torch.float8_e4m3fn) == t.peak("float32")  # no figure: float32's rate


def test_names_are_case_insensitive_with_aliases():
    assert get_target("H100") is get_target("h100-sxm") is get_target("h100")
    t = get_target("a100")
    assert get_target(t) is t


def test_unknown_target_names_the_known_ones():
    with pytest.raises(TargetError) as e:
        get_target("tpu-v9")
    msg = str(e.value)
    assert "tpu-v9" in msg and all(n in msg for n in ("a100", "cpu", "h100", "h200"))
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "given,key",
    [
        (torch.float16, "float16"),
        ("fp16", "float16"),
        ("half", "float16"),
        (torch.bfloat16, "bfloat16"),
        ("bf16", "bfloat16"),
        ("torch.float32", "float32"),
        (torch.float8_e4m3fn, "float8"),
        (torch.float8_e5m2, "float8"),
        (torch.int8, "int8"),
        (torch.uint8, "int8"),
        (torch.int64, "float32"),
        ("tf32", "tf32"),
        (torch.float64, "float64"),
    ],
)
def test_dtype_key(given, key):
    assert dtype_key(given) == key


def test_round_trip_and_register():
    t = Target(
        name="edge-npu",
        description="an NPU",
        kind="npu",
        peak_flops={"float32": 1e12, "int8": 8e12},
        mem_bandwidth=5e10,
        memory_bytes=2**31,
        dtypes=("float32", "int8"),
        source="vendor sheet",
    )
    assert Target.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    register_target(t)
    assert get_target("EDGE-NPU") is t and "edge-npu" in list_targets()
    assert t.ridge_point("int8") == pytest.approx(160)


# --------------------------------------------------------------------------- cpu


@pytest.fixture
def fake_measure(monkeypatch, tmp_path):
    """Point the cache at tmp_path and count (fake, instant) measurements."""
    monkeypatch.setenv("OPSWAP_CACHE_DIR", str(tmp_path))
    calls = {"flops": 0, "bw": 0}

    def peak():
        calls["flops"] += 1
        return 123e9 + calls["flops"]

    def bw():
        calls["bw"] += 1
        return 17e9

    monkeypatch.setattr(cpu, "measure_peak_flops", peak)
    monkeypatch.setattr(cpu, "measure_bandwidth", bw)
    return calls


def test_cpu_target_is_measured_once_then_cached(fake_measure, tmp_path):
    first = get_target("cpu")
    assert fake_measure == {"flops": 1, "bw": 1}
    assert first.peak() == 123e9 + 1 and first.mem_bandwidth == 17e9
    assert "measured on this machine on" in first.source
    path = tmp_path / "cpu_target.json"
    entries = json.loads(path.read_text())["entries"]
    assert list(entries) == [cpu.cache_key()]
    second = get_target("cpu")
    assert fake_measure == {"flops": 1, "bw": 1}  # no second measurement
    assert second == first


def test_cpu_refresh_measures_again(fake_measure):
    get_target("cpu")
    again = get_target("cpu", refresh=True)
    assert fake_measure["flops"] == 2 and again.peak() == 123e9 + 2
    assert get_target("cpu").peak() == 123e9 + 2  # the refreshed figure is what is cached


def test_cpu_cache_is_keyed_by_machine_and_torch(fake_measure, monkeypatch):
    get_target("cpu")
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    get_target("cpu")
    assert fake_measure["flops"] == 2
    entries = json.loads((cpu.cache_dir() / cpu.CACHE_FILE).read_text())["entries"]
    assert len(entries) == 2 and any("0.0.0-other" in k for k in entries)


def test_corrupt_cache_is_remeasured(fake_measure, tmp_path):
    (tmp_path / "cpu_target.json").write_text("{not json")
    t = get_target("cpu")
    assert fake_measure["flops"] == 1 and t.peak() > 0


def test_real_cpu_measurement_is_sane(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSWAP_CACHE_DIR", str(tmp_path))
    t = get_target("cpu", refresh=True)
    assert 1e8 < t.peak("float32") < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s
    assert 1e8 < t.mem_bandwidth < 1e13
    assert t.kind == "cpu" and t.memory_bytes > 0
    assert t.ridge_point() == pytest.approx(t.peak() / t.mem_bandwidth)
