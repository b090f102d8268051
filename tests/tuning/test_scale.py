"""Timing jobs in local processes and in a local Ray instance (tuning.scale): the same
results as timing in this process for a deterministic stand-in timer, the driver the
one writer to the tuning database, and one sentence when Ray is missing or unreachable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from opswap.tuning import TuningDB
from opswap.tuning.db import Key
from opswap.tuning.scale import (
    InProcess,
    Job,
    LocalExecutor,
    RayExecutor,
    ScaleError,
    Timing,
    device_kind,
    executor,
    record,
    resource_name,
    time_module,
)

HERE = str(Path(__file__).parent)
sys.path.insert(0, HERE)  # spawned workers get this process's path, and import the jobs
from scale_jobs import failing, fake_time, threads  # noqa: E402

JOBS = [Job(f"plan{i}", fake_time, (i, w)) for i, w in enumerate((3, 17, 64, 5, 100))]


def _same(a: list[Timing], b: list[Timing]) -> None:
    assert [(t.key, t.seconds, t.noise, t.error) for t in a] == [
        (t.key, t.seconds, t.noise, t.error) for t in b
    ]


def test_local_processes_give_what_timing_here_gives_one_thread_each():
    here = InProcess().map(JOBS)
    pool = LocalExecutor(workers=2)
    try:
        _same(pool.map(JOBS), here)
        assert {t.seconds for t in pool.map([Job("t", threads)] * 3)} == {1.0}
        bad = pool.map([Job("x", failing, (7,)), JOBS[0]])
    finally:
        pool.close()
    assert bad[0].seconds is None and bad[0].error == "ValueError: no kernel for 7"
    assert bad[1].seconds == here[0].seconds


def test_the_driver_writes_the_timings_to_the_database(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    timings = InProcess().map([*JOBS[:2], Job("x", failing, (1,))])

    def write(t: Timing) -> None:
        key = Key("plan-time", t.key, ((1, 8),), "float32", "", "cpu: test", "v")
        db.put(key, {"seconds": t.seconds}, noise=t.noise)

    assert record(timings, write) == 2
    got = sorted(r.key.op for r in db.records("plan-time"))
    assert got == ["plan0", "plan1"]


def test_time_module_times_a_real_module():
    m = nn.Sequential(nn.Linear(7, 5), nn.ReLU())
    secs, noise = time_module(m, (torch.randn(3, 7),), repeats=3)
    assert 0 < secs < 1 and noise >= 0


def test_device_kind_names_the_resource():
    assert device_kind("cpu") == "cpu" and resource_name("cpu") == "opswap_device_cpu"


def test_without_ray_installed_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ScaleError, match=r"opswap\[ray\]"):
        executor("auto")


def test_an_address_nothing_answers_at_is_one_sentence():
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance of this process is running")
    with pytest.raises(ScaleError, match="No Ray cluster answers at 127.0.0.1:9"):
        executor("127.0.0.1:9")
    with pytest.raises(ScaleError, match="is not a Ray address"):
        executor("nowhere")


@pytest.fixture(scope="module")
def local_ray():  # type: ignore[no-untyped-def]
    ray = pytest.importorskip("ray")
    import scale_jobs
    from ray import cloudpickle

    # the jobs' functions travel by value: Ray's workers need not import them
    cloudpickle.register_pickle_by_value(scale_jobs)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        resources={resource_name("cpu"): 2},
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def test_ray_tasks_give_what_timing_here_gives(local_ray):
    ex = RayExecutor("auto", "cpu")
    _same(ex.map(JOBS), InProcess().map(JOBS))
    assert ex.map([Job("x", failing, (2,))])[0].error == "ValueError: no kernel for 2"


def test_ray_refuses_a_device_kind_no_node_advertises(local_ray):
    with pytest.raises(ScaleError, match="opswap_device_cuda_nvidia_h100"):
        RayExecutor("auto", "cuda_nvidia_h100")


def test_the_joint_search_times_its_plans_on_ray_workers(local_ray, tmp_path):
    from opswap.api import load
    from opswap.config import OptimizeConfig
    from opswap.stages import capture_stage, joint_plan

    m = load("zoo:resnet", width=4, image_size=8, batch=1)
    config = OptimizeConfig(
        rules=["fusion.*"],
        bench=False,
        layers=False,
        samples=1,
        dynamic="none",
        search="joint",
        search_budget=2,
        ray="auto",
        tuning_db=str(tmp_path / "t.sqlite"),
    )
    run = capture_stage(m.module, m.example_inputs, config, "zoo:resnet", lambda stage: None)
    greedy = run.replan()
    assert greedy.decisions
    plan = joint_plan(run, greedy)
    assert plan.search is not None and plan.search["timed_on"] == "ray"
    assert 1 <= plan.search["evaluations"] <= 2
    assert all(p["latency_ms"] > 0 for p in plan.search["points"])
    db = TuningDB(tmp_path / "t.sqlite")  # written by the driver, one record per plan
    assert len(list(db.records("plan-time"))) == plan.search["evaluations"]
