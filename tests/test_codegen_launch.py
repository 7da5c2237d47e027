"""fused_call inside jax.jit (interpreter backend) and property tests over shapes and plans."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxfuse import ir
from jaxfuse.codegen import generate, testing as T
from jaxfuse.planner import examples, plan_region
from jaxfuse.planner.tiling import next_pow2
from jaxfuse.runtime import launch


def test_fused_call_inside_jit_interpret():
  r = T.with_precision(T.attention(M=24, N=40, D=16, heads=2, causal=True), "ieee")
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16))
  xs = launch.random_inputs(r, seed=11)
  f = jax.jit(lambda *a: launch.fused_call(r, list(a), backend="interpret", plan=plan))
  (out,) = f(*xs)
  assert out.shape == tuple(r.outputs[0].shape) and out.dtype == np.float32
  assert launch.compare(r, [np.asarray(out)], ir.evaluate(r, xs)) <= 1e-5
  # The chosen kernel is reused for the same signature.
  (out2,) = f(*launch.random_inputs(r, seed=12))
  assert np.isfinite(np.asarray(out2)).all()


def test_fused_call_rejects_bad_args():
  r = T.gemm_chain(M=16, N=16, K=16, H=16)
  try:
    launch.fused_call(r, [1, 2], backend="interpret")
  except ValueError as e:
    assert "args" in str(e)
  else:  # pragma: no cover
    raise AssertionError("expected ValueError")


_tile = st.sampled_from([1, 4, 16, 32])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 40), N=st.integers(1, 40), K=st.integers(1, 24), H=st.integers(1, 24),
       tm=_tile, tn=st.sampled_from([4, 16, 32]), tk=st.sampled_from([16, 32]),
       order=st.sampled_from(["n(k)", "n", "k", "-", "hn(k)"]),
       dtype=st.sampled_from(["float32", "float16"]))
def test_gemm_chain_property(M, N, K, H, tm, tn, tk, order, dtype):
  r = T.gemm_chain(M=M, N=N, K=K, H=H, dtype=dtype)
  tiles = dict(b=1, m=tm, n=tn, k=tk, h=16)
  grid = ("b", "m")
  tree = {"n(k)": [("n", [("k", [])])], "n": [("n", [])], "k": [("k", [])], "-": [],
          "hn(k)": [("n", [("k", [])])]}[order]
  if order == "hn(k)":
    grid = ("b", "m", "h")
  # Loops left out of the tree must fit one tile.
  for l in ("n", "k"):
    if l not in order:
      tiles[l] = next_pow2(r.extent(l))
  if order != "hn(k)":
    tiles["h"] = next_pow2(H)
  k = generate(r, T.simple_plan(r, grid, tree, tiles), interpret=True)
  xs = launch.random_inputs(r, seed=M * 1000 + N)
  [got], [ref] = launch.run_interpreted(k, xs), ir.evaluate(r, xs)
  # The error against the products' magnitudes (the chain of |A|, |B|,
  # |D|), as a dot's rounding is bounded: where an output cancels to near
  # zero, float32's TF32 dots (2^-11) read large against the output alone
  # (M=6, N=20, K=1, H=1: 8e-3 against it, each output off by the same
  # factor, the rounded terms of one cancelling sum).
  scale = ir.evaluate(r, [np.abs(x) for x in xs])[0]
  err = (np.linalg.norm(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
         / np.linalg.norm(np.asarray(scale, np.float64)))
  assert err <= launch.tolerance(r), (err, k.plan)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 40), N=st.integers(1, 48), D=st.sampled_from([8, 16, 24]),
       tm=st.sampled_from([1, 16, 32]), tn=st.sampled_from([16, 32]),
       causal=st.booleans(), split=st.sampled_from([None, 2]))
def test_attention_property(M, N, D, tm, tn, causal, split):
  r = T.attention(M=M, N=N, D=D, causal=causal)
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=tm, n=tn),
                       split=("n", split) if split else None)
  k = generate(r, plan, interpret=True)
  xs = launch.random_inputs(r, seed=M * 100 + N)
  err = launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs))
  assert err <= launch.tolerance(r), (err, plan)


def test_planner_ranked_plans_generate_correct_kernels():
  import pytest  # pylint: disable=g-import-not-at-top
  planner = pytest.importorskip("jaxfuse.planner")
  if not hasattr(planner, "plan_region"):
    pytest.skip("planner.plan_region not available")
  for r in (T.gemm_chain(M=64, N=96, K=40, H=24, B=2, dtype="float16"),
            T.attention(M=40, N=72, D=80, heads=2, causal=True, bias=True, dtype="float16"),
            T.mlp(M=37, dims=(24, 80, 40, 16))):
    res = planner.plan_region(r, use_cache=False)
    assert res.ranked, res.why_not
    for p in res.ranked[:2]:
      k = generate(r, p, interpret=True)
      xs = launch.random_inputs(r, seed=3)
      assert launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs)) <= launch.tolerance(r), p
  # And the whole chain, planner to pure_callback, inside jit.
  r = T.with_precision(T.gemm_chain(M=48, N=40, K=24, H=16), "ieee")
  xs = launch.random_inputs(r, seed=4)
  (out,) = jax.jit(lambda *a: launch.fused_call(r, list(a), backend="interpret"))(*xs)
  assert launch.compare(r, [np.asarray(out)], ir.evaluate(r, xs)) <= 1e-5


# -- launch form and timing ---------------------------------------------------

def test_config_launch_is_checked():
  from jaxfuse.config import config
  with pytest.raises(ValueError, match="launch"):
    config.update("launch", "cuda")
  assert config.launch in ("direct", "ffi", "legacy")


def test_config_tune_defaults_to_auto_and_is_checked(monkeypatch):
  from jaxfuse.config import Config, config
  monkeypatch.delenv("JAXFUSE_TUNE", raising=False)
  assert Config.from_env().tune == "auto"
  monkeypatch.setenv("JAXFUSE_TUNE", "model")
  assert Config.from_env().tune == "model"
  monkeypatch.setenv("JAXFUSE_TUNE", "fast")
  with pytest.raises(ValueError, match="'tune' must be one of"):
    Config.from_env()
  with pytest.raises(ValueError, match="tune"):
    config.update("tune", "always")


def test_slope_takes_fixed_costs_out(monkeypatch):
  from jaxfuse.runtime import timing
  clock = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

  def run(n):                       # 30 us per program + 5 us per call
    clock[0] += 30e-6 + n * 5e-6
    return n
  res = timing.slope(run, lambda out: None, lo=4, hi=16, reps=3)
  assert res["per_call_s"] == pytest.approx(5e-6)
  assert res["naive_per_call_s"] == pytest.approx((30e-6 + 20e-6) / 4)
  assert res["executions"] == 91    # ceil(10 ms / 110 us)
  with pytest.raises(ValueError, match="lo, hi"):
    timing.slope(run, lambda out: None, lo=4, hi=4)


def test_slopes_interleave_the_programs_windows(monkeypatch):
  from jaxfuse.runtime import timing
  clock = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
  order = []

  def program(name, fixed, per_call):
    def run(n):
      order.append((name, n))
      clock[0] += fixed + n * per_call
      return n
    return run
  a, b = timing.slopes([program("a", 30e-6, 5e-6), program("b", 10e-6, 2e-6)],
                       [lambda out: None] * 2, lo=4, hi=16, reps=3, min_window_s=1e-9)
  assert a["per_call_s"] == pytest.approx(5e-6) and b["per_call_s"] == pytest.approx(2e-6)
  assert a["executions"] == b["executions"] == 1
  # After the warm-up and the window sizing, each repetition times a then b.
  assert order[-12:] == [("a", 4), ("a", 16), ("b", 4), ("b", 16)] * 3
  with pytest.raises(ValueError, match="runs, blocks"):
    timing.slopes([program("a", 0, 1e-6)], [], lo=4, hi=16)
  assert timing.slope(program("c", 1e-6, 3e-6), lambda out: None, lo=4, hi=16,
                      reps=2)["per_call_s"] == pytest.approx(3e-6)


def test_slopes_repeat_while_the_repetitions_disagree(monkeypatch):
  from jaxfuse.runtime import timing
  clock = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

  def program(per_call_us):
    # Each repetition's per-call cost in turn (after the warm-up and sizing
    # runs); a repetition's two windows see the same cost.
    costs = iter([5] * 3 + per_call_us)
    cur = [next(costs)]

    def run(n):
      clock[0] += 10e-6 + n * cur[0] * 1e-6
      if n == 16:
        cur[0] = next(costs, 5)
      return n
    return run

  def timed(max_reps, noisy=(9, 9, 5)):
    return timing.slopes([program(list(noisy)), program([5, 5, 5])], [lambda out: None] * 2,
                         lo=4, hi=16, reps=3, min_window_s=1e-9, max_reps=max_reps)

  # Two slow repetitions of three decide the median unless more are taken.
  noisy, steady = timed(0)
  assert noisy["per_call_s"] == pytest.approx(9e-6) and noisy["per_call_reps"] == 3
  noisy, steady = timed(10)
  assert noisy["per_call_s"] == pytest.approx(5e-6)
  assert noisy["per_call_reps"] == 9   # interquartile range 0 from the ninth on
  assert steady["per_call_reps"] == 3 and steady["per_call_s"] == pytest.approx(5e-6)
  noisy, _ = timed(6)
  assert noisy["per_call_reps"] == 6 and noisy["per_call_s"] == pytest.approx(5e-6)
  assert noisy["per_call_spread"] == pytest.approx(4 / 5)
  assert timing.settled_spread([5.0, 5.0, 5.0, 9.0, 5.0]) == 0.0
  assert timing.settled_spread([4.0, 6.0]) == pytest.approx(0.4)
  assert timing.settled_spread([7.0]) == 0.0


def test_consume_outputs_keeps_every_output_whole_and_returns_samples():
  import jax
  import jax.numpy as jnp
  from jaxfuse.runtime import timing
  xs = [jnp.arange(12.0).reshape(3, 4) + i for i in range(3)]

  def prog(xs):
    return timing.consume_outputs([(x @ x.T, x * 2) for x in xs])
  got = np.asarray(jax.jit(prog)(xs))
  want = [v for x in xs for v in (float((x @ x.T)[0, 0]), float(x[0, 0] * 2))]
  np.testing.assert_allclose(got, want)
  # Behind the barrier each call's contraction is computed whole, not
  # narrowed to the one element returned.
  hlo = jax.jit(prog).lower(xs).compile().as_text()
  dots = [l for l in hlo.splitlines() if " dot(" in l]
  assert len(dots) == 3 and all("f32[3,3]" in l for l in dots)


def _host_clock_stamp(dep):
  """A CPU stand-in for device_clock.stamp: the host's ns clock, read when
  XLA runs the callback, i.e. once ``dep`` is computed."""
  import time
  import jax.numpy as jnp

  def now(_):
    t = time.perf_counter_ns() + (5 << 32)   # a high word too
    return np.array([t & 0xFFFFFFFF, t >> 32], np.uint32).view(np.int32)
  return jax.pure_callback(now, jax.ShapeDtypeStruct((2,), jnp.int32), dep)


def test_stamped_program_orders_its_stamps_around_every_call():
  """Every call's inputs come out of a barrier with the first stamp and the
  second stamp reads every call's output: no kernel of a call can run
  outside the span."""
  import jax.numpy as jnp
  from jaxfuse.runtime import device_clock
  sets = [[jnp.ones((4, 4)) * i, jnp.ones((4, 4))] for i in range(3)]
  jaxpr = jax.make_jaxpr(lambda s: device_clock.stamped(
      lambda a: [x @ y for x, y in a], s, stamp_fn=_host_clock_stamp))(sets).jaxpr
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}

  def ancestors(v, seen):
    e = producer.get(v)
    if e is not None and id(e) not in seen:
      seen.add(id(e))
      for u in e.invars:
        if u in producer or not hasattr(u, "val"):
          ancestors(u, seen)
    return seen
  stamps = [e for e in jaxpr.eqns if e.primitive.name == "pure_callback"]
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(stamps) == 2 and len(dots) == 3
  first, last = stamps
  for d in dots:
    assert id(first) in set().union(*(ancestors(u, set()) for u in d.invars))
    assert id(d) in ancestors(last.invars[0], set())
  start, end, consumed = jax.jit(lambda s: device_clock.stamped(
      lambda a: [x @ y for x, y in a], s, stamp_fn=_host_clock_stamp))(sets)
  assert device_clock.nanoseconds(end) >= device_clock.nanoseconds(start) > (5 << 32)
  np.testing.assert_allclose(np.asarray(consumed), [0.0, 4.0, 8.0])
  with pytest.raises(ValueError, match="args"):
    device_clock.stamped(lambda a: a, [], stamp_fn=_host_clock_stamp)


def test_nanoseconds_decodes_both_words():
  from jaxfuse.runtime import device_clock
  for t in (0, 2**31 + 5, 2**32 - 1, 2**32, 1_763_800_000_123_456_789):
    words = np.array([t & 0xFFFFFFFF, t >> 32], np.uint32).view(np.int32)
    assert device_clock.nanoseconds(words) == t


def test_span_slope_takes_the_stamps_and_fixed_kernels_out():
  from jaxfuse.runtime import device_clock

  def encode(t):
    return np.array([t & 0xFFFFFFFF, t >> 32], np.uint32).view(np.int32)
  clock = [2**40]
  jitter = iter([0, 40, -30, 10, 0, 20, -10, 0, 30, -20] * 3)

  def run(n):   # 7 us of stamps and output check, 3 us per call, +-40 ns
    t0 = clock[0]
    clock[0] += 100_000
    return encode(t0), encode(t0 + 7_000 + 3_000 * n + next(jitter)), None
  res = device_clock.span_slope(run, lo=8, hi=32, reps=7)
  assert res["per_call_s"] == pytest.approx(3e-6, rel=0.01)
  assert res["per_call_spread"] < 0.01
  assert res["spans_s"][8] == pytest.approx(31e-6, rel=0.01)
  # A clock that does not move tells nothing: an infinite spread, which
  # keep-or-drop reads as inconclusive.
  flat = device_clock.span_slope(lambda n: (encode(7), encode(7), None), lo=8, hi=32, reps=3)
  assert flat["per_call_spread"] == float("inf")
  assert flat["per_call_spread"] > launch.MAX_TIMING_SPREAD
  with pytest.raises(ValueError, match="lo, hi"):
    device_clock.span_slope(run, lo=8, hi=8)
  with pytest.raises(ValueError, match="reps"):
    device_clock.span_slope(run, lo=8, hi=32, reps=0)


def test_per_call_time_reads_the_device_clock_where_there_is_one(monkeypatch):
  """With a clock (here the host's, standing in for %globaltimer) the
  keep-or-drop timing is the slope of stamped spans; when the stamps fail it
  falls back to the host slope with one log line."""
  import jax.numpy as jnp
  from jaxfuse.runtime import device_clock
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  stamps, logged = [], []

  def stamp(dep):
    stamps.append(1)
    return _host_clock_stamp(dep)
  monkeypatch.setattr(device_clock, "available", lambda: True)
  monkeypatch.setattr(device_clock, "stamp", stamp)
  monkeypatch.setattr(launch.logging, "info", lambda msg, *a: logged.append(msg % a))
  slopes = []
  monkeypatch.setattr(device_clock, "span_slope",
                      lambda *a, f=device_clock.span_slope, **k: slopes.append(1) or f(*a, **k))
  fn = lambda a, b, c: [jnp.dot(jnp.dot(a, b), c)]
  fn2 = lambda a, b, c: [a @ (b @ c)]
  times = launch._per_call_times([fn, fn2], r, lo=1, hi=2, reps=2)
  assert slopes == [1, 1] and len(stamps) == 8   # two stamps traced per program, two programs each
  for t, spread in times:
    assert np.isfinite(t) and spread >= 0      # a CPU's time: not checked against anything

  def broken(*a, **k):
    raise RuntimeError("no stamp kernel")
  monkeypatch.setattr(device_clock, "stamped", broken)
  ((t, spread),) = launch._per_call_times([fn], r, lo=1, hi=2, reps=1)
  assert np.isfinite(t)
  assert sum("device clock failed" in m for m in logged) == 1


def test_timing_names_the_implementation_that_does_not_compile():
  """A dot whose precision algorithm the backend rejects (as XLA's GPU
  backend rejected jax.nn.dot_product_attention's F16_F16_F32 dot in a
  one-row multi-head step, H100, sixty-ninth session; the CPU rejects it
  always) and a function that does not trace are each named by index."""
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  fine = lambda a, b, c: [(a @ b) @ c]
  algo = lambda a, b, c: [jax.lax.dot(jax.lax.dot(a, b), c,
                                      precision=jax.lax.DotAlgorithmPreset.F16_F16_F32)]
  with pytest.raises(launch.TimingCompileError, match="implementation 1 does not compile") as e:
    launch._per_call_times([fine, algo], r, lo=1, hi=2, reps=1)
  assert e.value.index == 1

  def untraceable(a, b, c):
    raise ValueError("no")
  with pytest.raises(launch.TimingCompileError) as e:
    launch._per_call_times([untraceable, fine], r, lo=1, hi=2, reps=1)
  assert e.value.index == 0 and "ValueError: no" in str(e.value)


def test_a_timing_on_the_clock_is_not_repeated_for_an_implementation_that_does_not_compile(
    monkeypatch):
  """On the device clock, where the first implementation compiled with its
  stamps, another that does not compile fails by itself: no host timing
  compiles everything again. A failure of the first may be the stamps'."""
  from jaxfuse.runtime import device_clock
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  monkeypatch.setattr(device_clock, "available", lambda: True)
  monkeypatch.setattr(device_clock, "stamp", _host_clock_stamp)
  traced = []

  def broken(a, b, c):
    traced.append(1)
    raise ValueError("no")
  fine = lambda a, b, c: [(a @ b) @ c]
  with pytest.raises(launch.TimingCompileError, match="implementation 1"):
    launch._per_call_times([fine, broken], r, lo=1, hi=2, reps=1)
  assert len(traced) == 1                 # the clock's attempt only
  traced.clear()
  with pytest.raises(launch.TimingCompileError, match="implementation 0"):
    launch._per_call_times([broken, fine], r, lo=1, hi=2, reps=1)
  assert len(traced) == 2                 # the clock's, then the host's


def test_keep_or_drop_keeps_the_kernel_when_the_fallback_does_not_compile(monkeypatch, caplog):
  """The kernel passed its self-check and is all that runs: kept, untimed,
  with one warning. A rival that does not compile is left out of the
  timing; a pick that does not compile is the caller's fallback."""
  import logging as std_logging
  from jaxfuse.codegen import CodegenError
  r = examples.gemm_chain(1, 32, 16, 16, 16)

  class K:
    def __init__(self, plan):
      self.region, self.plan = r, plan
  calls = []

  def per_call(fails):       # implementation ``fails`` of the first timing does not compile
    def f(fns, region):
      calls.append(len(fns))
      if len(calls) == 1:
        raise launch.TimingCompileError(fails, RuntimeError("Unsupported dot precision algorithm"))
      return [(5e-6, 0.1)] * (len(fns) - 1) + [(9e-6, 0.1)]
    return f
  pick, rival = K("pick"), K("rival")
  launch._xla_decisions.clear()
  try:
    monkeypatch.setattr(launch, "_per_call_times", per_call(1))     # the fallback, no rival
    calls.clear()
    with caplog.at_level(std_logging.WARNING):
      assert launch._keep_fused(pick, lambda *a: a) is pick
    assert any("XLA does not compile, the fused kernel is kept untimed" in m
               for m in caplog.messages)
    assert r.signature() not in launch._xla_decisions
    calls.clear()
    monkeypatch.setattr(launch, "_per_call_times", per_call(2))     # the fallback, with a rival
    assert launch._keep_fused(pick, lambda *a: a, rival=rival) is pick
    calls.clear()
    monkeypatch.setattr(launch, "_per_call_times", per_call(1))     # the rival
    assert launch._keep_fused(pick, lambda *a: a, rival=rival) is pick
    assert calls == [3, 2] and launch._xla_decisions[r.signature()][0][0] == 5e-6
    launch._xla_decisions.clear()
    calls.clear()
    monkeypatch.setattr(launch, "_per_call_times", per_call(0))     # the pick
    with pytest.raises(CodegenError, match="implementation 0 does not compile"):
      launch._keep_fused(pick, lambda *a: a, rival=rival)
  finally:
    launch._xla_decisions.clear()
    launch._kept.clear()


def test_keep_or_drop_input_sets_are_rolled_copies_made_by_one_program(monkeypatch):
  import jax.numpy as jnp
  xs = [jnp.arange(12.0).reshape(3, 4), jnp.float32(2.5)]
  compiled = []
  real = launch._compile
  monkeypatch.setattr(launch, "_compile", lambda *a, **k: compiled.append(1) or real(*a, **k))
  sets = launch._shifted_sets(xs, 5)
  assert len(compiled) == 1 and len(sets) == 5
  for i, (m, c) in enumerate(sets):
    np.testing.assert_array_equal(np.asarray(m), np.roll(np.arange(12.0).reshape(3, 4), i, -1))
    assert float(c) == 2.5


# Compiled in a fresh process (the ``fresh_python`` fixture says why).
_STAMP_PTX = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from jaxfuse.runtime import device_clock
try:
  kernel = device_clock._stamp_kernel()
  kernel = triton.runtime.jit.JITFunction(getattr(kernel, "fn", kernel))
  src = triton.compiler.ASTSource(fn=kernel, signature={"dep_ptr": "*fp32", "out_ptr": "*i32"},
                                  constexprs={})
  ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
except (ImportError, AttributeError, TypeError) as e:   # another Triton's compile API
  print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
print(json.dumps({"ptx": ptx}))
"""


def test_stamp_kernel_reads_globaltimer_when_compiled_for_hopper(fresh_python):
  """The stamp cannot run in Triton's interpreter (inline PTX); compiled
  offline for sm_90 it must read %globaltimer and store both words."""
  pytest.importorskip("triton")
  res = fresh_python(_STAMP_PTX)
  if "skip" in res:
    pytest.skip(f"offline compile unavailable: {res['skip']}")
  ptx = res["ptx"]
  assert "%globaltimer" in ptx
  assert sum("st.global.b32" in l for l in ptx.splitlines()) == 2


def test_triton_cache_dir_is_made_writable(monkeypatch, tmp_path):
  import os
  from jaxfuse.config import config
  monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
  with config.override(cache_dir=str(tmp_path / "jf")):
    launch._ensure_triton_cache_dir()
  assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "jf" / "triton")
  assert os.path.isdir(os.environ["TRITON_CACHE_DIR"])
  monkeypatch.setenv("TRITON_CACHE_DIR", "/user/choice")
  launch._ensure_triton_cache_dir()
  assert os.environ["TRITON_CACHE_DIR"] == "/user/choice"


def test_device_reference_runs_eagerly_inside_a_trace():
  # The self-check computes the reference while jaxfuse.jit traces the
  # user's function: it must not be staged into that trace.
  import jax
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  xs = launch.random_inputs(r, 7)
  seen = []

  def f(x):
    seen.append(launch._reference_on_gpu(r, xs))
    return x * 2
  assert float(jax.jit(f)(1.0)) == 2.0
  assert launch.compare(r, seen[0], ir.evaluate(r, xs)) <= launch.tolerance(r)


def test_keep_or_drop_against_xla(monkeypatch):
  from jaxfuse.codegen import CodegenError
  from jaxfuse.planner import cost_model
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 16, 16)

  class K:
    region = r
    plan = None
  # (fused s, spread), (XLA s, spread), model verdict, kept?
  cases = (((2e-6, 0.1), (5e-6, 0.1), None, True),
           ((5.1e-6, 0.1), (5e-6, 0.1), None, True),      # within 5%: a tie; the model says fused
           ((4.9e-6, 0.1), (5e-6, 0.1), "slower", False), # a tie; the model says XLA
           ((4.5e-6, 0.1), (5e-6, 0.1), "slower", True),  # measured faster: the model is not asked
           ((6e-6, 0.1), (5e-6, 0.1), None, False),
           ((2e-6, 0.1), (0.0, 0.1), None, True),         # a zero slope: the model says fused
           ((-1e-6, 0.1), (5e-6, 0.1), "slower", False),  # a negative slope: the model says XLA
           ((6e-6, 0.1), (1e-6, 0.9), None, True),        # XLA's repetitions disagree
           ((6e-6, 0.9), (1e-6, 0.1), "slower", False))
  for fused, xla, verdict, kept in cases:
    launch._xla_decisions.clear()
    times = iter((fused, xla))
    monkeypatch.setattr(launch, "_per_call_times", lambda fns, region: [next(times) for _ in fns])
    monkeypatch.setattr(cost_model, "slower_than_unfused", lambda *a, v=verdict: v)
    if kept:
      launch._keep_fused(K(), lambda *a: a)
    else:
      with pytest.raises(CodegenError, match="measured slower than XLA|inconclusive|a tie"):
        launch._keep_fused(K(), lambda *a: a)
  launch._xla_decisions.clear()


def test_fused_call_records_how_it_settled_a_region(monkeypatch):
  """``launch.outcome``: the kernel's plan with the keep-or-drop timing
  when one was taken, or the reason XLA's ops run; nothing for a region
  never lowered or lowered with an explicit plan."""
  r = T.gemm_chain(M=16, N=24, K=8, H=8)
  xs = launch.random_inputs(r, seed=2)
  assert launch.outcome(r) is None
  launch._xla_decisions[r.signature()] = ((5e-6, 0.01), (7e-6, 0.01), 0)
  try:
    launch.fused_call(r, xs, backend="interpret")
  finally:
    launch._xla_decisions.pop(r.signature())
  got = launch.outcome(r)
  assert got.fused and got.plan == str(launch._chosen[(r.signature(), "interpret", None)].plan)
  assert str(got).startswith("fused (measured 5.0 us fused vs 7.0 us XLA): grid(")
  assert launch.outcome(r, "triton") is None and launch.outcome(r, "interpret") is got
  r2 = T.gemm_chain(M=16, N=24, K=8, H=16)
  monkeypatch.setattr(launch, "_candidate_plans", lambda *a, **k: (_ for _ in ()).throw(
      launch.LeftToXLA("not memory-bound: intensity 300 FLOP/B >= ridge 263; left to XLA")))
  with pytest.raises(launch.LeftToXLA):
    launch.fused_call(r2, launch.random_inputs(r2, seed=2), backend="interpret")
  assert str(launch.outcome(r2)) == "XLA's ops: not memory-bound: intensity 300 FLOP/B >= ridge 263; left to XLA"
  r3 = T.gemm_chain(M=16, N=16, K=8, H=8)
  with pytest.raises(launch.LeftToXLA):   # an explicit plan is the caller's: not recorded
    launch.fused_call(r3, launch.random_inputs(r3, seed=2), backend="interpret",
                      plan=[])
  assert launch.outcome(r3) is None


def test_undecided_keep_or_drop_asks_the_model_about_its_best_plan(monkeypatch):
  """When timing cannot decide, the verdict rests on the model's best
  prediction among the candidates, not on the measured pick's own: the
  measured pick ran faster than the model's best, so that bounds it."""
  import dataclasses
  from jaxfuse.planner import cost_model
  r = examples.gemm_chain(1, 512, 512, 512, 256)
  ranked = plan_region(r, "h100", use_cache=False).ranked
  slow = max(ranked, key=lambda p: p.predicted.time_s)
  assert launch._best_predicted(list(ranked)) is min(ranked, key=lambda p: p.predicted.time_s)
  assert launch._best_predicted([dataclasses.replace(slow, predicted=None)]) is None

  class K:
    region = r
    plan = slow
  asked = []
  monkeypatch.setattr(cost_model, "slower_than_unfused",
                      lambda region, plan, dev: asked.append(plan))
  for model_plan, want in ((ranked[0], ranked[0]), (None, slow)):
    launch._xla_decisions.clear()
    times = iter(((5e-6, 0.9), (5e-6, 0.1)))      # inconclusive
    monkeypatch.setattr(launch, "_per_call_times", lambda fns, region: [next(times) for _ in fns])
    launch._keep_fused(K(), lambda *a: a, model_plan=model_plan)
    assert asked.pop() is want
  launch._xla_decisions.clear()


def _timed_kernel(tmp_path, monkeypatch, gpu):
  """A stand-in kernel of a small chain whose keep-or-drop timings read
  6 us fused and 5 us for the other side, a plan cache in ``tmp_path``, and
  the GPU named ``gpu[0]``; returns the kernel's class and the list that
  counts timings."""
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path))

  class K:
    region = examples.gemm_chain(1, 32, 16, 16, 16)
    plan = "plan A"
  timed = []
  monkeypatch.setattr(launch, "_per_call_times",
                      lambda fns, region: [timed.append(1) or t for t in ((6e-6, 0.1), (5e-6, 0.1))])
  monkeypatch.setattr(launch, "_gpu_name", lambda: gpu[0])
  return K, timed


def test_keep_or_drop_timing_is_kept_in_the_plan_cache(tmp_path, monkeypatch):
  """A process that finds a region's keep-or-drop timing on disk (same
  region, plan, GPU and versions) decides from it without timing again;
  another plan, another GPU, or no GPU at all times afresh."""
  from jaxfuse.codegen import CodegenError
  gpu = ["NVIDIA H100 80GB HBM3"]
  K, timed = _timed_kernel(tmp_path, monkeypatch, gpu)

  def decide():
    launch._xla_decisions.clear()      # a new process
    with pytest.raises(CodegenError, match="measured slower than XLA: fused 6.0 us vs 5.0 us"):
      launch._keep_fused(K(), lambda *a: a)
    return len(timed)
  try:
    assert decide() == 2                       # timed: fused and XLA
    assert len(os.listdir(tmp_path / "timings")) == 1
    assert decide() == 2                       # from disk, same verdict
    K.plan = "plan B"
    assert decide() == 4
    gpu[0] = "NVIDIA H200"
    assert decide() == 6
    assert len(os.listdir(tmp_path / "timings")) == 3
    for f in os.listdir(tmp_path / "timings"):  # corrupt entries are timed again
      (tmp_path / "timings" / f).write_text("{")
    assert decide() == 8
    gpu[0] = None                              # no GPU: nothing kept
    K.plan = "plan C"
    assert decide() == 10 and decide() == 12
    assert len(os.listdir(tmp_path / "timings")) == 3
  finally:
    launch._xla_decisions.clear()


def test_gpu_self_check_pass_is_kept_in_the_plan_cache(tmp_path, monkeypatch):
  """A kernel that passed its self-check on this GPU is not checked again by
  a later process; a failed check is not kept, another printed source or
  another GPU is checked again, and the interpreter path always checks."""
  from jaxfuse.codegen import CodegenError
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path))
  r = T.gemm_chain(M=16, N=24, K=8, H=8)
  k = generate(r, plan_region(r, "h100", use_cache=False).best)
  gpu, checked, fail = ["NVIDIA H100 80GB HBM3"], [], [False]

  def fake_check(kernel, runner):
    checked.append(kernel.source)
    if fail[0]:
      raise CodegenError("self-check failed")
  monkeypatch.setattr(launch, "self_check", fake_check)
  monkeypatch.setattr(launch, "_gpu_name", lambda: gpu[0])
  on_gpu = launch._run_on_gpu
  fail[0] = True
  with pytest.raises(CodegenError):
    launch._checked(k, on_gpu)
  fail[0] = False
  launch._checked(k, on_gpu)                 # the failure was not kept: checked
  launch._checked(k, on_gpu)                 # passed before: not checked
  assert len(checked) == 2
  launch._checked(dataclasses.replace(k, source=k.source + "\n"), on_gpu)
  gpu[0] = "NVIDIA H200"
  launch._checked(k, on_gpu)
  assert len(checked) == 4
  launch._checked(k, launch.run_interpreted)
  launch._checked(k, launch.run_interpreted)
  assert len(checked) == 6
  gpu[0] = None                              # no GPU: nothing kept
  launch._checked(k, on_gpu)
  launch._checked(k, on_gpu)
  assert len(checked) == 8
  assert len(os.listdir(tmp_path / "checks")) == 3


def test_keep_or_drop_measures_and_logs_a_region_once(monkeypatch):
  from jaxfuse.codegen import CodegenError
  r = examples.gemm_chain(1, 32, 16, 16, 16)

  class K:
    region = r
    plan = None
  launch._xla_decisions.clear()
  times, timed, logged = iter(((6e-6, 0.1), (5e-6, 0.1))), [], []   # fused, then XLA
  monkeypatch.setattr(launch, "_per_call_times",
                      lambda fns, region: [timed.append(1) or next(times) for _ in fns])
  monkeypatch.setattr(launch.logging, "info", lambda msg, *a: logged.append(msg % a))
  try:
    for _ in range(3):   # the region lowered three times
      with pytest.raises(CodegenError, match="measured slower than XLA"):
        launch._keep_fused(K(), lambda *a: a)
  finally:
    launch._xla_decisions.clear()
  assert len(timed) == 2                      # fused and XLA, once
  assert sum("measured fused" in m for m in logged) == 1


def test_auto_times_the_best_unsplit_plan_beside_a_split_pick(tmp_path, monkeypatch):
  """tune='auto' times a region whose pick splits its key loop across
  programs against XLA's ops (the model is unsure), and the model's best
  unsplit plan beside it (``rival_plan``): batch 8 of a grouped decoding
  step, whose unsplit plan ran 16% faster than the 8-way split the model
  picks (H100, sixty-eighth session). No rival for an unsplit pick, or under
  'model' and 'measure'. For one sequence (no unsplit plan within
  DIVERSE_MAX_RATIO: 8 programs) the rival is a plan of another structure
  the model ties with the pick (``search.tied_rival``)."""
  from jaxfuse.config import config
  from jaxfuse.planner import search
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path))
  b8 = examples.attention(8, 8, 4, 4096, 128)
  b1 = examples.attention(1, 8, 4, 4096, 128)
  with config.override(tune="auto"):
    plans = launch._candidate_plans(b8, None, backend="triton")
    assert plans[0].split and launch.keep_or_drop_timed(b8, plans)
    rival = launch.rival_plan(b8, plans[0])
    assert rival is not None and rival.split is None and not rival.form
    assert (plans[0].predicted.time_s <= rival.predicted.time_s
            <= search.DIVERSE_MAX_RATIO * plans[0].predicted.time_s)
    assert launch.rival_plan(b8, rival) is None
    one = launch._candidate_plans(b1, None, backend="triton")
    with launch._lock:
      alternatives = launch._alternatives[b1.signature()]
    assert one[0].split and search.unsplit_rival(b1, one[0], alternatives) is None
    # Without one, the rival is a plan of another structure the model ties
    # with the pick (within TIED_RIVAL_RATIO), where the region is timed.
    tied = launch.rival_plan(b1, one[0])
    assert tied is not None and tied is search.tied_rival(b1, one[0], alternatives)
    assert tied.predicted.time_s <= search.TIED_RIVAL_RATIO * one[0].predicted.time_s
    assert search.tied_rival(b1, dataclasses.replace(one[0], split=None), alternatives) is None
  for tune in ("model", "measure"):
    with config.override(tune=tune):
      assert launch.rival_plan(b8, plans[0]) is None

  # fused_call builds the rival's kernel and keeps what the timing kept.
  class K:
    def __init__(self, region, plan):
      self.region, self.plan = region, plan
  timed = []

  def keep(k, original, model_plan=None, parts=0, rival=None):
    timed.append((k.plan, rival.plan))
    return rival
  monkeypatch.setattr(launch, "_chosen", {})
  monkeypatch.setattr(launch, "select_kernel", lambda region, ps, **kw: K(region, ps[0]))
  monkeypatch.setattr(launch, "_keep_fused", keep)
  launched = []
  monkeypatch.setattr(launch, "triton_launch",
                      lambda k, args, offsets=None: launched.append(k.plan) or list(args))
  xs = [np.zeros(b.shape, np.float16) for b in b8.inputs]
  with config.override(tune="auto"):
    launch.fused_call(b8, xs, backend="triton", original=lambda *a: a)
    launch.fused_call(b8, xs, backend="triton", original=lambda *a: a)
  assert timed == [(plans[0], rival)] and launched == [rival, rival]


def test_keep_or_drop_keeps_the_faster_of_pick_and_rival(tmp_path, monkeypatch):
  """The pick, its rival and the fallback are timed in one run; the rival
  replaces the pick only when faster by more than TIMING_TIE with both
  timings' repetitions agreeing, and the fallback is judged against the
  kernel kept. Both timings are kept in the plan cache: a later process
  decides alike without timing."""
  from jaxfuse.codegen import CodegenError
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(launch, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
  r = examples.gemm_chain(1, 32, 16, 16, 16)

  class K:
    def __init__(self, plan):
      self.region, self.plan = r, plan
  runs = []
  # (pick, rival, XLA) times and spreads -> the plan kept, or None: dropped.
  cases = ((((5.5e-6, 0.1), (4.6e-6, 0.1), (9e-6, 0.1)), "rival"),
           (((5.0e-6, 0.1), (4.9e-6, 0.1), (9e-6, 0.1)), "pick"),     # a tie
           (((5.5e-6, 0.1), (4.6e-6, 0.8), (9e-6, 0.1)), "pick"),     # noisy rival
           (((6.0e-6, 0.1), (7.0e-6, 0.1), (9e-6, 0.1)), "pick"),
           (((9.9e-6, 0.1), (8.0e-6, 0.1), (7e-6, 0.1)), None))       # XLA beats both
  for i, (times, want) in enumerate(cases):
    pick, rival = K(f"pick {i}"), K(f"rival {i}")
    for process in range(2):
      launch._xla_decisions.clear()
      launch._kept.clear()
      monkeypatch.setattr(launch, "_per_call_times",
                          lambda fns, region, t=times: runs.append(len(fns)) or list(t))
      if want is None:
        with pytest.raises(CodegenError, match="measured slower than XLA: fused 8.0 us"):
          launch._keep_fused(pick, lambda *a: a, rival=rival)
      else:
        kept = launch._keep_fused(pick, lambda *a: a, rival=rival)
        assert kept is (rival if want == "rival" else pick)
        assert launch._keep_fused(pick, lambda *a: a, rival=rival) is kept   # lowered again
        t = times[1 if want == "rival" else 0][0]
        assert launch._xla_decisions[r.signature()][0][0] == t
    assert runs == [3], (i, runs)        # the second process read the cache
    runs.clear()
  launch._xla_decisions.clear()
  launch._kept.clear()


def test_device_reference_is_cached_per_region_and_seed():
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  a = launch._device_reference(r, 3)
  assert launch._device_reference(r, 3) is a                 # same inputs: reused
  assert launch.compare(r, a, ir.evaluate(r, launch.random_inputs(r, 3))) <= launch.tolerance(r)
  b = launch._device_reference(r, 4)                          # other inputs: recomputed
  assert b is not a
  assert launch.compare(r, b, ir.evaluate(r, launch.random_inputs(r, 4))) <= launch.tolerance(r)


def test_reference_started_in_the_background_is_the_one_used(monkeypatch):
  import jax
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 32, 16)
  started = []

  def f(x):   # measured tuning starts it while jaxfuse.jit traces
    started.append(launch.start_reference(r, 5))
    return x + 1
  jax.jit(f)(1.0)
  got = launch._device_reference(r, 5)
  assert got is started[0].result()
  assert launch.compare(r, got, ir.evaluate(r, launch.random_inputs(r, 5))) <= launch.tolerance(r)
  # A reference that failed raises for its waiters, and the next request
  # computes it again instead of repeating the failure.
  real = launch._reference_on_gpu
  monkeypatch.setattr(launch, "_reference_on_gpu",
                      lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost")))
  with pytest.raises(RuntimeError, match="device lost"):
    launch._device_reference(r, 6)
  monkeypatch.setattr(launch, "_reference_on_gpu", real)
  again = launch._device_reference(r, 6)
  assert launch.compare(r, again, ir.evaluate(r, launch.random_inputs(r, 6))) <= launch.tolerance(r)


def test_gpu_self_check_starts_its_reference_before_the_kernel_compiles(monkeypatch):
  """On the GPU the reference's compile overlaps the kernel's: it is under
  way before the kernel's program is built, and it is what the kernel's
  outputs are compared with."""
  import threading
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 32, 16)
  k = generate(r, plan_region(r, "h100").best, interpret=True)
  launch._last_inputs.clear()
  launch._last_reference.clear()
  release = threading.Event()
  refs = []

  def reference(region, xs, **kw):   # blocks until the kernel has run: in another thread
    refs.append(threading.current_thread().name)
    assert release.wait(30)
    return ir.evaluate(region, xs)

  def kernel_on_gpu(kern, xs):
    for _ in range(1000):      # the reference began before the kernel ran
      if refs:
        break
      threading.Event().wait(0.01)
    assert refs == ["jaxfuse-reference"]
    release.set()
    return launch.run_interpreted(kern, xs)

  monkeypatch.setattr(launch, "_reference_on_gpu", reference)
  monkeypatch.setattr(launch, "_run_on_gpu", kernel_on_gpu)
  launch.self_check(k, kernel_on_gpu)
  assert refs == ["jaxfuse-reference"]       # computed once, in the background
  # A wrong kernel still fails against that reference.
  launch._last_inputs.clear()
  launch._last_reference.clear()
  refs.clear()
  release.clear()

  def wrong(kern, xs):
    return [o * 2 + 1 for o in kernel_on_gpu(kern, xs)]
  monkeypatch.setattr(launch, "_run_on_gpu", wrong)
  with pytest.raises(launch.CodegenError, match="self-check failed"):
    launch.self_check(k, wrong)
  launch._last_inputs.clear()
  launch._last_reference.clear()


def test_fused_call_releases_the_check_data_of_its_region(monkeypatch):
  """Once a region's kernel is chosen, its shared random inputs and
  reference (hundreds of MB for a large attention) are let go."""
  monkeypatch.setattr(launch, "_chosen", {})
  monkeypatch.setattr(launch, "_kernels", {})
  r = T.gemm_chain(M=16, N=16, K=16, H=16)
  made = []
  real = launch.random_inputs
  xs = real(r, seed=2)
  monkeypatch.setattr(launch, "random_inputs", lambda *a: made.append(a) or real(*a))
  launch.fused_call(r, xs, backend="interpret")
  assert made                     # the self-check made its inputs
  assert not any(k[0] == r.signature() for k in launch._last_inputs)
  assert not any(k[0] == r.signature() for k in launch._last_reference)


def test_random_inputs_are_seeded_chunked_and_thread_independent(monkeypatch):
  import os
  from jaxfuse.planner import examples
  r = examples.attention(1, 2, 40, 24, 8)
  monkeypatch.setattr(launch, "_RANDOM_CHUNK", 100)   # several chunks per input, in threads
  a = launch.random_inputs(r, 3)
  monkeypatch.setattr(os, "cpu_count", lambda: 1)     # the same values made serially
  b = launch.random_inputs(r, 3)
  c = launch.random_inputs(r, 4)
  for x, y, z, buf in zip(a, b, c, r.inputs):
    assert x.shape == tuple(buf.shape) and x.dtype == np.float16
    np.testing.assert_array_equal(x, y)
    assert not np.array_equal(x, z)
  allv = np.concatenate([x.ravel().astype(np.float64) for x in a])
  assert abs(allv.mean()) < 0.1 and 0.9 < allv.std() < 1.1
  # Chunks are independent streams: no chunk repeats another.
  q = a[0].ravel()
  assert not np.array_equal(q[:100], q[100:200])


def test_reference_measurer_and_self_check_share_one_input_set(monkeypatch):
  """The background reference, the measurer and the chosen kernel's
  self-check use the same random arrays, made once (a large region's took
  seconds each time)."""
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 32, 16)
  made = []
  real = launch.random_inputs
  monkeypatch.setattr(launch, "random_inputs", lambda *a: made.append(a) or real(*a))
  seen = []
  monkeypatch.setattr(launch, "_reference_on_gpu", lambda region, xs, **kw: seen.append(xs) or [])
  launch._last_inputs.clear()
  launch._last_reference.clear()
  launch.start_reference(r, launch.MEASURE_SEED).result()
  m = launch._TorchMeasurer(r, launch.MEASURE_SEED, device="cpu")
  assert m.xs is seen[0] and len(made) == 1
  assert not m.xs[0].flags.writeable          # shared: nobody may write to them
  runs = []
  k = generate(r, plan_region(r, "h100").best, interpret=True)
  launch.self_check(k, lambda kern, xs: runs.append(xs) or launch.run_interpreted(kern, xs))
  assert runs[0] is m.xs and len(made) == 1
  launch._last_inputs.clear()
  launch._last_reference.clear()


def _training_attention_regions(recompute: bool = False):
  """The attention chains jaxfuse captures, simplified: in a training step
  with the softmax in float32 ('train') or float16 ('train16'), and in the
  forward alone; without ``recompute`` (``config.recompute``) the
  backward's products read the forward's probabilities."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top

  def attention(q, k, v, softmax_dtype=jnp.float32):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    p = jax.nn.softmax(s.astype(softmax_dtype), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

  def step(q, k, v, g, softmax_dtype=jnp.float32):
    # The loss too, as a training step returns it: under jax.grad alone the
    # forward's P @ V is dead code, which capture drops.
    return jax.value_and_grad(
        lambda *a: jnp.sum(attention(*a, softmax_dtype).astype(jnp.float32) * g),
        argnums=(0, 1, 2))(q, k, v)

  x = jax.ShapeDtypeStruct((2, 256, 4, 64), np.float16)
  chains = {}
  for name, fn, args in (("train", step, (x, x, x, x)),
                         ("train16", lambda *a: step(*a, jnp.float16), (x, x, x, x)),
                         ("forward", attention, (x, x, x))):
    with config.override(recompute=recompute):
      regions = [ir.simplify(c.region) for c in capture.find_regions(jax.make_jaxpr(fn)(*args))]
    # (With recompute the forward also forms rowsum(do * o): 3 contractions.)
    chains[name] = [r for r in regions if len(r.contractions) == 2 + recompute
                    and r.einsum_summary().startswith("bmgk,bngk->bgmn ; bgmn,bng")]
  return chains


def test_a_region_that_writes_wide_copies_of_its_scores_is_left_to_xla(monkeypatch):
  """A training step's forward attention with a float32 softmax writes its
  float32 exponentials and float16 probabilities for the backward; fused,
  it measured slower in the step than XLA's ops, which write the scores in
  float16 and recompute the rest (H100, seventy-first session: 26.5
  against 20.1 us per BERT-Base layer), while timed alone it won. It is left to XLA under 'model' and 'auto', before any timing;
  'measure' still times it and the interpreter still runs it. With a
  float16 softmax its written intermediates are all float16 (fused it
  measured faster: 16.4 against 21.9 us) and the forward alone writes only
  its result: neither is left. (Without ``config.recompute``: with it, the
  backward recomputes what it reads and the forward writes none of it.)"""
  from jaxfuse.config import config
  from jaxfuse.devices import get_device
  from jaxfuse.planner import cost_model
  import jaxfuse.devices as devices
  h100 = get_device("h100")
  monkeypatch.setattr(devices, "get_device", lambda *a, **k: h100)
  chains = _training_attention_regions()
  [train], [train16], [fwd] = chains["train"], chains["train16"], chains["forward"]
  written = ir.written_intermediates(train)
  vm = train.value_map
  # Its exponentials (float32) and probabilities (float16). Its float32
  # scores are read only by the dead compare of reduce_max's JVP: not written.
  assert len(written) == 2 and all(set(vm[v].loops) == {"b", "g", "m", "n"} for v in written)
  assert sorted(vm[v].dtype for v in written) == ["float16", "float32"]
  # The row maxima and sums it writes too are small: not counted.
  assert any(set(vm[v].loops) == {"b", "g", "m"} for v in train.output_names)
  assert ir.written_intermediates(fwd) == []
  written16 = ir.written_intermediates(train16)
  assert len(written16) == 2 and {train16.value_map[v].dtype for v in written16} == {"float16"}
  assert cost_model.writes_its_intermediates(fwd) is None
  assert cost_model.writes_its_intermediates(train16) is None
  why = cost_model.writes_its_intermediates(train)
  wide = sorted(v for v in written if vm[v].dtype == "float32")
  assert why.startswith(f"writes {', '.join(wide)} (") and "MiB" in why
  for tune in ("model", "auto"):
    with config.override(tune=tune):
      with pytest.raises(launch.LeftToXLA, match="wider copies.*left to XLA"):
        launch._candidate_plans(train, None, backend="triton")
      assert launch._candidate_plans(fwd, None, backend="triton")
  with config.override(tune="model"):
    assert launch._candidate_plans(train16, None, backend="triton")
  # With the backward's own copies (the default) the forward writes its row
  # statistics and result only.
  [train] = _training_attention_regions(recompute=True)["train"]
  assert ir.written_intermediates(train) == [] and cost_model.writes_its_intermediates(train) is None
  with config.override(tune="auto"):
    assert launch._candidate_plans(train, None, backend="interpret")
  # 'measure' (its measured tuning replaced by the model's plans here).
  model_plans = launch._planned(train, False)
  monkeypatch.setattr(launch, "_planned", lambda region, measured: model_plans)
  with config.override(tune="measure"):
    assert launch._candidate_plans(train, None, backend="triton")


def test_model_leaves_predicted_losers_to_xla(monkeypatch):
  """tune='model': MCFuser G6 without split reductions (measured 1.6x
  slower fused on an H200) is left to XLA on the model's word; G1 and G4
  with split reductions (the default) are fused; the interpreter path does
  not apply the model's verdict."""
  from jaxfuse.codegen import CodegenError
  from jaxfuse.config import config
  from jaxfuse.devices import get_device
  from jaxfuse.planner import examples
  import jaxfuse.devices as devices
  h200 = get_device("h200")
  monkeypatch.setattr(devices, "get_device", lambda *a, **k: h200)
  g6 = examples.gemm_chain(1, 512, 512, 1024, 256)
  g1 = examples.gemm_chain(1, 512, 256, 64, 64)
  with config.override(tune="model", allow_split=False):
    with pytest.raises(launch.LeftToXLA, match="as separate kernels.*left to XLA"):
      launch._candidate_plans(g6, None, backend="triton")
    assert launch._candidate_plans(g1, None, backend="triton")
    assert launch._candidate_plans(g6, None, backend="interpret")
  # G4 (measured 1.4x faster fused, split) is predicted near XLA's time:
  # tune='model' leaves it to XLA, tune='auto' plans it split and times it.
  g4 = examples.gemm_chain(1, 512, 512, 256, 256)
  with config.override(tune="model"):
    with pytest.raises(launch.LeftToXLA, match="separate kernels"):
      launch._candidate_plans(g4, None, backend="triton")
  with config.override(tune="auto"):
    plans = launch._candidate_plans(g4, None, backend="triton")
    assert plans[0].split and launch.keep_or_drop_timed(g4, plans)


def test_auto_times_keep_or_drop_only_where_the_model_is_unsure(monkeypatch):
  """tune='auto' (the default): a region the model is sure of is kept or
  dropped on its word, as under tune='model'; a region it is unsure of
  (float32 dots, or between the bounds: MCFuser G6 at float16) is planned
  by the model and its kernel timed against XLA's ops,
  as under tune='measure', whatever the model's verdict."""
  from jaxfuse.config import config
  from jaxfuse.devices import get_device
  import jaxfuse.devices as devices
  h100 = get_device("h100")
  monkeypatch.setattr(devices, "get_device", lambda *a, **k: h100)
  g1 = examples.gemm_chain(1, 512, 256, 64, 64)                     # sure: fused
  g6 = examples.gemm_chain(1, 512, 512, 1024, 256)                  # near the bound
  g1_32 = examples.gemm_chain(1, 512, 256, 64, 64, dtype="float32")     # predicted a win
  g4_32 = examples.gemm_chain(1, 512, 512, 256, 256, dtype="float32")   # near parity
  mlp_32 = examples.mlp_chain(1, 8, (768, 3072, 768), dtype="float32")  # 2.5x: a loss
  with config.override(tune="model"):
    for r in (g6, g4_32, mlp_32):
      with pytest.raises(launch.LeftToXLA, match="separate kernels"):
        launch._candidate_plans(r, None, backend="triton")
    for r in (g1, g1_32):
      assert not launch.keep_or_drop_timed(r, launch._candidate_plans(r, None, backend="triton"))
  with config.override(tune="auto"):
    timed = {}
    for name, r in (("g1", g1), ("g6", g6), ("g1_32", g1_32), ("g4_32", g4_32)):
      plans = launch._candidate_plans(r, None, backend="triton")
      assert plans and plans[0].predicted is not None
      timed[name] = launch.keep_or_drop_timed(r, plans)
    assert timed == {"g1": False, "g6": True, "g1_32": True, "g4_32": True}
    # Without the original ops to time against, the model's verdict stands.
    with pytest.raises(launch.LeftToXLA, match="separate kernels"):
      launch._candidate_plans(g4_32, None, backend="triton", timing=False)
    with pytest.raises(launch.LeftToXLA, match="separate kernels"):   # the model's word
      launch._candidate_plans(mlp_32, None, backend="triton")
  with config.override(tune="measure"):
    assert launch.keep_or_drop_timed(g1, [object()])

  # fused_call times exactly the regions keep_or_drop_timed names.
  class K:
    def __init__(self, region, plan):
      self.region, self.plan = region, plan
  kept = []
  monkeypatch.setattr(launch, "_chosen", {})
  monkeypatch.setattr(launch, "select_kernel",
                      lambda region, plans, **kw: K(region, plans[0]))
  monkeypatch.setattr(launch, "_keep_fused",
                      lambda k, original, model_plan=None, parts=0, rival=None:
                      kept.append(k.region) or k)
  monkeypatch.setattr(launch, "triton_launch", lambda k, args, offsets=None: list(args))
  with config.override(tune="auto"):
    for r in (g1, g4_32):
      xs = [np.zeros(b.shape, np.float16) for b in r.inputs]
      launch.fused_call(r, xs, backend="triton", original=lambda *a: a)
    assert kept == [g4_32]
    launch._chosen.clear()
    with pytest.raises(launch.LeftToXLA):    # nothing to time against: the model decides
      launch.fused_call(g4_32, xs, backend="triton")
  assert kept == [g4_32]


def test_left_to_xla_is_logged_as_a_decision(caplog):
  """A LeftToXLA decision is one INFO line; a real failure one WARNING."""
  import logging as std_logging
  from jaxfuse.planner import examples
  from jaxfuse.runtime import primitive
  r = examples.gemm_chain(1, 48, 16, 16, 16)
  primitive._warned.clear()
  with caplog.at_level(std_logging.INFO):
    primitive._warn_fallback(r, "g", "triton kernel", launch.LeftToXLA("predicted slower"))
    primitive._warn_fallback(r, "g", "triton kernel", launch.LeftToXLA("predicted slower"))
    primitive._warn_fallback(r, "g", "interpret kernel", RuntimeError("boom"))
  recs = [(x.levelno, x.getMessage()) for x in caplog.records if "jaxfuse: region" in x.getMessage()]
  assert recs == [(std_logging.INFO, recs[0][1]), (std_logging.WARNING, recs[1][1])]
  assert "left to XLA: predicted slower" in recs[0][1] and "boom" in recs[1][1]
  primitive._warned.clear()


def test_make_measure_marks_unmeasured_plans(monkeypatch):
  """measure() returns None for plans the budget left unmeasured and inf
  for plans that failed, so the search can tell them apart."""
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 16, 16)

  def fake(region, plans, *, budget_s=None, reps=20, errors=None):
    errors.extend([None, "CodegenError: boom", launch._BUDGET_SPENT])
    return [1e-6, float("inf"), float("inf")]
  monkeypatch.setattr(launch, "measure_plans", fake)
  m = launch.make_measure(r, budget_s=60.0)
  assert m(["a", "b", "c"]) == [1e-6, float("inf"), None]
  spent = launch.make_measure(r, budget_s=0.0)
  assert spent(["a", "b"]) == [None, None]


def _run_and_compare(m, r, launches):
  """Runs the measurer's ``launches`` interpreted and checks its outputs
  against the IR evaluator on the measurer's inputs."""
  for o in m.outs:
    o.fill_(float("nan"))
  with launch.interpret_env(True):
    for f, grid, args, kw in launches:
      kw = {n: v for n, v in kw.items() if n not in ("num_warps", "num_stages")}
      f[grid](*args, **kw)
  got = [launch._from_torch(o, r.value_map[b.value].dtype) for o, b in zip(m.outs, r.outputs)]
  assert launch.compare(r, got, ir.evaluate(r, m.xs)) <= launch.tolerance(r)


def test_measurer_launches_split_plans_in_one_timed_call():
  """Measured tuning times a split plan's main kernel and combine pass
  together (both launches in the timed call), on buffers that give the
  region's outputs: interpreted here, on CPU tensors."""
  r = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64), split=("n", 3))
  k = generate(r, plan, interpret=True)
  m = launch._TorchMeasurer(r, seed=3, device="cpu")
  launches = m._launches(k)[0]
  assert [f for f, *_ in launches] == [k.fn, k.combine_fn]
  _run_and_compare(m, r, launches)


def test_measurer_rotates_input_copies_past_the_l2():
  """Timed launches cycle through enough input copies to hold twice the L2
  (small inputs: up to the copy cap; large: one set), and a launch on a
  copy computes the same outputs; a split plan's sets share one scratch."""
  l2 = launch.ROTATE_L2_BYTES
  assert launch.rotation_copies(2 * l2) == 1
  assert launch.rotation_copies(l2 // 2) == 4
  assert launch.rotation_copies(1000) == launch.ROTATE_MAX_COPIES
  assert launch.rotation_copies(40 * 2**20) == 3         # 120 MB >= 2 x 50 MB
  r = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64), split=("n", 3))
  k = generate(r, plan, interpret=True)
  m = launch._TorchMeasurer(r, seed=3, device="cpu")
  copy = [t.clone() for t in m.ins]
  first, second = m._launches(k, [m.ins, copy])
  assert second[0][2][0] is copy[0] and first[0][2][0] is m.ins[0]
  n = len(m.ins)
  assert all(a is b for a, b in zip(first[0][2][n:], second[0][2][n:]))   # shared scratch
  _run_and_compare(m, r, second)


def test_compare_tensors_matches_the_numpy_compare():
  """The measurer's self-check compares on the tensors' own device; it reads
  what ``compare`` reads: the worst error over the reference's largest
  finite value, inf for NaNs in different places, a shape mismatch or an
  infinity the reference does not have."""
  torch = pytest.importorskip("torch")
  r = T.gemm_chain(M=8, N=8, K=8, H=8)
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((6, 5)).astype(np.float32)
  ref[1, 2] = np.nan
  out = (ref + rng.standard_normal(ref.shape).astype(np.float32) * 1e-2).astype(np.float16)
  t = lambda a: torch.from_numpy(np.asarray(a))
  want = launch.compare(r, [out], [ref])
  assert 1e-3 < want < 1e-1
  assert abs(launch.compare_tensors([t(out)], [t(ref)]) - want) <= 1e-6 * max(want, 1)
  moved = out.copy()
  moved[1, 2], moved[0, 0] = 0.0, np.nan
  assert launch.compare_tensors([t(moved)], [t(ref)]) == float("inf")
  assert launch.compare_tensors([t(out[:3])], [t(ref)]) == float("inf")
  inf_ref = ref.copy()
  inf_ref[0, 0] = np.inf
  for got, err in ((inf_ref, 0.0), (-inf_ref, float("inf")),      # same / opposite infinity
                   (np.where(np.arange(30).reshape(6, 5) == 8, 9.0, inf_ref), None)):
    e_np = launch.compare(r, [got], [inf_ref])
    e_t = launch.compare_tensors([t(got.astype(np.float32))], [t(inf_ref)])
    if err is None:   # one wrong finite value: the inf does not scale it away
      assert e_np > 1.0 and abs(e_t - e_np) <= 1e-6 * e_np
    else:
      assert e_np == err and e_t == err


def test_self_check_error_allows_rounding_outliers_not_wrong_values():
  """A float16 output a few ulps away from its reference at a few of many
  elements passes (a correct large attention read 2.15e-3 elementwise,
  H100 2026-11-22); one wrong element, or a small error everywhere, fails."""
  r = T.gemm_chain(M=8, N=8, K=8, H=8)
  tol = 2e-3
  rng = np.random.default_rng(1)
  ref = (rng.standard_normal(1 << 16) * 0.1).astype(np.float16).astype(np.float32)
  top = int(np.abs(ref).argmax())
  ulp = np.spacing(np.float16(abs(ref[top])))
  rounded = ref.copy()
  rounded[top] += 4 * np.float32(ulp) * np.sign(ref[top])
  rounded[:50] = np.nextafter(ref[:50].astype(np.float16), np.float16(9)).astype(np.float32)
  assert launch.compare(r, [rounded], [ref]) <= tol
  assert np.abs(rounded - ref).max() / np.abs(ref).max() > tol   # the old, elementwise reading
  one_wrong = ref.copy()
  one_wrong[7] = ref[7] + 0.1 * abs(ref[top])
  assert launch.compare(r, [one_wrong], [ref]) > tol
  biased = ref * (1 + 4 * tol)
  assert launch.compare(r, [biased], [ref]) > tol


def test_measurer_self_check_rejects_a_wrong_reference_match(monkeypatch):
  """check_and_time checks each new kernel against the region's reference
  before timing it: outputs that miss it raise, and the failure is
  remembered for that plan."""
  monkeypatch.setattr(launch, "_kernels", {})   # no checked kernels from other tests
  r = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64))
  k = generate(r, plan, interpret=True)
  m = launch._TorchMeasurer(r, seed=3, device="cpu")
  right = ir.evaluate(r, m.xs)
  monkeypatch.setattr(launch, "_device_reference",
                      lambda region, seed, xs=None, **kw: [o + 1.0 for o in right])
  with launch.interpret_env(True), pytest.raises(launch.CodegenError, match="self-check"):
    m.check_and_time(k, reps=3)
  assert isinstance(launch._kernels[(r.signature(), str(k.plan), "triton")],
                    launch.CodegenError)


def _peaked_training_regions(c: float, t: int = 128, d: int = 32):
  """The regions of an attention training step whose logits have standard
  deviation ``c`` (a float32 softmax of float16 scores, as autodiff of a
  mixed-precision model gives)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top

  def loss(q, k, v, g):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (c / math.sqrt(d))
    p = jax.nn.softmax(s.astype(jnp.float32), -1).astype(q.dtype)
    return jnp.sum(jnp.einsum("bhqk,bhkd->bhqd", p, v).astype(jnp.float32) * g)
  S = lambda dt: jax.ShapeDtypeStruct((1, 2, t, d), dt)
  step = jax.value_and_grad(loss, argnums=(0, 1, 2))
  return [cap.region for cap in capture.find_regions(jax.make_jaxpr(step)(
      S(jnp.float16), S(jnp.float16), S(jnp.float16), S(jnp.float32)))]


def test_row_max_inputs_lie_at_the_largest_scores():
  """A backward's random row max (the forward's, subtracted before exp) is
  drawn at least as large as the typical largest score of its row: with
  logits of standard deviation 8, the old offset of 3 put exp(s - m) past
  float16's range in the reference, which then compared infinities."""
  back = [r for r in _peaked_training_regions(8.0) if launch._row_statistics(r)]
  assert back
  for r in back:
    stats = launch._row_statistics(r)
    # std 8 over 128 keys: 8 * (sqrt(2 ln 128) + 1) = 32.9
    assert max(stats.values()) == pytest.approx(8 * (math.sqrt(2 * math.log(128)) + 1), rel=1e-3)
    for out in ir.evaluate(r, launch.random_inputs(r, launch.MEASURE_SEED), precision="native"):
      assert np.isfinite(out).all()
  # Unit logits keep the old offset's floor.
  for r in _peaked_training_regions(1.0, t=16):
    assert set(launch._row_statistics(r).values()) <= {1.0, 3.0}


def test_self_check_passes_peaked_attention_by_its_error_from_the_exact_result(monkeypatch):
  """Past ``EXACT_RECHECK_MAX_FLOPS`` (and on the GPU, at any size) a kernel
  outside tolerance of the rounded reference is checked again against the
  region in float32 without rounding. Under peaked attention the rounded
  reference is the one far from the exact result (it rounds the scores to
  float16; the kernels keep them in float32): every kernel of an H100
  training step at logit std 4 fell back before. A wrong kernel still
  fails, in the self-check and in measured tuning's check."""
  monkeypatch.setattr(launch, "EXACT_RECHECK_MAX_FLOPS", 0)
  monkeypatch.setattr(launch, "_kernels", {})
  missed = 0
  for r in _peaked_training_regions(8.0):
    k = generate(r, plan_region(r, "h100", use_cache=False).best, interpret=True)
    xs = launch.shared_inputs(r, launch.MEASURE_SEED)
    outs = launch.run_interpreted(k, xs)
    native = ir.evaluate(r, xs, precision="native")
    exact = ir.evaluate(r, xs, precision="float64")
    tol = launch.tolerance(r)
    assert launch.compare(r, outs, exact) < tol / 2
    missed += launch.compare(r, outs, native) > tol      # the case this is for
    launch.self_check(k, launch.run_interpreted)
    wrong = lambda kern, inputs: [o * 1.02 for o in launch.run_interpreted(kern, inputs)]
    with pytest.raises(launch.CodegenError, match="against float32 unrounded"):
      launch.self_check(k, wrong)
    m = launch._TorchMeasurer(r, launch.MEASURE_SEED, device="cpu")
    with launch.interpret_env(True):
      assert m.check_and_time(k, reps=1) > 0
  assert missed


def test_measurer_stops_waiting_for_the_reference_at_the_deadline(monkeypatch):
  """A reference still being computed when the budget ends makes the
  measurement read 'budget spent' instead of overrunning the budget."""
  import threading
  import time
  monkeypatch.setattr(launch, "_kernels", {})
  r = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64))
  k = generate(r, plan, interpret=True)
  release = threading.Event()
  monkeypatch.setattr(launch, "_reference_on_gpu",
                      lambda region, xs, **kw: release.wait(30) and ir.evaluate(region, xs))
  launch._last_reference.clear()
  try:
    launch.start_reference(r, 3)            # in the background, blocked
    m = launch._TorchMeasurer(r, seed=3, device="cpu")
    t0 = time.perf_counter()
    with launch.interpret_env(True), pytest.raises(launch._BudgetSpent):
      m.check_and_time(k, reps=3, deadline=t0 + 0.3)
    assert time.perf_counter() - t0 < 5.0 and m.ref_s > 0
  finally:
    release.set()
  # Once it is there, the same kernel passes its check (and is timed: on the
  # CPU by the wall clock).
  assert 0 < m.check_and_time(k, reps=3) < 30
  launch._last_reference.clear()


def _distinct_plans(r, n):
  """``n`` plans of ``r`` whose kernels are distinct modules."""
  plans, paths = [], set()
  for p in plan_region(r, "h100", use_cache=False).ranked:
    path = generate(r, p, interpret=False).module_path
    if path not in paths:
      paths.add(path)
      plans.append(p)
    if len(plans) == n:
      return plans
  raise AssertionError(f"fewer than {n} distinct kernels")


def test_measurer_streams_each_kernel_as_it_compiles_and_drops_late_ones(monkeypatch):
  """``compiled`` hands on each kernel when its compile is done (not when
  the batch's is); a compile the workers gave up on at the deadline, or
  still running after it, makes its plan read 'budget spent'; a worker's
  failure is compiled in this process; a load failure is that plan's
  error."""
  import concurrent.futures
  import threading
  import time
  from jaxfuse.runtime import compile_pool
  monkeypatch.setattr(launch, "_kernels", {})
  r = examples.gemm_chain(1, 64, 64, 32, 48)
  plans = _distinct_plans(r, 5)
  m = launch._TorchMeasurer(r, seed=3, device="cpu")
  futs = [concurrent.futures.Future() for _ in plans]
  outcomes = {0: (0.3, None), 1: (0.4, compile_pool.CompileTimeout("late")),
              2: (0.1, RuntimeError("worker broke")), 4: (0.2, None)}   # 3: never done
  for i, (after, result) in outcomes.items():
    threading.Timer(after, futs[i].set_result, (result,)).start()

  def submit(kernels, t_end):
    return {path: futs[[k.plan for k in kernels.values()].index(plans[i])]
            for i, path in enumerate(kernels)}
  loaded = []

  def load(k):
    if k.plan == plans[4]:
      raise RuntimeError("out of resources")
    loaded.append(plans.index(k.plan))
  monkeypatch.setattr(m, "_submit", submit)
  monkeypatch.setattr(m, "_load", load)
  why = [None] * len(plans)
  t0 = time.perf_counter()
  got = [i for i, _ in m.compiled(plans, why, t_end=t0 + 0.8)]
  assert got == [2, 0] == loaded                    # in the order they compiled
  assert why[1] == why[3] == launch._BUDGET_SPENT and m.dropped == 2
  assert "out of resources" in why[4] and why[0] is None and why[2] is None
  assert time.perf_counter() - t0 < 5.0


def test_measurer_counts_each_compile_wait_once(monkeypatch):
  """The 'wait' phase that ``measure_plans`` logs is the time spent waiting
  for compiles, each wait counted once: two compiles abandoned one after
  the other (nothing to load between them) once read the first wait twice
  (a first region logged 'wait 18.24' in a 3.3 s budget, H100, sixty-seventh
  session)."""
  import concurrent.futures
  import threading
  import time
  from jaxfuse.runtime import compile_pool
  monkeypatch.setattr(launch, "_kernels", {})
  r = examples.gemm_chain(1, 64, 64, 32, 48)
  plans = _distinct_plans(r, 3)
  m = launch._TorchMeasurer(r, seed=3, device="cpu")
  futs = [concurrent.futures.Future() for _ in plans]
  for i, after in ((0, 0.2), (1, 0.4)):   # 2: never done
    threading.Timer(after, futs[i].set_result, (compile_pool.CompileTimeout("late"),)).start()
  monkeypatch.setattr(m, "_submit", lambda kernels, t_end: {
      path: futs[[k.plan for k in kernels.values()].index(plans[i])]
      for i, path in enumerate(kernels)})
  monkeypatch.setattr(m, "_load", lambda k: None)
  why = [None] * len(plans)
  t0 = time.perf_counter()
  assert list(m.compiled(plans, why, t_end=t0 + 0.1)) == []
  elapsed = time.perf_counter() - t0
  assert why == [launch._BUDGET_SPENT] * 3 and m.dropped == 3
  # Waited until 0.4 s for the two, then until the deadline's grace ran out.
  assert 1.0 < m.phases["wait"] <= elapsed


def test_measure_plans_stops_at_the_deadline_and_abandons_the_rest(monkeypatch):
  """Past the budget, measure_plans stops taking kernels: the compiles
  still running are abandoned and every plan not measured reads 'budget
  spent' (the model ranks it)."""
  import time
  from jaxfuse.config import config
  state = {"closed": False, "taken": 0}

  class FakeMeasurer:
    phases, ref_s, dropped = {}, 0.0, 0

    def __init__(self, region, seed, device):
      assert device == "cuda"

    def compiled(self, plans, why, t_end):
      try:
        for i in range(len(plans)):
          state["taken"] += 1
          yield i, object()
      finally:
        state["closed"] = True

    def check_and_time(self, k, reps, deadline=None):
      time.sleep(0.3)
      return 1e-6
  monkeypatch.setattr(launch, "_torch_cuda", lambda: True)
  monkeypatch.setattr(launch, "_TorchMeasurer", FakeMeasurer)
  why = []
  with config.override(tune_isolate=False):   # measured here, not in a child
    times = launch.measure_plans(examples.gemm_chain(1, 32, 16, 16, 16), list("abcde"),
                                 budget_s=0.5, errors=why)
  assert times[:2] == [1e-6, 1e-6] and state["closed"] and state["taken"] == 3
  assert why[:2] == [None, None] and why[2:] == [launch._BUDGET_SPENT] * 3
  assert times[2:] == [float("inf")] * 3


def test_reference_reaches_the_measurer_as_float32_tensors():
  """The device reference (jax arrays) becomes float32 torch tensors through
  DLPack; NumPy references still work."""
  torch = pytest.importorskip("torch")
  import jax.numpy as jnp
  x = jnp.arange(6, dtype=jnp.float16).reshape(2, 3)
  for a in (x, np.asarray(x)):
    t = launch._float_tensor(a, "cpu")
    assert t.dtype == torch.float32 and t.shape == (2, 3)
    np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_make_measure_skips_a_batch_the_budget_cannot_finish(monkeypatch):
  """A batch is not started when the last batch's time, scaled to this
  batch's size (at least half of it), exceeds what is left of the budget."""
  from jaxfuse.planner import examples
  r = examples.gemm_chain(1, 32, 16, 16, 16)
  clock = [100.0]
  monkeypatch.setattr(launch.time, "perf_counter", lambda: clock[0])
  calls = []

  def fake(region, plans, *, budget_s=None, reps=20, errors=None):
    calls.append(len(plans))
    clock[0] += 3.0                      # this batch took 3 s
    errors.extend([None] * len(plans))
    return [1e-6] * len(plans)
  monkeypatch.setattr(launch, "measure_plans", fake)
  m = launch.make_measure(r, budget_s=4.0)
  assert m(list("abcdefgh")) == [1e-6] * 8
  # 1 s left; 2 plans at 3 s per 8, but at least half a batch: 1.5 s.
  assert m(list("ab")) == [None, None] and calls == [8]
  m = launch.make_measure(r, budget_s=6.0)
  assert m(list("abcdefgh")) == [1e-6] * 8
  assert m(list("ab")) == [1e-6] * 2 and calls == [8, 8, 2]   # 3 s left


def _causal_attention(q, k, v):
  import jax.numpy as jnp
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.125
  m, n = s.shape[-2:]
  keep = jax.lax.broadcasted_iota(jnp.int32, (m, n), 0) >= jax.lax.broadcasted_iota(jnp.int32, (m, n), 1)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), v)


def test_measuring_programs_fold_no_constants():
  """The keep-or-drop timing and the device reference trace their programs
  outside jax.ensure_compile_time_eval. Inside it, a causal mask's iotas and
  their broadcast to the scores' shape became constants of the program
  (12.9 GB for a large causal attention on the H100)."""
  import warnings
  import jax.numpy as jnp
  from jaxfuse import capture
  if "jax_captured_constants_warn_bytes" not in jax.config.values:
    pytest.skip("this jax does not report captured constants")
  x = jnp.zeros((1, 2, 256, 32), jnp.float16)
  (cap,) = capture.find_regions(jax.make_jaxpr(_causal_attention)(x, x, x))
  r = cap.region
  old = jax.config.values["jax_captured_constants_warn_bytes"]
  jax.config.update("jax_captured_constants_warn_bytes", 32 * 1024)  # the scores: 256 KB
  got = []

  def lowering(y):   # they run while jaxfuse's region is lowered: inside a trace
    got.append(launch._per_call_times([_causal_attention], r, lo=1, hi=2, reps=1)[0][0])
    got.extend(launch._reference_on_gpu(r, launch.random_inputs(r, 3)))
    return y + 1
  try:
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      jax.jit(lowering)(1.0)
  finally:
    jax.config.update("jax_captured_constants_warn_bytes", old)
  assert not [w for w in seen if "constants were captured" in str(w.message)]
  t, ref = got
  assert np.isfinite(t)   # a time on a busy CPU, not checked against anything
  xs = launch.random_inputs(r, 3)
  want = _causal_attention(*[jnp.asarray(a, jnp.float32) for a in xs])
  assert launch.compare(r, [np.asarray(ref)], [np.asarray(want)]) <= launch.tolerance(r)


@pytest.mark.parametrize("cmp", ["ge", "gt", "le", "lt"])
@pytest.mark.parametrize("M,N,tm,tn,split", [(64, 64, 16, 16, None), (48, 80, 16, 32, None),
                                             (80, 48, 32, 16, None), (40, 40, 1, 16, None),
                                             (96, 64, 32, 64, None), (64, 96, 16, 16, 2)])
def test_triangular_mask_loops_print_whole_tiles_without_the_mask(cmp, M, N, tm, tn, split):
  """Tiles of the key loop on which the mask ``cmp(iota(m), iota(n))`` is all
  true run without the compare and select; the tiles it hides are skipped;
  the longest programs are issued first. Checked against the float64
  evaluator, rows the mask hides whole included."""
  r = T.attention(M=M, N=N, D=16, causal=cmp)
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=tm, n=tn),
                       split=("n", split) if split else None)
  k = generate(r, plan, interpret=True)
  src = k.source
  whole, edge = src.index("# tiles the mask keeps whole"), src.index("# tiles on the mask's edge")
  loop = src[whole:edge] if whole < edge else src[whole:src.index("\n  O = ")]
  assert "tl.where(tri" not in loop and "tl.where(tri" in src[edge:], src
  # keys up to the query (m >= n, m > n): later query blocks run longer and start first
  assert (f"pid_m = {-(-M // tm) - 1} - tl.program_id(0)" in src) == (cmp in ("ge", "gt"))
  xs = launch.random_inputs(r, seed=M + N)
  err = launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs))
  assert err <= launch.tolerance(r), (err, k.source)


def test_causal_loops_of_one_wave_stay_one_loop():
  """A plan the model runs in one wave of programs (latency-bound) keeps its
  one masked loop; from ``WHOLE_TILES_MIN_WAVES`` waves on it is split."""
  import dataclasses
  from jaxfuse.codegen import triton_printer
  from jaxfuse.planner.plan import Prediction
  r = T.attention(M=256, N=256, D=16, causal=True)
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16))
  for waves in (1, triton_printer.WHOLE_TILES_MIN_WAVES):
    pred = Prediction(time_s=1e-5, t_mem_s=0.0, t_comp_s=0.0, alpha=1.0, bytes_moved=0, flops=0,
                      smem_bytes=0, programs=16, waves=waves)
    k = generate(r, dataclasses.replace(plan, predicted=pred), interpret=True)
    split = waves >= triton_printer.WHOLE_TILES_MIN_WAVES
    assert ("# tiles the mask keeps whole" in k.source) == split
    assert k.source.count("for start_n in range(") == (2 if split else 1)
    xs = launch.random_inputs(r, seed=waves)
    assert launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs)) <= launch.tolerance(r)


def test_self_check_tolerance_follows_the_float32_dot_precision():
  g32 = examples.gemm_chain(1, 64, 64, 64, 64, dtype="float32")
  assert launch.tolerance(g32) == pytest.approx(2e-3)             # TF32 operands
  assert launch.tolerance(T.with_precision(g32, "tf32x3")) == pytest.approx(1e-4)
  assert launch.tolerance(T.with_precision(g32, "ieee")) == pytest.approx(1e-5)
  g16 = examples.gemm_chain(1, 64, 64, 64, 64)
  assert launch.tolerance(g16) == launch.tolerance(T.with_precision(g16, "ieee")) == 2e-3


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention_runs_through_the_kernel(causal, caplog):
  """``jax.nn.dot_product_attention`` with 2 key/value heads for 8 query
  heads: the kernel (Triton's interpreter) reads each program's query head
  at a tile of one and matches jax.jit, with and without the causal mask."""
  import logging  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import tiling  # pylint: disable=g-import-not-at-top

  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 48, 8, 32)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 48, 2, 32)), jnp.float32) for _ in range(2))
  [cap] = capture.find_regions(jax.make_jaxpr(attend)(q, k, v))
  [group] = tiling.scalar_dot_loops(cap.region)
  best = plan_region(cap.region, "h100", use_cache=False).best
  assert best.tile(group) == 1
  with config.override(backend="interpret"), caplog.at_level(logging.WARNING):
    got = jaxfuse.jit(attend)(q, k, v)
  assert not [r for r in caplog.records if "original ops" in r.getMessage()]
  want = jax.jit(attend)(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def _grouped_causal_head_major(q, k, v):
  """Grouped-query causal attention on [B, heads, T, D] (the benchmarks'
  head-major layout): query heads h*g..h*g+g-1 read key/value head h."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  b, n, t, d = q.shape
  qg = q.reshape(b, k.shape[1], n // k.shape[1], t, d)
  s = jnp.einsum("bkgqd,bksd->bkgqs", qg, k) * 0.25
  s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -jnp.inf)
  o = jnp.einsum("bkgqs,bksd->bkgqd", jax.nn.softmax(s, -1), v)
  return o.reshape(b, n, t, d)


@pytest.mark.parametrize("layout", ["head-major", "token-major"])
def test_causal_query_heads_that_share_keys_run_together_longest_first(layout):
  """Under a causal mask, the query heads that read one key/value head
  are issued together, all of their longest query tiles first (chunked
  longest-first order): in the head-major layout each head's query tiles
  had run one head after another, and MQA/GQA kernels ran 6-14% slower on
  the H100. Every program runs once; the kernel matches the IR's evaluator
  (Triton's interpreter)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import tiling  # pylint: disable=g-import-not-at-top

  if layout == "head-major":
    fn, shapes = _grouped_causal_head_major, [(2, 8, 64, 32), (2, 2, 64, 32), (2, 2, 64, 32)]
  else:
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    shapes = [(2, 64, 8, 32), (2, 64, 2, 32), (2, 64, 2, 32)]
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(*args))
  r = cap.region
  [group] = tiling.scalar_dot_loops(r)
  [(keys, band)] = tiling.masked_tile_relations(r).items()
  grid = tuple(l.name for l in r.loops if l.name not in (keys, "k", "h"))
  plan = T.simple_plan(r, grid, [(keys, [])], {**{l: 1 for l in grid}, band.other: 16, keys: 16})
  kern = generate(r, plan, interpret=True)
  order = T.issue_order(kern.source, kern.grid)
  heavy, member = f"pid_{band.other}", f"pid_{group}"
  assert len({tuple(sorted(p.items())) for p in order}) == len(order) == math.prod(kern.grid)
  # The programs of one key/value head: contiguous in issue order, each
  # query tile of all its query heads before the next shorter one.
  runs: dict = {}
  for i, p in enumerate(order):
    runs.setdefault(tuple(sorted((n, x) for n, x in p.items() if n not in (heavy, member))),
                    []).append(i)
  assert len(runs) == 2 * 2
  for idx in runs.values():
    assert idx == list(range(idx[0], idx[0] + 4 * (64 // 16)))
    assert [order[i][heavy] for i in idx] == [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4
    assert {order[i][member] for i in idx[:4]} == set(range(4))
  xs = launch.random_inputs(r, seed=3)
  err = launch.compare(r, launch.run_interpreted(kern, xs), ir.evaluate(r, xs))
  assert err <= launch.tolerance(r), err


def test_dot_of_two_loaded_operands_yields_its_result_in_the_order_read():
  """jax traces the grouped-query einsum ``bqkgd,bskd->bkgqs`` as K.Q^T: the
  IR's first operand is k. tl.dot gets q first instead, so the score tile
  comes out as [queries, keys] with no transpose per key step (printed as
  ``tl.trans(tl.dot(k, q^T))``, multi-query attention ran 8.7x slower than
  cuDNN on the H100); the result is unchanged (Triton's interpreter)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen.triton_printer import print_kernel  # pylint: disable=g-import-not-at-top

  def grouped(q, k, v):
    b, t, n, d = q.shape
    qg = q.reshape(b, t, k.shape[2], n // k.shape[2], d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k) * 0.25
    o = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(s, -1), v)
    return o.reshape(b, t, n, d)

  q = jax.ShapeDtypeStruct((2, 64, 8, 32), np.float32)
  kv = jax.ShapeDtypeStruct((2, 64, 2, 32), np.float32)
  [cap] = capture.find_regions(jax.make_jaxpr(grouped)(q, kv, kv))
  r = cap.region
  qk = r.contractions[0]
  shapes = {b.value: b.shape for b in r.inputs}
  assert shapes[qk.lhs] == (2, 64, 2, 32) and shapes[qk.rhs] == (2, 64, 8, 32)  # K.Q^T
  best = plan_region(r, "h100", use_cache=False).best
  src = print_kernel(r, best).source
  assert "tl.trans(tl.dot(" not in src, src
  k = generate(r, best, interpret=True)
  xs = launch.random_inputs(r, seed=2)
  assert launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs)) <= launch.tolerance(r)


def test_wide_transposed_dot_operands_are_loaded_in_the_dots_order():
  """A training step's stacked q/k/v weight gradients (``g[p]^T x`` over 512
  tokens, BERT-Base's ``plm,ln->pmn`` at batch 1): the model's pick holds the whole
  512-token reduction in one tile at 64 x 128 outputs. Printed with x's
  [n, l] tile (region order) fed to ``tl.dot(g, tl.trans(x))``, Triton 3.6
  miscompiled it on the H100 (relative error 1.0; the self-check dropped the
  plan). A loaded operand in that corner (``TRANSPOSED_OPERAND_MIN_RED``) is
  loaded in the order the dot reads it, on either side of the dot; the
  interpreter runs both prints correctly, so the print is what is checked,
  then the result."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner.plan import parse_plan  # pylint: disable=g-import-not-at-top

  def weight_grads(x, g0, g1):
    return tuple(jnp.einsum("bsi,bsj->ij", g, x) for g in (g0, g1))

  x = jax.ShapeDtypeStruct((1, 512, 128), np.float16)
  g = jax.ShapeDtypeStruct((1, 512, 64), np.float16)
  [cap] = capture.find_regions(jax.make_jaxpr(weight_grads)(x, g, g))
  r = ir.simplify(cap.region)
  # (The batch of one is no loop: ir.drop_unit_loops.)
  assert r.einsum_summary() == "plm,ln->pmn" and r.part_loop == "p"
  picked = "grid(p,m,n) (Lx0,Lx1,Cc0,Sc0)  tiles(p=1, m=64, n=128, l=512)  warps=4 stages=3"
  # The left operand transposed: l before m in the region's order, 128 rows.
  ext = dict(l=512, m=128, n=64)
  left = ir.Region(tuple(ir.Loop(l, e) for l, e in ext.items()),
                   (ir.Value("a", ("l", "m"), "float16"), ir.Value("b", ("l", "n"), "float16"),
                    ir.Value("c", ("m", "n"), "float16")),
                   (ir.Buffer("a", (512, 128), (("l", 128), ("m", 1))),
                    ir.Buffer("b", (512, 64), (("l", 64), ("n", 1)))),
                   (ir.Buffer("c", (128, 64), (("m", 64), ("n", 1))),),
                   (ir.Contraction("c", "a", "b", ("l",)),))
  for region, text, dot in (
      (r, picked, "tl.dot(x0, x1)"),
      (left, "grid(m,n) (La,Lb,Cc,Sc)  tiles(l=512, m=128, n=64)  warps=4 stages=3", "tl.dot(a, b)")):
    k = generate(region, parse_plan(text, [l.name for l in region.loops]), interpret=True)
    assert dot in k.source and "tl.trans(" not in k.source, k.source
    xs = launch.random_inputs(region, seed=5)
    err = launch.compare(region, launch.run_interpreted(k, xs), ir.evaluate(region, xs))
    assert err <= launch.tolerance(region), (text, err)


def test_windows_of_an_input_run_in_place_through_the_kernel(caplog):
  """jnp.split / basic slicing of an input: the kernel (Triton's interpreter)
  reads the windows at their offsets in the whole array, and matches jax.jit."""
  import logging  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top

  def packed(qkv):
    q, k, v = jnp.split(qkv, 3, axis=-1)
    b, t, _ = q.shape
    q, k, v = (x.reshape(b, t, 2, 16).transpose(0, 2, 1, 3) for x in (q, k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

  def windowed(x, w1, w2):
    return (x[:, 8:40, 16:48] @ w1) @ w2

  rng = np.random.default_rng(3)
  cases = [(packed, (rng.standard_normal((2, 32, 96)),)),
           (windowed, (rng.standard_normal((2, 48, 64)), rng.standard_normal((32, 16)) / 6,
                       rng.standard_normal((16, 16)) / 4))]
  for fn, args in cases:
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)
    prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(fn)(*args).jaxpr.eqns]
    assert prims == ["jaxfuse_region"], prims   # no slice or split left to XLA
    with config.override(backend="interpret"), caplog.at_level(logging.WARNING):
      got = jaxfuse.jit(fn)(*args)
    assert not [r for r in caplog.records if "original ops" in r.getMessage()]
    want = jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def test_windows_at_other_offsets_share_one_kernel_launched_at_their_own_offsets(caplog):
  """Chains over the layers of stacked arrays (``x[i]``) and over two halves
  of one array: same shapes, different offsets. A window's offset is a
  launch argument, so each group shares one signature and one kernel; each
  region must still read its own window (a kernel launched at another
  region's offsets gives the wrong layer). An offset that is not a multiple
  of ``WINDOW_ALIGN`` changes the pointer's alignment, so it keys its own
  kernel."""
  import logging  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top

  def layers(x, w1, w2):
    return [(x[i] @ w1[i]) @ w2[i] for i in range(3)]

  def halves(x, w1, w2):
    # offsets 0, 32*32 and 8: the last one's residue differs
    return (x[:, :32] @ w1) @ w2, (x[:, 32:] @ w1) @ w2, (x[:, :, 8:24] @ w1[:16]) @ w2

  rng = np.random.default_rng(5)
  f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  cases = [(layers, (f32(3, 64, 32), f32(3, 32, 16) / 6, f32(3, 16, 16) / 4), 1),
           (halves, (f32(2, 64, 32), f32(32, 16) / 6, f32(16, 16) / 4), 3)]
  for fn, args, groups in cases:
    caps = capture.find_regions(jax.make_jaxpr(fn)(*args))
    assert len(caps) == 3
    offsets = {c.region.launch_offsets() for c in caps}
    assert len(offsets) == 3, offsets          # every region reads its own windows
    sigs = {c.region.signature() for c in caps}
    assert len(sigs) == (1 if groups == 1 else 2), sigs
    with config.override(backend="interpret"), caplog.at_level(logging.WARNING):
      got = jaxfuse.jit(fn)(*args)
    assert not [r for r in caplog.records if "original ops" in r.getMessage()]
    for sig in sigs:   # one kernel per signature, whatever the offsets
      assert len([k for k in launch._chosen if k[0] == sig and k[1] == "interpret"]) == 1
    for g, w in zip(got, jax.jit(fn)(*args)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-3, atol=2e-3)


def test_window_offsets_are_launch_arguments_of_the_printed_kernel():
  """The printed kernel takes each window's offset as an unspecialized int
  and prints only the part below ``WINDOW_ALIGN``; the region's text shows
  the whole offset, its signature only that part."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture, codegen  # pylint: disable=g-import-not-at-top

  def f(x, w1, w2):
    return (x[:, 1:33, 8:24] @ w1) @ w2

  args = (jnp.zeros((2, 40, 32), jnp.float16), jnp.zeros((16, 16), jnp.float16),
          jnp.zeros((16, 16), jnp.float16))
  (cap,) = capture.find_regions(jax.make_jaxpr(f)(*args))
  r = cap.region
  (xb,) = [b for b in r.inputs if b.window]
  assert xb.offset == 32 + 8 and xb.launch_offset == 32 and xb.static_offset == 8
  assert r.launch_offsets() == (32,)
  assert "window(offset 40)" in r.to_text()
  assert "window(offset 16*i+8)" in r.to_text(offsets=False)
  moved = ir.Region(r.loops, r.values, (dataclasses.replace(xb, offset=8 + 16 * 7),)
                    + r.inputs[1:], r.outputs, r.ops, name=r.name)
  assert moved.signature() == r.signature()
  assert ir.Region(r.loops, r.values, (dataclasses.replace(xb, offset=9),) + r.inputs[1:],
                   r.outputs, r.ops, name=r.name).signature() != r.signature()
  best = plan_region(r, "h100", use_cache=False).best
  src = codegen.source(r, best)
  assert src == codegen.source(moved, best)
  name = xb.value
  assert f"do_not_specialize=['{name}_off']" in src
  assert f"{name}_ptr = {name}_ptr + ({name}_off // 16) * 16" in src
  assert f"tl.load({name}_ptr + 8 + " in src   # the static part stays in the address


def _ffn(x, w1, b1, w2, b2):
  return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2


def _ffn_args(m=32, d=32, f=64, dtype="float16"):
  rng = np.random.default_rng(11)
  shapes = [(m, d), (d, f), (f,), (f, d), (d,)]
  scales = [1.0, d ** -0.5, 0.1, f ** -0.5, 0.1]
  return tuple(jax.numpy.asarray(rng.standard_normal(s) * c, dtype) for s, c in zip(shapes, scales))


def test_gemm_gelu_runs_one_kernel_in_the_interpreter(caplog):
  """A single contraction with a GELU epilogue (a region because XLA runs the
  GELU apart) runs as one kernel and matches a float32 reference."""
  import logging  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top

  fn = lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=False)
  x, w, b = _ffn_args()[:3]
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(x, w, b))
  with config.override(backend="interpret"), caplog.at_level(logging.WARNING):
    got = jaxfuse.jit(fn)(x, w, b)
  assert not [r for r in caplog.records if "original ops" in r.getMessage()]
  assert launch.outcome(cap.region, "interpret").fused
  want = fn(*(a.astype("float32") for a in (x, w, b)))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_chain_left_to_xla_lowers_its_parts(monkeypatch, caplog):
  """A chain decided against (LeftToXLA) is captured again with fewer
  contractions and its GEMM-GELU part is lowered as a region; so is a chain
  whose kernel failed (no plan worked): a part may still have one."""
  import logging  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import primitive  # pylint: disable=g-import-not-at-top

  args = _ffn_args()
  want = jax.jit(_ffn)(*args)
  real = launch.fused_call
  for error in (launch.LeftToXLA("test: the chain is left to XLA"), RuntimeError("test: boom")):
    seen = []

    def fused_call(region, xs, error=error, seen=seen, **kw):
      seen.append(len(region.contractions))
      if len(region.contractions) > 1:
        raise error
      return real(region, xs, **kw)

    monkeypatch.setattr(launch, "fused_call", fused_call)
    primitive._warned.clear()
    with config.override(backend="interpret"), caplog.at_level(logging.INFO):
      got = jax.jit(jaxfuse.fuse(_ffn))(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
    if isinstance(error, launch.LeftToXLA):
      assert seen == [2, 1]
      # Lowered again (another program holding the same chain): one log line.
      with config.override(backend="interpret"), caplog.at_level(logging.INFO):
        jax.jit(jaxfuse.fuse(lambda *a: _ffn(*a)))(*args)
      assert seen == [2, 1, 2, 1]
      assert sum("lowers as 1 part(s)" in r.getMessage() for r in caplog.records) == 1
    else:
      assert seen == [2, 1]
  primitive._warned.clear()


def test_keep_or_drop_times_a_chain_against_the_fallback_it_would_run(monkeypatch):
  """A chain's keep-or-drop timing runs against what replaces a dropped
  chain: its GEMM-GELU part fused plus XLA's GEMM, not XLA's plain ops.
  The fallback handed to ``fused_call`` evaluates like the chain and holds
  the part as a region; attention, whose parts capture nothing, is timed
  against XLA's ops as before."""
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import primitive  # pylint: disable=g-import-not-at-top

  def attn(q, k, v):
    return jax.nn.softmax((q @ k.T) * 0.125, axis=-1) @ v

  rng = np.random.default_rng(3)
  qkv = tuple(jax.numpy.asarray(rng.standard_normal((32, 16)), "float16") for _ in range(3))
  real = launch.fused_call
  for fn, args, want_parts in ((_ffn, _ffn_args(), 1), (attn, qkv, 0)):
    seen = []

    def fused_call(region, xs, seen=seen, **kw):
      if len(region.contractions) > 1:
        seen.append((region, kw["original"], kw["original_parts"]))
      return real(region, xs, **kw)

    monkeypatch.setattr(launch, "fused_call", fused_call)
    with config.override(backend="interpret"):
      jax.jit(jaxfuse.fuse(fn))(*args)
    [(region, original, parts)] = seen
    assert parts == want_parts
    xs = launch.random_inputs(region, seed=1)     # the region's inputs, in its order
    assert primitive.count_regions(jax.make_jaxpr(original)(*xs)) == want_parts
    assert launch.compare(region, [np.asarray(o) for o in jax.jit(original)(*xs)],
                          ir.evaluate(region, xs)) <= launch.tolerance(region)


def test_keep_or_drop_against_the_fallback_names_it_and_keys_it_apart(tmp_path, monkeypatch):
  """Timed against a fallback with a part fused, the verdict and the
  recorded outcome name that fallback, and the timing is stored under its
  own key (a timing against XLA's plain ops is not reused for it)."""
  from jaxfuse.codegen import CodegenError  # pylint: disable=g-import-not-at-top
  K, timed = _timed_kernel(tmp_path, monkeypatch, ["NVIDIA H100 80GB HBM3"])
  r = K.region
  assert launch._timing_key(K(), 1) not in (None, launch._timing_key(K()))
  assert launch._timing_key(K(), 1) != launch._timing_key(K(), 2)
  try:
    for parts, name in ((0, "XLA"), (1, "XLA with 1 part fused"), (2, "XLA with 2 parts fused")):
      launch._xla_decisions.clear()
      with pytest.raises(CodegenError, match=f"measured slower than {name}: fused 6.0 us vs 5.0 us"):
        launch._keep_fused(K(), lambda *a: a, parts=parts)
      launch._record_outcome(r, "triton", launch.Outcome(False, reason="r"))
      assert str(launch.outcome(r, "triton")).startswith(
          f"XLA's ops (measured 6.0 us fused vs 5.0 us {name}): r")
    assert len(timed) == 6 and len(os.listdir(tmp_path / "timings")) == 3
  finally:
    launch._xla_decisions.clear()
    launch._outcomes.pop((r.signature(), "triton"), None)


def test_compute_bound_gemm_gelu_is_left_to_the_model_not_the_mbci_rule():
  """BERT-Base's FFN at 512 tokens: the chain is left to XLA, its GEMM-GELU
  part, compute-bound (279 FLOP/B against the H100's ridge of 263), is
  planned and kept: the model prices XLA's separate GELU kernel."""
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.devices import get_device, is_mbci  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)
  closed = jax.make_jaxpr(_ffn)(spec(1, 512, 768), spec(768, 3072), spec(3072), spec(3072, 768),
                                spec(768))
  [chain] = capture.find_regions(closed)
  [part] = capture.find_regions(chain.jaxpr, max_contractions=1)
  h100 = get_device("h100")
  with config.override(tune="auto", device="h100"):
    with pytest.raises(launch.LeftToXLA, match="left to XLA"):
      launch._candidate_plans(chain.region, None, backend="triton")
    plans = launch._candidate_plans(part.region, None, backend="triton")
    # Kept on the model's word (on the H100 12.6 us fused against 20.8 us
    # for XLA's GEMM and two GELU kernels, fifty-eighth session).
    assert not launch.keep_or_drop_timed(part.region, plans)
    assert cost_model.slower_than_unfused(part.region, plans[0], h100) is None
  assert plans and plans[0].predicted is not None
  # A single contraction is fused for its epilogue: no MBCI rule for it.
  gelu = lambda x, w: jax.nn.gelu(x @ w, approximate=False)
  [big] = capture.find_regions(jax.make_jaxpr(gelu)(spec(4096, 4096), spec(4096, 4096)))
  assert not is_mbci(big.region, h100)[0]
  with config.override(tune="model", device="h100"):
    try:
      launch._candidate_plans(big.region, None, backend="triton")
    except launch.LeftToXLA as e:
      assert "memory-bound" not in str(e)
  # XLA's exact-GELU kernels: two, the first writing a float32 intermediate
  # the second reads with the biased result again (their traffic outlasts
  # their instructions); the bias add runs in the GEMM's kernel, one vector
  # op per element.
  cut = ir.xla_epilogue_split(part.region)
  assert cut is not None
  gelu_s = 512 * 3072 * (3 * 2 + 8) / h100.mem_bandwidth_Bps + 2 * h100.min_kernel_s
  bias_s = 512 * 3072 / h100.vector_flops
  r = part.region
  plain = dataclasses.replace(r, ops=r.ops[:1], outputs=(
      dataclasses.replace(r.outputs[0], value=r.ops[0].out),))
  assert cost_model.unfused_time(part.region, h100) == pytest.approx(
      cost_model.unfused_time(plain, h100) + bias_s + gelu_s)


def test_decoding_step_runs_split_across_programs():
  """A decoding step (one query token, 1024 keys, 8 query heads over 2
  key/value heads): the planner splits the key loop across programs, and
  the main and combine kernels (Triton's interpreter) match the IR."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top

  q = jax.ShapeDtypeStruct((1, 1, 8, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 32), jnp.float32)
  [cap] = capture.find_regions(jax.make_jaxpr(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v))(q, kv, kv))
  r = cap.region
  best = plan_region(r, "h100", use_cache=False).best
  assert best.split and r.extent(best.split[0]) == 1024
  k = generate(r, best, interpret=True)
  assert k.combine_fn is not None and "part_" in k.source   # scratch of the parts
  xs = launch.random_inputs(r, seed=4)
  assert launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs)) <= launch.tolerance(r)


# Compiled in a fresh process (the ``fresh_python`` fixture says why): a
# chain kernel and a split plan's main and combine kernels, with the grid
# dependency wait on and off.
_PDL_PTX = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from jaxfuse.codegen import compile as _compile, testing as T
from jaxfuse.codegen.triton_printer import PDL_FLAG, print_kernel
from jaxfuse.runtime import direct_launch as dl
region = T.gemm_chain(M=64, N=128, K=64, H=64, dtype="float16")
plans = [T.simple_plan(region, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64)),
         T.simple_plan(region, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64),
                       split=("n", 2))]
out = []
try:
  for plan in plans:
    pk = print_kernel(region, plan)
    mod, _ = _compile.load_module(pk.source, interpret=False)
    for name, consts in ((pk.kernel_name, pk.constexprs), (pk.combine_name, pk.combine_constexprs)):
      if not name:
        continue
      fn = getattr(mod, name)
      for flag in (0, 1):
        c = {**dict(consts), PDL_FLAG: flag}
        sig = {a: ("constexpr" if a in c else "*fp16" if a.endswith("_ptr") else "*fp32")
               for a in fn.arg_names}
        src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=c)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4}).asm["ptx"]
        out.append([name, flag, dl.waits_before_memory(ptx), "griddepcontrol.wait" in ptx])
except (ImportError, AttributeError, TypeError) as e:   # another Triton's compile API
  print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
print(json.dumps({"kernels": out}))
"""


def test_printed_kernels_wait_on_their_grid_dependency_before_any_memory_access(fresh_python):
  """With ``PDL_FLAG`` set, every printed kernel (a split plan's combine
  pass too) may be started while its predecessor runs: compiled for
  sm_90, its first memory instruction comes after griddepcontrol.wait.
  Without the flag it has no wait at all."""
  pytest.importorskip("triton")
  res = fresh_python(_PDL_PTX)
  if "skip" in res:
    pytest.skip(f"offline compile unavailable: {res['skip']}")
  kernels = res["kernels"]
  main = {k[0] for k in kernels if not k[0].endswith("_combine")}
  assert len(main) == 1 and min(main).startswith("jaxfuse_")
  assert {k[0] for k in kernels} == {min(main), min(main) + "_combine"}
  for name, flag, waits, has_wait in kernels:
    assert (waits, has_wait) == ((True, True) if flag else (False, False)), name


def test_generate_turns_the_grid_dependency_wait_on_only_when_asked_for_the_gpu(monkeypatch):
  from jaxfuse import codegen
  from jaxfuse.codegen import compile as _compile
  from jaxfuse.codegen import testing as T
  from jaxfuse.codegen.triton_printer import PDL_FLAG
  region = T.gemm_chain(M=64, N=128, K=64, H=64, dtype="float16")
  plan = T.simple_plan(region, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64),
                       split=("n", 2))

  def flags(**kw):
    k = codegen.generate(region, plan, **kw)
    return k.constexprs[PDL_FLAG], k.combine_constexprs[PDL_FLAG]

  monkeypatch.setattr(_compile, "grid_dependency_supported", lambda: True)
  assert flags(interpret=True, grid_wait=True) == (0, 0)     # the interpreter lacks it
  assert flags(interpret=False, grid_wait=True) == (1, 1)
  assert flags(interpret=False) == (0, 0)                     # not asked for
  monkeypatch.setattr(_compile, "grid_dependency_supported", lambda: False)
  assert flags(interpret=False, grid_wait=True) == (0, 0)    # no Hopper or no instruction


def test_grid_dependency_is_supported_only_on_hopper_or_newer():
  from jaxfuse.codegen import compile as _compile
  assert not _compile.grid_dependency_supported()   # this CPU-only process has no GPU


def test_kernels_wait_on_their_grid_dependency_exactly_when_launches_are_recorded(monkeypatch):
  # One decision for the kernel and its launch: a kernel carries the wait
  # only where XLA records its launch (and may start it early).
  from jaxfuse.codegen import compile as _compile
  from jaxfuse.config import config
  from jaxfuse.runtime import direct_launch
  monkeypatch.setattr(_compile, "grid_dependency_supported", lambda: True)
  for launch_mode, recorded, want in (("direct", True, True), ("direct", False, False),
                                      ("ffi", True, False)):
    monkeypatch.setattr(direct_launch, "records", lambda r=recorded: r)
    with config.override(launch=launch_mode):
      assert direct_launch.grid_waits() is want, (launch_mode, recorded)
  monkeypatch.setattr(direct_launch, "records", lambda: True)
  monkeypatch.setattr(_compile, "grid_dependency_supported", lambda: False)
  with config.override(launch="direct"):
    assert not direct_launch.grid_waits()


def test_select_kernel_asks_for_the_grid_wait_that_the_launcher_decides(monkeypatch):
  from jaxfuse.codegen import testing as T
  from jaxfuse.runtime import direct_launch, launch
  region = T.gemm_chain(M=64, N=128, K=64, H=64, dtype="float16")
  plan = T.simple_plan(region, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64))
  asked = []

  def fake_generate(r, p, **kw):
    asked.append((kw["interpret"], kw["grid_wait"]))
    raise launch.CodegenError("stop here")

  monkeypatch.setattr(launch, "generate", fake_generate)
  monkeypatch.setattr(direct_launch, "grid_waits", lambda: True)
  monkeypatch.setattr(launch, "_kernels", {})
  for backend in ("triton", "interpret"):
    with pytest.raises(launch.CodegenError):
      launch.select_kernel(region, [plan], backend=backend, check=False)
  assert asked == [(False, True), (True, False)]


def test_one_row_kernels_are_captured_and_do_not_wait_on_their_grid_dependency(monkeypatch):
  """A one-row stream (every contraction a broadcast product) is launched
  as a stream capture, not a kernel node XLA records (it ran up to 1.5x
  slower recorded, on the H100), so it is generated without the
  grid-dependency wait; a GEMM chain's kernel keeps both."""
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.codegen import testing as T
  from jaxfuse.runtime import direct_launch, launch
  [r] = capture.find_regions(jax.make_jaxpr(lambda x, w: x @ w)(
      jnp.ones((1, 256), jnp.float16), jnp.ones((256, 512), jnp.float16)))
  one_row = T.simple_plan(r.region, ("m", "n"), [("k", [])], dict(m=1, n=64, k=64))
  chain = T.gemm_chain(M=64, N=128, K=64, H=64, dtype="float16")
  chain_plan = T.simple_plan(chain, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64))
  assert not launch.recorded_launch(r.region, one_row)
  assert launch.recorded_launch(chain, chain_plan)
  monkeypatch.setattr(direct_launch, "grid_waits", lambda: True)
  assert not launch.grid_wait_pays(r.region, one_row)
  assert launch.grid_wait_pays(chain, chain_plan)
  monkeypatch.setattr(direct_launch, "grid_waits", lambda: False)
  assert not launch.grid_wait_pays(chain, chain_plan)
  asked = []

  def fake_generate(region, p, **kw):
    asked.append(kw["grid_wait"])
    raise launch.CodegenError("stop here")
  monkeypatch.setattr(direct_launch, "grid_waits", lambda: True)
  monkeypatch.setattr(launch, "generate", fake_generate)
  monkeypatch.setattr(launch, "_kernels", {})
  for region, plan in ((r.region, one_row), (chain, chain_plan)):
    with pytest.raises(launch.CodegenError):
      launch.select_kernel(region, [plan], backend="triton", check=False)
  assert asked == [False, True]


def test_triton_launch_asks_for_a_captured_launch_of_one_row_kernels(monkeypatch):
  """The launch of a one-row kernel names the captured direct target."""
  import types
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.codegen import generate
  from jaxfuse.codegen import testing as T
  from jaxfuse.runtime import launch, triton_call
  [r] = capture.find_regions(jax.make_jaxpr(lambda x, w: x @ w)(
      jnp.ones((1, 256), jnp.float16), jnp.ones((256, 512), jnp.float16)))
  k = generate(r.region, T.simple_plan(r.region, ("m", "n"), [("k", [])], dict(m=1, n=64, k=64)),
               interpret=True)
  asked, targets = [], []

  def fake_call(*args, out_shape, custom_call_target_name, **kw):
    targets.append(custom_call_target_name)
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]
  monkeypatch.setattr(triton_call, "jax_triton_module",
                      lambda: types.SimpleNamespace(triton_call=fake_call))
  monkeypatch.setattr(triton_call, "call_target",
                      lambda jt, record=True: asked.append(record) or f"target-{record}")
  launch.triton_launch(k, [jnp.ones((1, 256), jnp.float16), jnp.ones((256, 512), jnp.float16)])
  assert asked == [False] and targets == ["target-False"]


def test_keep_or_drop_log_names_the_timed_plan(tmp_path, monkeypatch, caplog):
  """The timing's log line says which plan was timed (a chain's part is
  timed with no other record of its plan)."""
  import logging
  from jaxfuse.codegen import CodegenError
  K, _ = _timed_kernel(tmp_path, monkeypatch, ["NVIDIA H100 80GB HBM3"])
  launch._xla_decisions.clear()
  try:
    with caplog.at_level(logging.INFO):
      with pytest.raises(CodegenError):
        launch._keep_fused(K(), lambda *a: a)
    assert any("fused 6.0 us" in r.getMessage() and r.getMessage().endswith("; plan plan A")
               for r in caplog.records), [r.getMessage() for r in caplog.records]
  finally:
    launch._xla_decisions.clear()
