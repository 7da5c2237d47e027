"""Measured tuning in a child process (jaxfuse.runtime.measure_worker).

The real child runs here on the CPU with interpreted kernels; what happens
when a child dies or hangs is tested with a stand-in child that speaks the
same protocol and then ends or stops answering.
"""

import sys
import time

import pytest

from jaxfuse.codegen import CodegenError
from jaxfuse.codegen import testing as T
from jaxfuse.planner import plan_region
from jaxfuse.runtime import launch
from jaxfuse.runtime import measure_worker

pytest.importorskip("torch")

# Answers the first plan of each job, then ends (``die``) or stops answering
# (``hang``) on the second.
_STAND_IN = r'''
import os, pickle, signal, sys, time
out = os.fdopen(os.dup(1), "wb")
def send(m):
  pickle.dump(m, out); out.flush()
send(("ready", os.getpid(), True))
while True:
  msg = pickle.load(sys.stdin.buffer)
  if msg[0] != "measure":
    continue
  job = msg[1]
  send(("start", job, 0)); send(("end", job, 0, 1e-6, None, "passed-key-0"))
  send(("start", job, 1))
  if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(3600)
'''


def _region_and_plans(n=3):
  r = T.gemm_chain(M=32, N=32, K=16, H=16)
  return r, list(plan_region(r, "h100", use_cache=False, top=n).ranked[:n])


@pytest.fixture
def clean_launch_state(monkeypatch):
  monkeypatch.setattr(launch, "_kernels", {})
  monkeypatch.setattr(launch, "_passed_checks", set())
  launch._last_inputs.clear()
  launch._last_reference.clear()
  yield
  launch._last_inputs.clear()
  launch._last_reference.clear()


def test_child_measures_what_this_process_would(clean_launch_state):
  """The real child (interpreted kernels on the CPU) checks each plan
  against the reference this process computed and handed over, and gives
  the same verdicts as measuring here; the plan the printer refuses fails
  there as here."""
  r, plans = _region_and_plans(3)
  other = T.attention(M=32, N=48, D=16, heads=2)
  plans = plans + [plan_region(other, "h100", use_cache=False).best]   # not this region's
  w = measure_worker.MeasureWorker(device="cpu")
  try:
    assert w.wait_ready(120)
    times, why, info = w.measure(r, plans, seed=launch.MEASURE_SEED, reps=3,
                                 t_end=time.perf_counter() + 120)
  finally:
    w.close()
  here_times, here_why, _ = launch.measure_here(r, plans, seed=launch.MEASURE_SEED, reps=3,
                                                t_end=time.perf_counter() + 120, device="cpu")
  assert why[:3] == [None] * 3 and all(0 < t < 60 for t in times[:3])
  assert why[3] == here_why[3] and "no tile" in why[3]
  assert here_why[:3] == [None] * 3
  assert "died" not in info and info["phases"]["generate"] > 0
  assert info["phases"]["first launch"] > 0   # the three kernels' first runs
  assert not w.alive()


def test_a_plan_that_ends_the_child_is_dropped_and_never_launched_here(clean_launch_state,
                                                                        tmp_path):
  """The child dies while running plan 1: plan 0 keeps its time and its
  passed check, plan 1 fails and is recorded so that this process never
  launches it, plan 2 was not measured (the model ranks it)."""
  r, plans = _region_and_plans(3)
  script = tmp_path / "stand_in.py"
  script.write_text(_STAND_IN)
  w = measure_worker.MeasureWorker(argv=[sys.executable, str(script), "die"], device="cpu")
  try:
    assert w.wait_ready(60)
    times, why, info = w.measure(r, plans, seed=7, reps=3, t_end=time.perf_counter() + 60)
  finally:
    w.close()
  assert times[0] == 1e-6 and why[0] is None and "passed-key-0" in launch._passed_checks
  assert why[1].startswith(measure_worker.DIED) and "signal 9" in why[1]
  assert why[2] == launch._BUDGET_SPENT and info["died"] == "signal 9"
  hit = launch._kernels[(r.signature(), str(plans[1]), "triton")]
  assert isinstance(hit, CodegenError)
  with pytest.raises(CodegenError, match="died"):   # skipped without a launch
    launch.select_kernel(r, [plans[1]], backend="triton")


def test_a_child_that_stops_answering_is_killed_past_the_deadline(clean_launch_state, tmp_path,
                                                                   monkeypatch):
  r, plans = _region_and_plans(3)
  script = tmp_path / "stand_in.py"
  script.write_text(_STAND_IN)
  monkeypatch.setattr(measure_worker, "JOB_GRACE_S", 0.5)
  w = measure_worker.MeasureWorker(argv=[sys.executable, str(script), "hang"], device="cpu")
  try:
    assert w.wait_ready(60)
    t0 = time.perf_counter()
    # The stand-in imports jaxfuse to read the job: seconds on a busy CPU.
    times, why, info = w.measure(r, plans, seed=7, reps=3, t_end=t0 + 15.0)
    assert time.perf_counter() - t0 < 40
  finally:
    w.close()
  assert times[0] == 1e-6 and why[1].startswith(measure_worker.DIED)
  assert "past the deadline" in info["died"] and not w.alive()
  assert isinstance(launch._kernels[(r.signature(), str(plans[1]), "triton")], CodegenError)


def test_children_are_restarted_then_given_up_on(clean_launch_state, tmp_path, monkeypatch):
  """After a child dies the next batch gets a fresh one; after MAX_STARTS
  children, measured tuning measures nothing (never in this process)."""
  r, plans = _region_and_plans(3)
  script = tmp_path / "stand_in.py"
  script.write_text(_STAND_IN)
  real = measure_worker.MeasureWorker
  made = []

  def make(device="cuda"):
    made.append(real(argv=[sys.executable, str(script), "die"], device=device))
    return made[-1]
  monkeypatch.setattr(measure_worker, "MeasureWorker", make)
  monkeypatch.setattr(measure_worker, "MAX_STARTS", 2)
  monkeypatch.setattr(measure_worker, "_starts", 0)
  monkeypatch.setattr(measure_worker, "_gave_up", False)
  monkeypatch.setattr(measure_worker, "_worker", None)
  try:
    first = measure_worker.measure(r, plans, seed=7, reps=3, t_end=time.perf_counter() + 60,
                                   device="cpu")
    assert first[1][1].startswith(measure_worker.DIED) and len(made) == 2   # restarted at once
    second = measure_worker.measure(r, plans, seed=7, reps=3,
                                    t_end=time.perf_counter() + 60, device="cpu")
    assert second[1][1].startswith(measure_worker.DIED) and measure_worker._gave_up
    third = measure_worker.measure(r, plans, seed=7, reps=3, t_end=time.perf_counter() + 60,
                                   device="cpu")
    assert third[1] == [launch._BUDGET_SPENT] * 3 and len(made) == 2
  finally:
    measure_worker.shutdown()
    for w in made:
      w.close(kill=True)


def test_measure_plans_goes_to_the_child_unless_told_not_to(clean_launch_state, monkeypatch):
  from jaxfuse.config import config
  r, plans = _region_and_plans(2)
  calls = []
  monkeypatch.setattr(launch, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
  monkeypatch.setattr(launch, "_torch_cuda", lambda: True)
  monkeypatch.setattr(measure_worker, "measure",
                      lambda region, ps, **kw: calls.append(kw) or ([2e-6, 1e-6], [None, None], {}))
  why = []
  assert launch.measure_plans(r, plans, budget_s=1.0, errors=why) == [2e-6, 1e-6]
  assert why == [None, None] and calls[0]["seed"] == launch.MEASURE_SEED
  here = []
  monkeypatch.setattr(launch, "measure_here",
                      lambda *a, **kw: here.append(kw["device"]) or ([3e-6] * 2, [None] * 2, {}))
  with config.override(tune_isolate=False):
    assert launch.measure_plans(r, plans, budget_s=1.0) == [3e-6, 3e-6]
  assert here == ["cuda"] and len(calls) == 1


def test_the_child_starts_as_soon_as_measured_tuning_is_asked_for(monkeypatch):
  """Setting tune='measure' (or wrapping a function with jaxfuse.jit under
  it) starts the child in the background where jax has a GPU; other modes,
  or tune_isolate off, start nothing."""
  import threading
  import jaxfuse
  from jaxfuse.config import config
  started = threading.Event()
  monkeypatch.setattr(launch, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
  monkeypatch.setattr(measure_worker, "start", lambda device="cuda": started.set())
  with config.override(tune="model"):
    jaxfuse.jit(lambda x: x)
    assert not started.wait(0.5)
    with config.override(tune_isolate=False):
      config.update("tune", "measure")
      assert not started.wait(0.5)
    config.update("tune", "measure")
    assert started.wait(10)
    started.clear()
    jaxfuse.jit(lambda x: x)
    assert started.wait(10)


def test_a_child_without_cuda_sends_measuring_back_here(clean_launch_state, monkeypatch):
  """A child that finds no CUDA device through torch says so and ends: this
  process then measures itself (no child is started again)."""
  r, plans = _region_and_plans(2)
  monkeypatch.setattr(measure_worker, "_starts", 0)
  monkeypatch.setattr(measure_worker, "_gave_up", False)
  monkeypatch.setattr(measure_worker, "_unusable", False)
  monkeypatch.setattr(measure_worker, "_worker", None)
  made = []
  real = measure_worker.MeasureWorker
  monkeypatch.setattr(measure_worker, "MeasureWorker",
                      lambda device="cuda": made.append(real(device=device)) or made[-1])
  try:
    assert measure_worker.measure(r, plans, seed=7, reps=3,
                                  t_end=time.perf_counter() + 60) is None   # no CUDA here
    assert measure_worker._unusable and measure_worker.start() is None and len(made) == 1
  finally:
    measure_worker.shutdown()
