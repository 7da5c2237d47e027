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

Example::

    f = {n: jax.jit(lambda s, n=n: [g(*a) for a in s[:n]]) for n in (4, 16)}
    res = slope(lambda n: f[n](sets), jax.block_until_ready, lo=4, hi=16)
    res["per_call_s"]
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

__all__ = ["slope"]


def slope(run: Callable[[int], Any], block: Callable[[Any], None], *, lo: int, hi: int,
          reps: int = 7, min_window_s: float = 2e-3, max_executions: int = 64) -> dict:
  """Per-call seconds of ``run(n)``, a program making ``n`` calls.

  ``run(n)`` dispatches the program and returns its outputs without
  waiting; ``block(outputs)`` waits for them (executions are ordered on the
  device, so waiting for the last one waits for all).

  Returns ``per_call_s`` (median slope over ``reps``), ``per_call_min_s``,
  ``per_call_spread`` ((max - min) / median), ``naive_per_call_s`` (time of
  the ``lo`` program over ``lo``) and ``executions`` (per window).
  """
  if not 0 < lo < hi:
    raise ValueError(f"lo, hi: need 0 < lo < hi, got lo={lo}, hi={hi}")
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  block(run(lo))
  block(run(hi))

  def window(n: int, executions: int) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(executions):
      out = run(n)
    block(out)
    return (time.perf_counter() - t0) / executions

  one = window(hi, 1)
  executions = int(min(max_executions, max(1, math.ceil(min_window_s / max(one, 1e-9)))))
  slopes, naive = [], []
  for _ in range(reps):
    t_lo = window(lo, executions)
    t_hi = window(hi, executions)
    slopes.append((t_hi - t_lo) / (hi - lo))
    naive.append(t_lo / lo)
  med = statistics.median(slopes)
  spread = (max(slopes) - min(slopes)) / abs(med) if med and len(slopes) > 1 else 0.0
  return {"per_call_s": med, "per_call_min_s": min(slopes), "per_call_spread": spread,
          "naive_per_call_s": statistics.median(naive), "executions": executions}
