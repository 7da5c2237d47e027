"""Per-call time by the slope method (../shared/DESIGN.md, "Measuring on the GPU").

A program making ``n`` independent calls is timed for a small and a large
``n``; the slope between the two is the cost of one call inside a compiled
program, with Python dispatch and the program's fixed costs taken out. Each
timing window runs the program several times back to back (asynchronous
dispatch keeps the device busy) so that a window lasts at least
``min_window_s``: single executions of 50-200 us programs gave per-call
times that varied by 2x between identical runs on an H200.

Used by the measured keep-or-drop decision in ``jaxfuse.runtime.launch``
and by every benchmark binary (``benchmarks.harness``).

``graph_time`` times one kernel launch replayed from a CUDA graph (torch):
the measured step of the planner's search (``launch.measure_plans``).

Example::

    f = {n: jax.jit(lambda s, n=n: [g(*a) for a in s[:n]]) for n in (4, 16)}
    res = slope(lambda n: f[n](sets), jax.block_until_ready, lo=4, hi=16)
    res["per_call_s"]
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

__all__ = ["slope", "slopes", "graph_time", "consume_outputs"]


# Repetitions agree when their interquartile range (their range, below 4
# of them) is at most this fraction of their median (``slopes``' max_reps).
SETTLED_SPREAD = 0.1


def settled_spread(xs: Sequence[float]) -> float:
  """How much repetitions ``xs`` disagree: interquartile range over the
  median (range over the median for fewer than 4); 0 for one."""
  med = statistics.median(xs)
  if len(xs) < 2 or not med:
    return 0.0
  if len(xs) < 4:
    return (max(xs) - min(xs)) / abs(med)
  q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
  return (q3 - q1) / abs(med)


def slope(run: Callable[[int], Any], block: Callable[[Any], None], *, lo: int, hi: int,
          reps: int = 7, min_window_s: float = 10e-3, max_executions: int = 256,
          max_reps: int = 0) -> dict:
  """Per-call seconds of ``run(n)``, a program making ``n`` calls.

  ``run(n)`` dispatches the program and returns its outputs without
  waiting; ``block(outputs)`` waits for them (executions are ordered on the
  device, so waiting for the last one waits for all).

  Returns ``per_call_s`` (median slope over ``reps``), ``per_call_min_s``,
  ``per_call_spread`` ((max - min) / median), ``naive_per_call_s`` (time of
  the ``lo`` program over ``lo``), ``executions`` (per window) and
  ``per_call_reps`` (``reps``, or more up to ``max_reps``: see ``slopes``).
  """
  return slopes([run], [block], lo=lo, hi=hi, reps=reps, min_window_s=min_window_s,
                max_executions=max_executions, max_reps=max_reps)[0]


def slopes(runs: Sequence[Callable[[int], Any]], blocks: Sequence[Callable[[Any], None]], *,
           lo: int, hi: int, reps: int = 7, min_window_s: float = 10e-3,
           max_executions: int = 256, max_reps: int = 0) -> list[dict]:
  """``slope`` of several programs (``runs[i]`` waited for by ``blocks[i]``),
  interleaved: each repetition times every program's ``lo`` and ``hi``
  windows in turn.

  Why: timed one after another, two implementations of a call are seconds
  apart (compiles and profiles between them), and the host's speed may
  drift in between; interleaved, drift falls on all of them alike. (On the
  H100 host, where a fused call read 5.2 and 8.9 us per call in two
  processes, interleaving did not narrow the spread of such host-bound
  calls: benchmarks/RESULTS.md, fifty-sixth session.)

  ``max_reps`` > ``reps``: a program whose repetitions disagree
  (``settled_spread`` over ``SETTLED_SPREAD``) is repeated again, up to
  ``max_reps`` times in all, and its median taken over every repetition.
  Why: with 3 repetitions, two slow ones decided a median (BERT-Small b1
  read 235 us per call against a fastest repetition of 152 us and 151-157
  us in earlier runs; H100, seventy-second session). Each result has
  ``per_call_reps``, the repetitions it took.

  Example::

      a, b = slopes([run_a, run_b], [jax.block_until_ready] * 2, lo=4, hi=16)
      a["per_call_s"] / b["per_call_s"]
  """
  if not 0 < lo < hi:
    raise ValueError(f"lo, hi: need 0 < lo < hi, got lo={lo}, hi={hi}")
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  if len(runs) != len(blocks) or not runs:
    raise ValueError(f"runs, blocks: need as many (at least one) of each, got "
                     f"{len(runs)} and {len(blocks)}")
  for run, block in zip(runs, blocks):
    block(run(lo))
    block(run(hi))

  def window(i: int, n: int, executions: int) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(executions):
      out = runs[i](n)
    blocks[i](out)
    return (time.perf_counter() - t0) / executions

  def executions_for(i: int) -> int:
    one = window(i, hi, 1)
    return int(min(max_executions, max(1, math.ceil(min_window_s / max(one, 1e-9)))))
  executions = [executions_for(i) for i in range(len(runs))]
  slopes_, naive = [[] for _ in runs], [[] for _ in runs]

  def repeat(i: int) -> None:
    t_lo = window(i, lo, executions[i])
    t_hi = window(i, hi, executions[i])
    slopes_[i].append((t_hi - t_lo) / (hi - lo))
    naive[i].append(t_lo / lo)
  for _ in range(reps):
    for i in range(len(runs)):
      repeat(i)
  while True:
    noisy = [i for i in range(len(runs)) if len(slopes_[i]) < max_reps
             and settled_spread(slopes_[i]) > SETTLED_SPREAD]
    if not noisy:
      break
    for i in noisy:
      repeat(i)
  out = []
  for i, e in enumerate(executions):
    xs = slopes_[i]
    med = statistics.median(xs)
    spread = (max(xs) - min(xs)) / abs(med) if med and len(xs) > 1 else 0.0
    out.append({"per_call_s": med, "per_call_min_s": min(xs), "per_call_spread": spread,
                "naive_per_call_s": statistics.median(naive[i]), "executions": e,
                "per_call_reps": len(xs)})
  return out


def consume_outputs(outs: Any) -> Any:
  """What a K-call program timed by ``slope`` returns instead of its calls'
  outputs: they stay on the device behind an optimization barrier and one
  element of each output leaf comes back, call by call, leaf by leaf
  (float32), for a check that the calls ran. Contractions and custom calls
  still compute their whole outputs; an elementwise op after a call's last
  kernel may be computed by XLA for the returned element only.

  Why: returning every output from the program adds a cost per program
  output (output buffers, command-buffer updates) of 2-3 us per call on an
  H200 for jax.jit and jaxfuse alike, as much as whole small calls cost
  (fifth session); the keep-or-drop decision read that noise and dropped
  kernels twice as fast as XLA's. Call inside the traced function::

    jax.jit(lambda sets: consume_outputs([f(*a) for a in sets]))
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  outs = jax.lax.optimization_barrier(outs)
  return jnp.stack([l.reshape(-1)[0].astype(jnp.float32)
                    for l in jax.tree_util.tree_leaves(outs)])


def graph_time(fn: Callable[[], None], *, window_s: float = 1e-3, reps: int = 5,
               max_launches: int = 1000) -> float:
  """Seconds per call of ``fn`` (a launch on torch's current CUDA stream),
  replayed from a CUDA graph of ``n`` back-to-back launches so that host
  launch cost is not in the time; ``n`` makes one replay last about
  ``window_s``; the median of ``reps`` replays timed by CUDA events.

  Why not ``triton.testing.do_bench_cudagraph``: it captures ~20 ms of
  launches (6,600 for a 3 us kernel), ~0.3 s per candidate, which alone
  overran the 4 s tuning budget with 8 candidates (H200, 2026-11-21).
  Call ``fn`` once and synchronize before: a launch that fails under
  capture leaves the CUDA context unusable.
  """
  import torch  # pylint: disable=g-import-not-at-top
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  start = torch.cuda.Event(enable_timing=True)
  end = torch.cuda.Event(enable_timing=True)

  def timed(graph: "torch.cuda.CUDAGraph") -> float:
    start.record(stream)
    graph.replay()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e-3

  def capture(n: int) -> "torch.cuda.CUDAGraph":
    g = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call another thread makes meanwhile (XLA's
    # runtime threads: this runs while jaxfuse.jit compiles, with the
    # process's earlier work in flight) neither breaks this capture nor
    # fails itself; under the default global mode one such call invalidated
    # the capture and left JAX's stream in error (H100, 2026-11-21,
    # cudaErrorStreamCaptureInvalidated during measured tuning of a batch).
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
      for _ in range(n):
        fn()
    g.replay()
    stream.synchronize()
    return g

  with torch.cuda.stream(stream):
    fn()
    stream.synchronize()
    probe = 4
    est = timed(capture(probe)) / probe
    n = int(min(max_launches, max(probe, math.ceil(window_s / max(est, 1e-8)))))
    g = capture(n)
    times = [timed(g) for _ in range(reps)]
  return statistics.median(times) / n
