"""Per-call time read from the GPU's own clock, inside a compiled program.

The host slope method (``jaxfuse.runtime.timing.slope``) times whole
executions from the host. For calls of a few microseconds that measures the
host: XLA's command-buffer update and launch cost 2-6 us per call on the
H100 host whoever launches the kernels (fourteenth session), and keep-or-drop
timings of the MCFuser table read spreads of 0.7-8 between repetitions
(twentieth session), so the cost model decided every region even under
``tune='measure'``.

Here a one-thread Triton kernel (``stamp``) writes the GPU's global
nanosecond timer (``%globaltimer``) into a 2-element int32 array. A timed
program stamps once before its calls (every call's inputs pass through an
optimization barrier with that stamp, so no call can start before it) and
once after (the stamp reads one element of every call's output, so it runs
after the last kernel). The span between the stamps is device time: kernels
and the gaps between them, no host work outside the program's launch. Two
programs of ``lo`` and ``hi`` calls give the per-call time as the slope of
their spans, which removes the stamps' and the output check's own kernels.

Example (what ``launch._per_call_times`` does on the GPU)::

    progs = {n: jax.jit(lambda s, n=n: stamped(lambda a: [f(*x) for x in a[:n]], s))
             for n in (4, 16)}
    res = span_slope(lambda n: progs[n](sets), lo=4, hi=16)
    res["per_call_s"], res["per_call_spread"]
"""

from __future__ import annotations

import statistics
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
from absl import logging

__all__ = ["available", "stamp", "stamped", "nanoseconds", "span_slope"]

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _stamp_kernel():
  """The stamp's Triton kernel (``clock_kernel``, imported on first use)."""
  from jaxfuse.runtime import clock_kernel  # pylint: disable=g-import-not-at-top
  return clock_kernel.jaxfuse_clock_stamp


def available() -> bool:
  """Whether stamps can run here: a JAX GPU and jax-triton importable (its
  import fails without CUDA jaxlib). Decided once per process; a stamp that
  fails to compile or run anyway is the caller's to catch."""
  with _lock:
    if "ok" in _state:
      return _state["ok"]
  ok = False
  try:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.default_backend() == "gpu":
      from jaxfuse.runtime import triton_call  # pylint: disable=g-import-not-at-top
      triton_call.jax_triton_module()
      ok = True
  except Exception as e:  # pylint: disable=broad-except  (no jax-triton, no CUDA)
    logging.info("jaxfuse: no device clock (%s: %s); timing from the host",
                 type(e).__name__, str(e)[:200])
  with _lock:
    _state["ok"] = ok
  return ok


def stamp(dep: Any) -> Any:
  """Inside a traced function: an int32[2] array holding the GPU's
  ``%globaltimer`` (low, high 32 bits) read when the stamp kernel runs, which
  is after ``dep`` (any array) is computed. ``nanoseconds`` decodes it."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import triton_call  # pylint: disable=g-import-not-at-top
  jt = triton_call.jax_triton_module()
  return jt.triton_call(dep, kernel=_stamp_kernel(),
                        out_shape=jax.ShapeDtypeStruct((2,), jnp.int32), grid=(1,),
                        num_warps=1, num_stages=1,
                        custom_call_target_name=triton_call.call_target(jt))


def stamped(calls: Callable[[Any], Any], args: Any, *,
            stamp_fn: Optional[Callable[[Any], Any]] = None):
  """Inside a traced function: ``calls(args)`` between two stamps.

  Returns ``(start, end, consumed)``: the stamps and
  ``timing.consume_outputs`` of the calls' outputs (the program's only
  other output). ``args`` (a pytree holding at least one array) passes
  through an optimization barrier with the first stamp, so every call
  starts after it; the second stamp reads ``consumed``, which reads every
  call's output. ``stamp_fn`` replaces ``stamp`` (tests on the CPU).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
  stamp_fn = stamp_fn or stamp
  leaves = jax.tree_util.tree_leaves(args)
  if not leaves:
    raise ValueError("args: need at least one array to order the first stamp after")
  start = stamp_fn(leaves[0])
  start, args = jax.lax.optimization_barrier((start, args))
  consumed = timing.consume_outputs(calls(args))
  return start, stamp_fn(consumed), consumed


def nanoseconds(stamp_value: Any) -> int:
  """The timer value (ns) of a stamp's int32[2] (low, high) array."""
  lo, hi = np.asarray(stamp_value).astype(np.int64).reshape(2)
  return int((hi << 32) | (lo & 0xFFFFFFFF))


def span_slope(run: Callable[[int], Sequence[Any]], *, lo: int, hi: int, reps: int = 7,
               warmup: int = 2) -> dict:
  """Per-call seconds of ``run(n)``, a program of ``n`` calls returning
  ``stamped``'s ``(start, end, consumed)``, from device spans.

  Each program runs ``warmup`` times, then ``reps`` times alternately; each
  repetition's slope is (span(hi) - span(lo)) / (hi - lo). Returns
  ``per_call_s`` (the median slope), ``per_call_min_s``,
  ``per_call_spread`` ((max - min) / median; inf when the median is not
  positive, i.e. the clock told nothing) and ``spans_s`` (median span per
  program), in the form of ``timing.slope``'s result.
  """
  import jax  # pylint: disable=g-import-not-at-top
  if not 0 < lo < hi:
    raise ValueError(f"lo, hi: need 0 < lo < hi, got lo={lo}, hi={hi}")
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")

  def span(n: int) -> float:
    start, end, _ = jax.block_until_ready(run(n))
    return (nanoseconds(end) - nanoseconds(start)) * 1e-9

  for _ in range(warmup):
    span(lo)
    span(hi)
  spans = {lo: [], hi: []}
  for _ in range(reps):
    spans[lo].append(span(lo))
    spans[hi].append(span(hi))
  slopes = [(b - a) / (hi - lo) for a, b in zip(spans[lo], spans[hi])]
  med = statistics.median(slopes)
  spread = (max(slopes) - min(slopes)) / med if med > 0 else float("inf")
  return {"per_call_s": med, "per_call_min_s": min(slopes), "per_call_spread": spread,
          "spans_s": {n: statistics.median(v) for n, v in spans.items()}}
