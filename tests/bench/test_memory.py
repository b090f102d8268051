import pytest
import torch

from opswap.bench.memory import _cpu_events_flat, _replay, peak_memory

MIB = 1 << 20


def test_known_allocation_is_seen():
    def alloc():
        x = torch.empty(MIB)  # 4 MiB of float32
        x.normal_()
        return x

    r = peak_memory(alloc)
    assert r.peak_bytes >= 4 * MIB and r.method == "profiler"
    assert r.peak_bytes < 6 * MIB  # nothing else of that size happened


def test_peak_is_simultaneous_not_cumulative():
    def together():
        a = torch.randn(MIB)
        b = torch.randn(MIB)
        return (a + b).sum()  # a, b and a + b alive at once: 12 MiB

    def one_after_another():
        s = 0.0
        for _ in range(3):
            s += torch.randn(MIB).sum().item()  # each 4 MiB freed before the next
        return s

    t, s = peak_memory(together), peak_memory(one_after_another)
    assert t.peak_bytes >= 12 * MIB
    assert 4 * MIB <= s.peak_bytes < 6 * MIB
    assert s.allocated_bytes >= 12 * MIB  # but all three were allocated


def test_flat_event_fallback_agrees():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.randn(MIB)
        b = a * 2
        del a
        c = b + 1
        del b, c
    events = sorted(_cpu_events_flat(prof))
    peak, allocated = _replay([s for _, s in events])
    assert peak >= 8 * MIB and allocated >= 12 * MIB


def test_replay():
    assert _replay([4, 4, -4, 8, -12]) == (12, 16)
    assert _replay([]) == (0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_peak():
    def alloc():
        return torch.empty(MIB, device="cuda").normal_()

    r = peak_memory(alloc, device="cuda")
    assert r.peak_bytes >= 4 * MIB and r.method == "cuda-allocator"
