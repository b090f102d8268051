"""opswap.llm.scheduler without a model: the token budget and max_num_seqs, running
sequences before admissions and decodes before prefill chunks, chunked prefill across
steps, preemption by recomputation of the most recently admitted sequence, and
admission after a cached prefix."""

from __future__ import annotations

import pytest
import torch

from opswap.llm import BlockManager, SamplingParams
from opswap.llm.scheduler import Batch, Scheduler, Sequence

# small ops on 2 threads stall whenever another process holds a core (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _seq(rid: str, n: int, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(temperature=0))


def _run(s: Scheduler) -> Batch:
    """One step as the engine takes it: schedule, 'compute', append a token to samplers."""
    batch = s.schedule()
    s.finish_step(batch)
    for e in batch.entries:
        if e.samples:
            e.seq.output_ids.append(7)
    return batch


def test_chunked_prefill_splits_a_long_prompt_and_samples_at_its_end():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a = _seq("a", 23)
    s.add(a)
    chunks = []
    for _ in range(3):
        b = _run(s)
        chunks.append([(e.start, e.num_tokens, e.samples) for e in b.entries])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 7, True)]]
    b = _run(s)  # now a decode
    assert [(e.start, e.num_tokens) for e in b.decodes] == [(23, 1)] and not b.prefills


def test_decodes_go_first_and_the_budget_bounds_the_step():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    for i in range(3):
        s.add(_seq(f"d{i}", 2, 10 * i))
    _run(s)  # all three prefill (6 tokens) and sample
    s.add(_seq("long", 30, 100))
    b = _run(s)
    assert [e.seq.request_id for e in b.decodes] == ["d0", "d1", "d2"]
    assert [(e.seq.request_id, e.num_tokens) for e in b.prefills] == [("long", 7)]
    assert b.num_tokens == 10
    b = _run(s)  # the long prompt keeps its place after the decodes
    assert [e.seq.request_id for e in b.entries] == ["d0", "d1", "d2", "long"]
    assert b.prefills[0].start == 7 and b.prefills[0].num_tokens == 7


def test_max_num_seqs_caps_the_running_batch():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add(_seq(f"r{i}", 3, 10 * i))
    b = _run(s)
    assert len(b.entries) == 2 and len(s.waiting) == 1
    s.remove(s.running[0])
    b = _run(s)
    assert [e.seq.request_id for e in b.prefills] == ["r2"]


def test_a_short_pool_preempts_the_latest_admitted_and_recomputes_it():
    bm = BlockManager(5, 2, prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = _seq("a", 4), _seq("b", 4, 50)
    s.add(a)
    s.add(b)
    _run(s)  # 2 blocks each, 1 free; both sampled a token (5 tokens each)
    step = _run(s)  # a takes the last block; b needs one: b, admitted last, goes
    assert [x.request_id for x in step.preempted] == ["b"]
    assert [e.seq.request_id for e in step.entries] == ["a"]
    assert list(s.waiting) == [b] and b.num_computed == 0 and b.preemptions == 1
    assert bm.stats().in_use == 3
    while s.running and len(a.output_ids) < 3:
        _run(s)
    s.remove(a)
    step = _run(s)  # b comes back: its prompt and its token are prefilled again
    assert [(e.seq.request_id, e.start, e.num_tokens) for e in step.entries] == [("b", 0, 5)]
    s.remove(b)
    assert bm.stats().in_use == 0


def test_a_sequence_alone_that_cannot_grow_preempts_itself():
    bm = BlockManager(2, 2, prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    a = _seq("a", 4)
    s.add(a)
    _run(s)
    step = _run(s)  # 5 tokens do not fit 2 blocks of 2
    assert step.preempted == [a] and not step.entries and list(s.waiting) == [a]


def test_admission_starts_after_the_cached_prefix():
    bm = BlockManager(32, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    s.add(_seq("a", 14))
    _run(s)
    b = Sequence("b", list(range(12)) + [99, 98], SamplingParams())
    s.add(b)
    step = _run(s)
    assert [(e.seq.request_id, e.start, e.num_tokens) for e in step.prefills] == [("b", 12, 2)]
    assert b.num_cached == 12 and bm.stats().hit_blocks == 3


def _traffic(seed: int) -> int:
    """Requests of random lengths join at random steps into a tight pool: every step stays
    within the token budget and max_num_seqs, every request reaches its token count, and
    the pool ends empty; returns the preemptions."""
    g = torch.Generator().manual_seed(seed)

    def rnd(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    bm = BlockManager(rnd(6, 9), 3)  # 18 to 24 slots; a request holds up to 16 tokens
    budget, cap = rnd(3, 20), rnd(2, 5)
    s = Scheduler(bm, max_num_seqs=cap, max_num_batched_tokens=budget)
    todo = [(rnd(0, 30), _seq(f"q{i}", rnd(1, 12), 7 * i), rnd(1, 6)) for i in range(12)]
    want = {q.request_id: n for _, q, n in todo}
    done = {}
    for step in range(2000):
        for at, q, _ in todo:
            if at == step:
                s.add(q)
        if not s.has_unfinished() and step > 30:
            break
        b = _run(s)
        assert b.num_tokens <= budget and len(s.running) <= cap
        for q in list(s.running):
            if len(q.output_ids) == want[q.request_id]:
                done[q.request_id] = len(q.output_ids)
                s.remove(q)
    assert done == want and bm.stats().in_use == 0
    return s.num_preemptions


def test_random_traffic_keeps_the_limits_and_returns_every_block():
    assert sum(_traffic(seed) for seed in range(4)) > 0  # the pools were tight enough
