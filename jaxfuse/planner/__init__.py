"""The planner: from a Chain IR region to a ranked list of Plans.

``plan_region`` enumerates tiling expressions (MCFuser III-A), places
statements with hoisting (III-B), prunes (III-C), seeds with Chimera's
Lagrange tiles (IV-B), ranks with MCFuser's model (IV-A) and searches with
Alg. 1 (IV-B), measuring the top candidates when a ``measure`` callback is
given. Plans are cached on disk.

Example::

    from jaxfuse.planner import plan_region
    res = plan_region(region, "h100")
    print(res.best, res.best.predicted.time_s, res.space)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

from absl import logging

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec, get_device
from jaxfuse.planner.plan import Plan, Prediction

__all__ = ["plan_region", "PlanningResult", "Plan", "Prediction"]


@dataclasses.dataclass(frozen=True)
class PlanningResult:
  """What ``plan_region`` found.

  best: the chosen plan, or None (then ``why_not`` says why).
  ranked: best first (up to ``top``), each with ``.predicted``.
  space: sizes of the search space per stage and search statistics.
  alternatives: the model's best plan of each other structure (grid,
  split, output tiles) predicted within ``search.DIVERSE_MAX_RATIO`` of the
  best, best first (``search.SearchResult.leaders``): the model's top plans
  are near-copies of one structure, so these are what a caller that times
  kernels itself tries beside them (``launch.rival_plan``).
  """
  best: Optional[Plan]
  ranked: tuple[Plan, ...]
  why_not: Optional[str]
  space: dict
  plan_time_s: float
  device: str = ""
  from_cache: bool = False
  alternatives: tuple[Plan, ...] = ()


def _why_not(region: ir.Region, rejected: dict) -> str:
  if not rejected:
    return "no tiling expression places every op of the region"
  top = sorted(rejected.items(), key=lambda kv: -kv[1])[:3]
  parts = "; ".join(f"{k} ({v} candidates)" for k, v in top)
  return f"no legal plan fits on chip: {parts}"


def _parallelism_note(best: Plan, ranked: Sequence[Plan], dev: DeviceSpec) -> str:
  """Why the chosen plan launches fewer programs than the GPU has SMs."""
  wide = [p for p in ranked if p.predicted.programs >= dev.sm_count]
  b = best.predicted
  if not wide:
    return (f"{b.programs} programs < {dev.sm_count} SMs: no legal plan (grid "
            "over spatial loops, recomputing producers, or split reductions) "
            "reaches the SM count at this shape")
  w = wide[0].predicted
  return (f"{b.programs} programs < {dev.sm_count} SMs (alpha {b.alpha:.2f}): the "
          f"best plan with >= {dev.sm_count} programs ({w.programs} programs, "
          f"{wide[0]}) is predicted {w.time_s / b.time_s:.2f}x slower "
          f"({w.bytes_moved / 1e6:.2f} MB moved vs {b.bytes_moved / 1e6:.2f} MB, "
          f"{w.flops / 1e9:.2f} vs {b.flops / 1e9:.2f} GFLOP)")


def plan_region(region: ir.Region, device: Optional[DeviceSpec | str] = None, *,
                measure: Optional[Callable[[Sequence[Plan]], Sequence[float]]] = None,
                seed: int = 0, use_cache: bool = True, top: int = 6) -> PlanningResult:
  """Plans ``region`` for ``device`` (default: ``devices.get_device()``).

  ``measure(plans) -> seconds per plan`` (``inf``: the plan failed; ``None``:
  not measured, e.g. the budget ran out) refines the model's top candidates
  (MCFuser Alg. 1); without it the model decides. A ``measure.begin()``, if
  present, is called once the search is about to run (not on a cache hit); where
  ``measure.kernel_forms`` is true, the other kernel forms' plans are measured too
  (``kernel_forms.FormTiming``). Results (model-only or
  measured, each under its own key) are cached on disk unless ``use_cache=False``; a corrupt cache
  entry is logged and ignored. Never raises for a region it cannot plan:
  ``best`` is None and ``why_not`` explains.

  Example::

      res = plan_region(region, "h100")
      res.best.grid, res.best.tile_map, str(res.best.expr)
  """
  if not isinstance(region, ir.Region):
    raise TypeError(f"region must be a jaxfuse.ir.Region, got {type(region).__name__}")
  if top < 1:
    raise ValueError(f"top must be >= 1, got {top}")
  t0 = time.perf_counter()
  dev = get_device(device)
  from jaxfuse.planner import cache, search  # pylint: disable=import-outside-toplevel
  key = None
  measured = measure is not None
  if use_cache:
    try:
      key = cache.plan_key(region, dev, measured=measured)
      hit = cache.load(key, region)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("jaxfuse planner: plan cache unavailable (%s)", e)
      hit = None
    # The model's ranking and the measured one each answer their own mode
    # (cache.plan_key); an entry of the other mode is a miss.
    if hit is not None and bool(hit.extra.get("measured")) == measured:
      best = hit.plans[0] if hit.plans else None
      return PlanningResult(best, tuple(hit.plans[:top]), hit.extra.get("why_not"),
                            dict(hit.extra.get("space") or {}),
                            time.perf_counter() - t0, dev.name, True, tuple(hit.alternatives))
  if not region.contractions:
    return PlanningResult(None, (), "region has no contraction", {},
                          time.perf_counter() - t0, dev.name)
  begin = getattr(measure, "begin", None)
  if callable(begin):
    try:
      begin()   # the measurer's budget and background setup start with the search
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("jaxfuse planner: measure.begin failed (%s)", e)
  from jaxfuse.planner import kernel_forms  # pylint: disable=import-outside-toplevel
  timing = None
  if measure is not None and getattr(measure, "kernel_forms", False):
    # Measured tuning times the other kernel forms too (kernel_forms.FormTiming).
    measure = timing = kernel_forms.FormTiming(region, dev, measure)
  try:
    res = search.search(region, dev, seed=seed, measure=measure)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: planning failed for %r (%s)", region, e)
    return PlanningResult(None, (), f"planner error: {e}", {},
                          time.perf_counter() - t0, dev.name)
  space = dict(res.space)
  space.update({"evaluated": res.evaluated, "iterations": res.iterations,
                "rejected": dict(res.rejected)})
  ranked = tuple(res.ranked[:top])
  if ranked:
    ranked = kernel_forms.with_kernel_forms(region, dev, ranked, timing=timing)
  why = None if ranked else _why_not(region, res.rejected)
  best = ranked[0] if ranked else None
  if best is not None and best.predicted.programs < dev.sm_count:
    space["parallelism"] = _parallelism_note(best, res.ranked, dev)
  alternatives = tuple(res.leaders[:search.DIVERSE_N])
  if use_cache and key is not None:
    cache.store(key, region, list(ranked), {"why_not": why, "space": space,
                                            "measured": measured}, alternatives=alternatives)
  return PlanningResult(best, ranked, why, space, time.perf_counter() - t0, dev.name,
                        alternatives=alternatives)
