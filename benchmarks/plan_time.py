"""Planning (or tuning) time for every case of MCFuser Tables II/III and
Chimera Table IV (``--set=large``: the large attention cases; ``train``:
the regions capture finds in the attention training step at the large
shapes, the largest a user's program plans; ``all``: every set).

Builds each region directly with the Chain IR (jaxfuse.planner.examples),
plans it with no cache and prints one row per case: time, chosen plan,
predicted time, programs. ``--tune=model`` (default): the model alone.
``--tune=measure`` (needs a CUDA GPU and torch): measured tuning as
``jaxfuse.jit`` runs it under ``tune=measure``, once per case, plus how many
plans were measured and the chosen plan's measured time. Run:

    python benchmarks/plan_time.py --device=h100 --repeat=3
    python benchmarks/plan_time.py --device=h100 --tune=measure
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top

from jaxfuse.devices import get_device
from jaxfuse.planner import examples, plan_region

_DEVICE = flags.DEFINE_string("device", "h100", "device model to plan for")
_REPEAT = flags.DEFINE_integer("repeat", 3, "plans per case; the median is reported")
_DTYPE = flags.DEFINE_string("dtype", "float16", "input dtype of the regions")
_FILTER = flags.DEFINE_string("filter", "", "only cases whose name contains this")
_SET = flags.DEFINE_enum("set", "paper", ["paper", "large", "train", "all"],
                         "paper: MCFuser II/III and Chimera IV; large: the attention "
                         "benchmark's large cases (batch 8, 16 heads, 2048/4096 tokens, "
                         "head dims 64/128); train: the regions of jax.grad of that "
                         "attention at 2048 tokens (forward, dq, and dk+dv merged), "
                         "as capture finds them; all: every set")


def _cases(dtype: str) -> list:
  """(name, region) of the selected set, filtered by --filter."""
  out = []
  if _SET.value in ("paper", "all"):
    out += examples.paper_cases(dtype)
  if _SET.value in ("large", "all"):
    out += [(f"large/L-T{t}-d{d}", examples.attention(8, 16, t, t, d, dtype=dtype))
            for t in (2048, 4096) for d in (64, 128)]
  if _SET.value in ("train", "all"):
    for d in (64, 128):
      for causal in (False, True):
        n = f"train/L-T2048-d{d}{'-causal' if causal else ''}"
        # Capture runs only for the steps the filter can match: a filter
        # within the step's name, or one of its regions ("train/L-T2048-d64/1").
        f = _FILTER.value
        if not f or f in n + "/" or f.startswith(n + "/"):
          out += [(f"{n}/{i}", r) for i, r in enumerate(_train_regions(d, causal, dtype))]
  return [(n, r) for n, r in out if not _FILTER.value or _FILTER.value in n]


def _train_regions(d: int, causal: bool, dtype: str) -> list:
  """The regions ``jaxfuse.jit`` plans for the attention benchmark's
  training step (``attention --step=train``: 8 x 2048 tokens x 16 heads x
  ``d``, token-major, the softmax and the loss in float32), as capture
  finds them: abstract inputs, nothing is computed."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from benchmarks import attention_workloads as aw  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture, ir  # pylint: disable=g-import-not-at-top

  step = aw.make_train_step(aw.make_attention(causal, 1.0 / math.sqrt(d), "bthd",
                                              softmax_dtype=jnp.float32))
  x = jax.ShapeDtypeStruct((8, 2048, 16, d), jnp.dtype(dtype))
  g = jax.ShapeDtypeStruct((8, 2048, 16, d), jnp.float32)
  return [ir.simplify(r.region) for r in capture.find_regions(jax.make_jaxpr(step)(x, x, x, g))]


_TUNE = flags.DEFINE_enum("tune", "model", ["model", "measure"],
                          "model: planning time of the model alone; measure: "
                          "measured-tuning time (CUDA GPU with torch)")


def _recording(measure, seen: dict):
  """``measure`` that also records each plan's time (by its text)."""
  def wrapped(plans):
    times = measure(plans)
    for p, t in zip(plans, times):
      if t is not None:
        seen[str(p)] = t
    return times
  wrapped.begin = getattr(measure, "begin", None)   # plan_region starts it with the search
  # Whether the search times other kernel forms too (launch.make_measure
  # says; planner.plan_region reads it): without it, the Gluon form's
  # compile and time were left out of the tuning timed here.
  wrapped.kernel_forms = getattr(measure, "kernel_forms", False)
  return wrapped


def tune_rows(dev, out) -> list[float]:
  """Measured tuning of each case, as ``jaxfuse.jit`` runs it."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  if not launch._torch_cuda():  # pylint: disable=protected-access
    raise app.UsageError("--tune=measure needs a CUDA GPU and torch with CUDA")
  # A jaxfuse.jit user's JAX already runs on the GPU: start its backend
  # here, outside the timed tuning (measured tuning's reference runs on it).
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(jax.numpy.ones(8) + 1)
  # So is the measuring child: jaxfuse.jit starts it when it decorates a
  # function, once per process, and measured tuning's budget leaves out
  # the wait for it (launch.make_measure). Timed with the first case, it
  # read as that case's tuning (seventy-first to eighty-first sessions).
  from jaxfuse.runtime import measure_worker  # pylint: disable=g-import-not-at-top
  waited = measure_worker.wait_until_ready()
  out.write(f"# measured-tuning time, device model {dev.name}, no cache, budget "
            f"{config.tune_budget_s:g} s, {config.compile_workers} compile workers "
            f"(the measuring child took {waited:.1f} s to start, before the first case)\n")
  out.write("| case | tune time (s) | plans measured | best plan | predicted (us) | "
            "measured (us) |\n| --- | --- | --- | --- | --- | --- |\n")
  rows = []
  for name, region in _cases(_DTYPE.value):
    seen: dict = {}
    t0 = time.perf_counter()
    res = plan_region(region, dev, measure=_recording(launch.make_measure(region), seen),
                      use_cache=False)
    dt = time.perf_counter() - t0
    rows.append(dt)
    best = res.best
    if best is None:
      out.write(f"| {name} | {dt:.2f} | {len(seen)} | none: {res.why_not} | - | - |\n")
      continue
    got = seen.get(str(best))
    meas = f"{got * 1e6:.2f}" if got is not None and got < float("inf") else "-"
    out.write(f"| {name} | {dt:.2f} | {len(seen)} | `{best}` | "
              f"{best.predicted.time_s * 1e6:.2f} | {meas} |\n")
    out.flush()
  if rows:
    out.write(f"\nmax {max(rows):.2f} s, median {statistics.median(rows):.2f} s over "
              f"{len(rows)} cases; {sum(r >= 5.0 for r in rows)} at or over 5 s\n")
  return rows


def main(argv):
  del argv
  dev = get_device(_DEVICE.value)
  # Import cost once, outside the timed region (first-use imports).
  plan_region(examples.gemm_chain(1, 64, 64, 64, 64), dev, use_cache=False)
  rows = []
  out = sys.stdout
  if _TUNE.value == "measure":
    tune_rows(dev, out)
    return
  out.write(f"# planning time, device model {dev.name}, model only, no cache, "
            f"median of {_REPEAT.value}\n")
  out.write("| case | shape | plan time (ms) | evaluated | best plan | predicted (us) | programs |\n")
  out.write("| --- | --- | --- | --- | --- | --- | --- |\n")
  for name, region in _cases(_DTYPE.value):
    times = []
    res = None
    for _ in range(max(1, _REPEAT.value)):
      # A fresh copy each time, as a user's region is planned once: the
      # planner memoizes what it derives on the region object.
      fresh = dataclasses.replace(region)
      t0 = time.perf_counter()
      res = plan_region(fresh, dev, use_cache=False)
      times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    rows.append(med)
    shape = ",".join(f"{l.name}={l.extent}" for l in region.loops)
    best = res.best
    if best is None:
      out.write(f"| {name} | {shape} | {med * 1e3:.1f} | {res.space.get('evaluated')} | "
                f"none: {res.why_not} | - | - |\n")
      continue
    out.write(f"| {name} | {shape} | {med * 1e3:.1f} | {res.space.get('evaluated')} | "
              f"`{best}` | {best.predicted.time_s * 1e6:.2f} | {best.predicted.programs} |\n")
  if rows:
    out.write(f"\nmax {max(rows) * 1e3:.1f} ms, median {statistics.median(rows) * 1e3:.1f} ms "
              f"over {len(rows)} cases\n")


if __name__ == "__main__":
  app.run(main)
