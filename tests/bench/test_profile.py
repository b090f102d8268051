import json

import pytest
import torch

from opswap.bench.profile import format_ops, profile_ops


def _fn():
    a = torch.randn(96, 96)
    b = torch.mm(a, a)
    c = torch.mm(b, a)
    return torch.softmax(c, -1)


def test_per_op_self_time():
    ops = profile_ops(_fn, warmup=1, repeats=3)
    by_name = {o.name: o for o in ops}
    assert "aten::mm" in by_name and "aten::softmax" in by_name
    assert by_name["aten::mm"].calls == 2.0  # per call of fn, not per profile
    assert by_name["aten::softmax"].calls == 1.0
    assert [o.self_ms for o in ops] == sorted((o.self_ms for o in ops), reverse=True)
    assert sum(o.share for o in ops) == pytest.approx(1.0)
    assert all(o.self_ms >= 0 and o.cpu_total_ms >= o.cpu_self_ms - 1e-9 for o in ops)
    table = format_ops(ops, limit=3)
    assert "aten::" in table and len(table.splitlines()) <= 6


def test_chrome_trace_and_shapes(tmp_path):
    path = tmp_path / "sub" / "trace.json"
    ops = profile_ops(_fn, warmup=0, repeats=1, record_shapes=True, chrome_trace=path)
    data = json.loads(path.read_text())
    assert any("mm" in e.get("name", "") for e in data["traceEvents"])
    mm = next(o for o in ops if o.name == "aten::mm")
    assert "96" in mm.shapes
    assert json.loads(json.dumps(mm.to_json()))["name"] == "aten::mm"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_ranks_by_kernel_time():
    a = torch.randn(2048, 2048, device="cuda")
    ops = profile_ops(lambda: torch.softmax(a @ a, -1), device="cuda", repeats=3)
    mm = next(o for o in ops if o.name == "aten::mm")
    assert mm.device_self_ms > 0 and mm.self_ms == mm.device_self_ms
    kernels = profile_ops(lambda: torch.softmax(a @ a, -1), device="cuda", repeats=3, kernels=True)
    assert kernels and not {o.name for o in kernels} & {o.name for o in ops}
    assert all(o.device_self_ms > 0 for o in kernels)
    # operators and kernels account for the same device time, each without double counting
    total_ops = sum(o.device_self_ms for o in ops)
    total_kernels = sum(o.device_self_ms for o in kernels)
    assert total_ops == pytest.approx(total_kernels, rel=0.3), (
        format_ops(ops),
        format_ops(kernels),
    )
