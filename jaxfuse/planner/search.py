"""The search space of plans and MCFuser's heuristic search (Alg. 1).

A candidate is ``(grid, skeleton, tiles, split)``:

* ``grid``: the default grid (batch loops and spatial loops every
  contraction uses) or that grid plus spatial loops private to consumers
  (``h``: producers recomputed per program) -- the low-parallelism option;
* ``skeleton``: a representative of each Rule 1 class (per-block program
  for that grid) surviving Rule 2;
* ``tiles``: Rule 3 candidates per loop, Rule 4 (shared memory) and a
  register bound on the fp32 accumulators;
* ``split``: ``None`` or ``(loop, parts)`` for a reduction loop whose
  contraction's result is an output (partial results combined by a second
  pass), considered when the grid is smaller than the SM count.

``tiling.place`` turns a candidate into the per-program expression (or
rejects it); ``cost_model.predict`` ranks it. Alg. 1: a population of N
candidates (random, seeded, plus Chimera's Lagrange tiles and a balanced
seed per skeleton), ranked by the model; stop when the model's best
improves by less than ``eps`` (relative); the next population by sampling
weighted by 1/estimate and mutating one loop's tile (or the
grid/split/skeleton). Then a greedy descent from the model's best plans
(``_refine``) settles on the local optimum around them; the pick then
drops its third pipeline stage where that lets a second program share
its SM and the model predicts it faster (``fewer_stages``). Deterministic
for a given seed.

With a ``measure`` callback, the model's top n plans are measured, and
with them the model's best plan of each other structure (``DIVERSE_N``
structures predicted within ``DIVERSE_MAX_RATIO`` of the best; structure:
grid, split, output tiles), in one batch; the best measured
plan is then measured with other ``num_warps``/``num_stages``
(``LAUNCH_KNOBS``). Where this departs from Alg. 1, which measures the top
n of every generation and stops on measured improvement: the population
here is steered by the model either way, and one batch lets every kernel
compile in parallel inside the tuning budget (per-generation batches used
the ~4 s budget before the last ones were measured: 4.3-5.5 s of tuning
per attention region on the H100, twelfth session).

Example::

    res = search(region, get_device("h100"), seed=0)
    res.ranked[0]   # the best Plan
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import math
import random
import threading
from typing import Callable, Optional, Sequence

from absl import logging

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec
from jaxfuse.planner import cost_model, lagrange, pruning, tiling
from jaxfuse.planner.plan import Plan

__all__ = ["Candidate", "Space", "SearchResult", "build_space", "search",
           "splittable_loops", "make_plan", "unsplit_rival", "tied_rival"]

@dataclasses.dataclass(frozen=True)
class Candidate:
  grid: tuple[str, ...]
  skeleton: str
  tiles: tuple[tuple[str, int], ...]
  split: Optional[tuple[str, int]] = None


@dataclasses.dataclass
class Space:
  region: ir.Region
  device: DeviceSpec
  grids: list[tuple[str, ...]]
  skeletons: dict[tuple[str, ...], list[tiling.TilingExpr]]
  tile_cands: dict[str, tuple[int, ...]]
  splits: list[Optional[tuple[str, int]]]
  streamable: frozenset[str]
  masked: dict   # loop -> streaming.Band, tiling.masked_tile_relations, once per search
  counts: dict
  floor_regs: int = 0   # cost_model.unsplit_floor_regs, once per search


@dataclasses.dataclass
class SearchResult:
  """``ranked``: best first (measured where measured). ``leaders``: the
  model's best plan of each other structure than ``ranked[0]``'s
  (``_structure``), predicted within ``DIVERSE_MAX_RATIO`` of it, best
  first; what a caller that times a few kernels itself may try beside the
  pick (``tune='auto'``: ``launch.rival_plan``)."""
  ranked: list[Plan]
  evaluated: int
  iterations: int
  rejected: dict[str, int]
  space: dict
  leaders: list[Plan] = dataclasses.field(default_factory=list)


# A streamed (online-softmax) loop is split across programs only when it is
# at least this long. Why: the split adds a combine kernel of 1.4-2.7 us
# (H100, thirty-sixth session), which a short key loop's kernel cannot win
# back: MCFuser S9 (512 keys), whose split the model ranks first, ran 5.73
# us split against 5.12 us unsplit (ninth session) and 4.84 against 4.69 us
# of kernel time (thirty-sixth), and S7/S8's best split plans ran about
# 1.1 us slower than their best unsplit ones. Decoding steps (4096-16384
# keys) ran 1.1-2.9x faster than XLA split.
MIN_STREAMED_SPLIT_EXTENT = 1024


def splittable_loops(region: ir.Region, streamable: Optional[frozenset[str]] = None
                     ) -> tuple[str, ...]:
  """Reduction loops whose parts may run in separate programs, their
  partial results combined by a second pass that then runs the rest of the
  region (GELU, a bias, the join of a gated MLP's two GEMMs, a softmax's
  division) on the combined values. Two kinds:

  * a loop that only contractions reduce: the partial sums add up;
  * a loop in ``streamable`` (default ``tiling.streamable_loops(region)``;
    softmax attention's key loop), which streams online and which only its
    running maxima and rescaled accumulators reduce: the combine pass
    rescales each part by its running max, as flash-decoding does.

  Either way, no contraction may read a value computed after the loop (the
  sums of GEMM 1 of a chain feed GEMM 2): the combine pass would carry the
  rest of the chain.

  Example::

      splittable_loops(examples.gemm_chain(1, 512, 512, 512, 256))   # ('n',)
      splittable_loops(examples.attention(1, 1, 1, 4096, 128))       # ('n',)
  """
  online = tiling.streamable_loops(region) if streamable is None else streamable
  out = []
  for l in region.reduced_loops():
    reducers = [op for op in region.ops if l in tiling.reduced_by(op)]
    if not reducers:
      continue
    if l in online:
      ok = not any(_feeds_contraction(region, op, within=l) for op in reducers)
    else:
      ok = all(isinstance(op, ir.Contraction) and not _feeds_contraction(region, op)
               for op in reducers)
    if ok:
      out.append(l)
  order = [x.name for x in region.loops]
  return tuple(sorted(out, key=order.index))


def _feeds_contraction(region: ir.Region, op, within: Optional[str] = None) -> bool:
  """Does a contraction read a value computed from ``op``'s result? With
  ``within``, only values computed after that loop count (the walk does
  not pass through values that still run along it: a softmax's
  ``exp(x - max)`` is computed inside the loop, in each part)."""
  vm = region.value_map
  stack, seen = [op.out], set()
  while stack:
    v = stack.pop()
    for c in region.consumers(v):
      if isinstance(c, ir.Contraction):
        return True
      if c.out not in seen and (within is None or within not in vm[c.out].loops):
        seen.add(c.out)
        stack.append(c.out)
  return False


# Most (grid, tiling expression) pairs ``build_space`` classifies by Rules 1
# and 2. Why a bound: the work is every expression for every grid, and both
# grow fast with a region's loops (expressions factorially, grids as the
# subsets of the consumer-private spatial loops). The benchmark regions
# stay under 2,000 (a 5-GEMM chain: 978 expressions, 2 grids, 0.5 s); an
# 11-loop region of two unrelated parts had 5,040 x 256 and took 6 minutes
# (sixty-ninth session). Over the bound the grids with more than one extra
# loop go first, then all but the default grid.
MAX_SPACE_PAIRS = 20_000


def _bounded_grids(region: ir.Region, base, extra, n_expressions: int) -> list[tuple[str, ...]]:
  """The grids ``build_space`` considers: the default grid plus each subset
  of ``extra`` loops, as far as ``MAX_SPACE_PAIRS`` allows."""
  def grids_upto(r_max: int):
    out = []
    for r in range(min(len(extra), r_max) + 1):
      for sub in itertools.combinations(extra, r):
        g = set(base) | set(sub)
        out.append(tuple(l.name for l in region.loops if l.name in g))
    return out
  r_max = len(extra)
  while r_max > 0 and len(grids_upto(r_max)) * n_expressions > MAX_SPACE_PAIRS:
    r_max = 1 if r_max > 1 else 0
  if r_max < len(extra):
    logging.info("jaxfuse planner: %d tiling expressions: grids with at most %d of the "
                 "%d consumer-private loops (MAX_SPACE_PAIRS)", n_expressions, r_max, len(extra))
  return grids_upto(r_max)


def build_space(region: ir.Region, device: DeviceSpec, *,
                streamable: Optional[frozenset[str]] = None) -> Space:
  stream = tiling.streamable_loops(region) if streamable is None else frozenset(streamable)
  base = tiling.default_grid(region)
  extra = [l for l in region.spatial_loops() if l not in base]
  sks = tiling.enumerate_skeletons(region)
  grids = _bounded_grids(region, base, extra, len(sks))
  skeletons = {}
  counts = {"expressions": len(sks)}
  made: dict = {}
  placed = pruning.naive_placements(region, sks, rule2_under=grids, counts=made)
  nested = len(sks) - made["not_nested"]
  for g in grids:
    classes = pruning.rule1_programs(region, placed, g, rule2=True)
    keep = [members[0] for _, members in classes.values()]
    skeletons[g] = keep
    # Rule 2 runs first here (see rule1_programs): the count is of the
    # skeletons it rejects, then of the programs Rule 1 keeps of the rest.
    counts[f"grid({','.join(g)})"] = {
        "rule2_rejected": nested - sum(len(m) for _, m in classes.values()),
        "rule1_kept": len(keep)}
  tile_cands = {l.name: pruning.tile_candidates(region, l.name) for l in region.loops}
  splits: list[Optional[tuple[str, int]]] = [None]
  from jaxfuse.config import config  # pylint: disable=import-outside-toplevel
  # Split reductions (config.allow_split, on by default): since the combine
  # pass re-tiles its outputs (1.4-2.0 us instead of up to 10 us), the split
  # plans the model picks for MCFuser G4-G7 and G10 beat both the unsplit
  # plans and XLA on the H100 (benchmarks/RESULTS.md, ninth session).
  for l in (splittable_loops(region, stream) if config.allow_split else ()):
    if l in stream and region.extent(l) < MIN_STREAMED_SPLIT_EXTENT:
      continue
    for p in (2, 4, 8, 16):
      if math.ceil(region.extent(l) / 16) >= p:
        splits.append((l, p))
  counts.update(_size_counts(skeletons, tile_cands, splits))
  return Space(region, device, grids, skeletons, tile_cands, splits, stream,
               tiling.masked_tile_relations(region), counts,
               cost_model.unsplit_floor_regs(region))


def check_tiles(region: ir.Region, tiles: dict[str, int], device: DeviceSpec,
                masked: Optional[dict] = None, floor_regs: Optional[int] = None) -> None:
  """Raises PlacementError where tiles alone rule a plan out: shared memory
  (Rule 4), a dot Triton mishandles (Rule 5), or fp32 accumulators over the
  register budget of ``choose_warps``' warps (smaller where the region's
  key tiles are masked: ``masked``, ``tiling.masked_tile_relations``,
  derived when None; never below ``floor_regs`` per thread,
  ``cost_model.unsplit_floor_regs``, derived when None).

  Example: ``check_tiles(region, dict(plan.tiles), H100)`` tells whether
  the current planner still accepts a plan saved earlier."""
  # Accumulators are bounded by the register budget below, not here.
  if not pruning.rule4_ok(region, tiles, device.smem_per_block_bytes, register_accumulators=True):
    raise tiling.PlacementError(
        f"shared memory estimate "
        f"{pruning.smem_estimate(region, tiles, register_accumulators=True)} B exceeds "
        f"{pruning.SMEM_SLACK} x {device.smem_per_block_bytes} B (Rule 4)")
  hazard = pruning.dot_hazard(region, tiles)
  if hazard:
    raise tiling.PlacementError(f"{hazard} (Rule 5)")
  if masked is None:
    masked = tiling.masked_tile_relations(region)
  if floor_regs is None:
    floor_regs = cost_model.unsplit_floor_regs(region)
  warps = cost_model.choose_warps(region, tiles, bool(masked), floor_regs)
  acc = cost_model.register_tile_bytes(region, tiles, warps)
  budget = cost_model.register_budget_bytes(warps, cost_model.tile_rows(region, tiles),
                                            masked=bool(masked), floor_regs=floor_regs)
  if acc > budget:
    held = "fp32 accumulators"
    if acc > cost_model.accumulator_bytes(region, tiles):
      held += f" and epilogue tiles ({cost_model.epilogue_live_tiles(region)} live)"
    raise tiling.PlacementError(
        f"{held} of {acc} B exceed the register budget of {warps} warps "
        f"({budget} B{' with masked key tiles' if masked else ''})")


def rejection_kind(reason: str) -> str:
  """The rule behind a PlacementError's message, without its numbers: the
  key under which searches count rejected candidates."""
  if "Rule 4" in reason:
    return "Rule 4: shared memory"
  if "TF32 operand tiles" in reason:
    return "fp32 accumulators and TF32 operand tiles exceed the register budget"
  if "epilogue tiles" in reason:
    return "fp32 accumulators and epilogue tiles exceed the register budget"
  if "masked key tiles" in reason:
    return "fp32 accumulators exceed the register budget of masked key tiles"
  if "register budget" in reason:
    return "fp32 accumulators exceed the register budget"
  if "(deferred-sum cap)" in reason:
    return "one-row products summed every step (deferred-sum cap)"
  if "(Rule 5)" in reason:
    return ("Rule 5: a TF32 dot that spills registers" if "spills" in reason
            else "Rule 5: a dot Triton miscompiles")
  return reason.split(" (")[0]


def make_plan(region: ir.Region, device: DeviceSpec, cand: Candidate,
              streamable: frozenset[str],
              placements: Optional[dict] = None,
              masked: Optional[dict] = None,
              floor_regs: Optional[int] = None,
              checked: Optional[dict] = None,
              priced: Optional[dict] = None,
              placement_keys: Optional[dict] = None) -> Plan:
  """Places a candidate and predicts it; raises PlacementError or ValueError.

  ``placements``: a memo of ``tiling.place`` for this region and
  ``streamable`` by ``tiling.placement_key`` (one search's candidates share
  a few placements: place reads the skeleton only without its grid and
  single-tile loops, and the tiles only through those loops).
  ``masked``: ``tiling.masked_tile_relations(region)``, ``floor_regs``:
  ``cost_model.unsplit_floor_regs(region)`` (each derived when None; a
  search passes its space's, so each runs once per search). ``checked``: a
  memo of ``check_tiles``'s verdict, and of the warps and accumulator
  bytes that follow from the tiles, by tiles for this region (candidates
  of other grids and skeletons share tiles). ``priced``: a memo of what
  follows placement (warps, stages, the prediction, or the rejection) by
  placed expression, tiles, grid and split for this region: many skeletons
  place to one expression (on a merged dk+dv backward region, 1233 valid
  candidates were 556 distinct plans). ``placement_keys``: a memo of
  ``tiling.placement_key`` by skeleton text, grid, split and single-tile
  loops (what the key reads of the tiles), with ``placements``."""
  tiles = dict(cand.tiles)
  if masked is None:
    masked = tiling.masked_tile_relations(region)
  if floor_regs is None:
    floor_regs = cost_model.unsplit_floor_regs(region)
  if checked is None:
    check_tiles(region, tiles, device, masked, floor_regs)
    warps = cost_model.choose_warps(region, tiles, bool(masked), floor_regs)
    acc = cost_model.accumulator_bytes(region, tiles)
  else:
    got = checked.get(cand.tiles)
    if got is None:
      try:
        check_tiles(region, tiles, device, masked, floor_regs)
        got = (None, cost_model.choose_warps(region, tiles, bool(masked), floor_regs),
               cost_model.accumulator_bytes(region, tiles))
      except tiling.PlacementError as e:
        got = (str(e), 0, 0)
      checked[cand.tiles] = got
    if got[0] is not None:
      raise tiling.PlacementError(got[0])
    _, warps, acc = got
  if cand.split:
    l, parts = cand.split
    if math.ceil(region.extent(l) / tiles[l]) < parts:
      raise tiling.PlacementError(f"split {l}x{parts} has fewer tiles than parts")
  expr = _place(region, cand, tiles, streamable, placements, placement_keys)
  if priced is None:
    return _priced_plan(region, device, cand, expr, tiles, warps, acc, streamable, masked,
                        floor_regs)
  key = (str(expr), cand.tiles, cand.grid, cand.split)
  got = priced.get(key)
  if got is None:
    try:
      plan = _priced_plan(region, device, cand, expr, tiles, warps, acc, streamable, masked,
                          floor_regs)
    except tiling.PlacementError as e:
      priced[key] = str(e)
      raise
    priced[key] = (plan.num_warps, plan.num_stages, plan.predicted)
    return plan
  if isinstance(got, str):
    raise tiling.PlacementError(got)
  warps, stages, predicted = got
  return Plan(expr=expr, grid=cand.grid, tiles=cand.tiles, skeleton=cand.skeleton,
              num_warps=warps, num_stages=stages, split=cand.split, predicted=predicted)


def _priced_plan(region: ir.Region, device: DeviceSpec, cand: Candidate,
                 expr: tiling.TilingExpr, tiles: dict[str, int], warps: int, acc: int,
                 streamable: frozenset[str], masked: dict, floor_regs: int) -> Plan:
  """``make_plan`` from a placed expression on: the checks that read it,
  the launch knobs and the prediction."""
  held = cost_model.tf32_held_operand_bytes(region, expr, tiles)
  if held and acc + held > cost_model.register_budget_bytes(warps):
    raise tiling.PlacementError(
        f"fp32 accumulators of {acc} B and loop-invariant TF32 operand tiles of {held} B "
        f"exceed the register budget of {warps} warps "
        f"({cost_model.register_budget_bytes(warps)} B)")
  if cand.split:
    top = [n.loop for n in expr.body if isinstance(n, tiling.LoopNode)]
    if cand.split[0] not in top:
      raise tiling.PlacementError(f"split loop {cand.split[0]} is not a top-level loop")
    idx = next(i for i, n in enumerate(expr.body)
               if isinstance(n, tiling.LoopNode) and n.loop == cand.split[0])
    if any(s.kind == "S" for s in tiling.TilingExpr(expr.body[:idx + 1]).statements()):
      raise tiling.PlacementError("split plans store outputs only after the split loop")
  # Loops the code generator prints as pieces are priced at what it prints.
  sized = tiling.piece_sizes(region, expr, tiles, cand.grid)
  warps, stages = cost_model.choose_warps_stages(region, expr, sized, device, bool(masked),
                                                 floor_regs)
  if cost_model.is_unpipelined(region, tiles, streamable):
    summed = pruning.summed_every_step(region, expr, tiles, warps)
    if summed:
      raise tiling.PlacementError(
          f"broadcast products of {', '.join(summed)} summed every step: over "
          f"{pruning.DEFERRED_SUM_REGS_PER_THREAD} registers per thread at {warps} warps "
          "(deferred-sum cap)")
  smem = pruning.pipelined_smem_bytes(region, expr, sized, stages)
  if smem > device.smem_per_block_bytes:
    raise tiling.PlacementError(
        f"shared memory of {smem} B at {stages} pipeline stages exceeds "
        f"{device.smem_per_block_bytes} B (Rule 4)")
  plan = Plan(expr=expr, grid=cand.grid, tiles=cand.tiles, skeleton=cand.skeleton,
              num_warps=warps, num_stages=stages, split=cand.split)
  return dataclasses.replace(plan, predicted=predict_plan(region, plan, device, streamable,
                                                          masked, sized=sized))


def fewer_stages(region: ir.Region, plan: Plan, device: DeviceSpec,
                 streamable: frozenset[str], masked: dict) -> Plan:
  """``plan`` at 2 pipeline stages where that lets more of its programs
  share an SM and the model predicts it faster; else ``plan``.

  ``cost_model.choose_warps_stages`` takes the deepest pipeline that fits
  one program's shared memory, and a third stage can cost a second
  program per SM. Applied to the model's pick only (``_search_space``):
  on an H100 (eighty-first session) the picks of four dk+dv backward
  kernels (head dim 128) ran 0.63-0.89x their time at 3 stages with two
  programs per SM at 2 (predicted 0.85-0.86x). Offering every candidate
  both depths instead changed the pick of 23 other benchmark regions, and
  18 of them ran 1.004-1.72x slower: the model ranks a plan that needs
  the second program against other plans 1-9% too well."""
  # One warpgroup per program only, as measured: there the second program
  # is what gives the SM a second warpgroup (OVERLAP_COMPUTE); an 8-warp
  # program has two already.
  if plan.num_stages <= 2 or plan.num_warps > 4 or plan.predicted is None:
    return plan
  expr, warps = plan.expr, plan.num_warps
  sized = tiling.piece_sizes(region, expr, plan.tile_map, plan.grid)
  if (cost_model.programs_per_sm(region, expr, sized, 2, device, warps)
      <= cost_model.programs_per_sm(region, expr, sized, plan.num_stages, device, warps)):
    return plan
  two = dataclasses.replace(plan, num_stages=2)
  two = dataclasses.replace(two, predicted=predict_plan(region, two, device, streamable,
                                                        masked, sized=sized))
  return two if two.predicted.time_s < plan.predicted.time_s else plan


def predict_plan(region: ir.Region, plan: Plan, device: DeviceSpec,
                 streamable: Optional[frozenset[str]] = None, masked: Optional[dict] = None,
                 sized: Optional[dict] = None) -> cost_model.Prediction:
  """The model's time for ``plan`` as the search predicts it: loops the
  code generator prints as pieces priced at their pieces' sizes
  (``tiling.piece_sizes``; ``sized`` when already computed), at the plan's
  warps and stages. Anything that re-predicts a plan (``model_fidelity
  --rescore``) must go through here: pricing a head dimension of 80 at its
  128-wide tile doubled a plan's waves and its predicted time (6.35 against
  the search's 3.75 us, attention S6, fifty-first session).

  Example::

      plan = parse_plan(text, region.loop_extents)
      predict_plan(region, plan, get_device("h100")).time_s
  """
  if sized is None:
    sized = tiling.piece_sizes(region, plan.expr, plan.tile_map, plan.grid)
  if streamable is None:
    streamable = tiling.streamable_loops(region)
  if masked is None:
    masked = tiling.masked_tile_relations(region)
  return cost_model.predict(region, plan.expr, sized, plan.grid, device, plan.split,
                            streamable=streamable, num_stages=plan.num_stages,
                            num_warps=plan.num_warps, masked=masked)


@functools.lru_cache(maxsize=4096)
def _parsed(skeleton: str, loops: tuple[str, ...]) -> tiling.TilingExpr:
  """A candidate's skeleton text parsed (immutable, so shared)."""
  return tiling.parse(skeleton, list(loops))


def _place(region: ir.Region, cand: Candidate, tiles: dict[str, int],
           streamable: frozenset[str], placements: Optional[dict],
           placement_keys: Optional[dict] = None) -> tiling.TilingExpr:
  if placements is None:
    return tiling.place(region, cand.skeleton, tiles, cand.grid, streamable=streamable,
                        split=cand.split)
  skeleton = _parsed(cand.skeleton, tuple(l.name for l in region.loops))
  key = None
  if placement_keys is not None:
    # The key reads the tiles only through the single-tile loops (and checks
    # them, which the search's tiles always pass). Its errors are not kept:
    # their text names a tile count.
    known = (cand.skeleton, cand.grid, cand.split,
             tiling.single_tile_loops(region, tiles, cand.split))
    key = placement_keys.get(known)
  if key is None:
    key = tiling.placement_key(region, skeleton, tiles, cand.grid, cand.split)
    if placement_keys is not None:
      placement_keys[known] = key
  if key not in placements:
    try:
      placements[key] = tiling.place(region, skeleton, tiles, cand.grid,
                                     streamable=streamable, split=cand.split)
    except tiling.PlacementError as e:
      placements[key] = e
  got = placements[key]
  if isinstance(got, tiling.PlacementError):
    raise tiling.PlacementError(str(got))
  return got


# The tile of the ``wide`` seed (``_seeds``).
WIDE_SEED_TILE = 128


def _seeds(space: Space, rng: random.Random) -> list[Candidate]:
  """Deterministic seeds: per grid and skeleton, a balanced tiling, the
  Lagrange tiling of the first deep order, and single tiles on the loops
  that cannot stream."""
  region = space.region
  loops = [l.name for l in region.loops]
  out = []
  balanced = {}
  for l in loops:
    c = space.tile_cands[l]
    under = [t for t in c if t <= 64]
    balanced[l] = under[-1] if under else c[0]
  seeds_tiles = [balanced]
  # Reduction loops that do not stream (a GEMM's k, attention's head
  # dimension of q.k) whole: their operand is loaded once.
  whole_red = {l for l in loops if l in region.reduced_loops() and l not in space.streamable}
  big = {l: space.tile_cands[l][-1] if l in whole_red else balanced[l] for l in loops}
  seeds_tiles.append(big)
  # 128-wide tiles on every loop that long (FlashAttention's backward
  # tile), the others as in ``big``: a merged dk+dv region's plan there
  # differs from the model's other good plans in three loops at once, so
  # neither the genetic search nor the descent reached it (its 64x64 pick
  # with a split head dimension ran 1692 us, the 128x128 plan 863-936 us;
  # H100, seventy-ninth session).
  wide = {l: WIDE_SEED_TILE if WIDE_SEED_TILE in space.tile_cands[l] else big[l]
          for l in loops}
  if wide != big:
    seeds_tiles.append(wide)
  # Whole output rows at the narrowest tiles (``unsplit_floor_tiles``):
  # at d=256 the plan the register floor admits differs from ``big`` in
  # three loops and the skeleton at once, and the descent did not reach
  # it from the model's other plans (2490 against 621 us measured, H100,
  # sixty-fourth session).
  floor = cost_model.unsplit_floor_tiles(region)
  if any(floor[l] > balanced[l] for l in loops):
    whole = {l: big[l] if l in whole_red else
             min([t for t in space.tile_cands[l] if t >= floor[l]] or [space.tile_cands[l][-1]])
             for l in loops}
    seeds_tiles.append(whole)
  try:
    deep = [s for g in space.grids for s in space.skeletons[g] if s.is_deep()]
    if deep:
      perm = tiling.default_grid(region) + tuple(deep[0].loops())
      lt = lagrange.lagrange_tiles(region, [p for p in perm if p in tiling.tiled_loops(region)],
                                   space.device)
      if lt:
        seeds_tiles.append({l: lt.get(l, balanced[l]) for l in loops})
  except Exception as e:  # pylint: disable=broad-except
    logging.info("jaxfuse planner: no Lagrange seed (%s)", e)
  for g in space.grids:
    for sk in space.skeletons[g]:
      for t in seeds_tiles:
        out.append(Candidate(g, str(sk), tuple((l, t[l]) for l in loops), None))
  return out


def _random(space: Space, rng: random.Random) -> Candidate:
  g = rng.choice([g for g in space.grids if space.skeletons[g]])
  sk = rng.choice(space.skeletons[g])
  tiles = tuple((l, rng.choice(c)) for l, c in space.tile_cands.items())
  split = rng.choice(space.splits) if rng.random() < 0.25 else None
  return Candidate(g, str(sk), tiles, split)


def _mutate(space: Space, c: Candidate, rng: random.Random) -> Candidate:
  r = rng.random()
  if r < 0.75:
    tiles = dict(c.tiles)
    movable = [l for l, cs in space.tile_cands.items() if len(cs) > 1]
    if movable:
      l = rng.choice(movable)
      cs = space.tile_cands[l]
      i = cs.index(tiles[l]) if tiles[l] in cs else 0
      j = max(0, min(len(cs) - 1, i + rng.choice((-2, -1, 1, 2))))
      tiles[l] = cs[j]
    return dataclasses.replace(c, tiles=tuple(tiles.items()))
  if r < 0.85:
    return dataclasses.replace(c, split=rng.choice(space.splits))
  g = rng.choice([g for g in space.grids if space.skeletons[g]])
  return dataclasses.replace(c, grid=g, skeleton=str(rng.choice(space.skeletons[g])))


def _size_counts(skeletons, tile_cands, splits) -> dict[str, int]:
  """A space's tile combinations and candidates, for its ``counts``."""
  n_tiles = math.prod(len(c) for c in tile_cands.values())
  return {"tile_combinations": n_tiles,
          "candidates": sum(len(v) for v in skeletons.values()) * n_tiles * len(splits)}


def search(region: ir.Region, device: DeviceSpec, *, seed: int = 0,
           measure: Optional[Callable[[Sequence[Plan]], Sequence[float]]] = None,
           population: int = 96, top_n: int = 8, eps: float = 0.01,
           max_iters: int = 12, min_iters: int = 3,
           streamable: Optional[frozenset[str]] = None,
           space: Optional[Space] = None) -> SearchResult:
  """MCFuser Alg. 1 over ``build_space`` (see the module docstring).

  Where no plan over Rule 3's tiles is legal, the search runs again over
  every power-of-two tile (``pruning.tile_candidates(rule3=False)``), in
  the same space otherwise: Rule 3 only
  steers the search away from padded work, which the model prices. Why: a
  GEMM chain of 33 rows keeps only the padded 64-row tile, and every plan
  at 64 rows and a 16-wide middle is a dot Triton miscompiles (Rule 5), so
  the chain went unfused where 16- or 32-row tiles are correct (sixty-third
  session's fuzzing)."""
  with _searching(region):
    return _search_space(region, device, seed=seed, measure=measure, population=population,
                         top_n=top_n, eps=eps, max_iters=max_iters, min_iters=min_iters,
                         streamable=streamable, space=space)


_collector_lock = threading.Lock()
_collector_pauses = [0, False]   # searches under way, whether the collector ran before


@contextlib.contextmanager
def _searching(region: ir.Region):
  """Python's cyclic garbage collector paused while a search runs, and the
  region's ``plan_memo`` dropped after it. Why the pause: a search
  allocates millions of short-lived objects, and the collections they
  trigger walked every object of the process: 218 young, 20 middle and 2
  full collections took 0.147 of a 0.725 s plan (the merged dk+dv region,
  this 2-core CPU, jax imported), more in a larger program. What the
  search leaves is collected as usual once it ends."""
  with _collector_lock:
    if _collector_pauses[0] == 0:
      _collector_pauses[1] = gc.isenabled()
      gc.disable()
    _collector_pauses[0] += 1
  try:
    yield
  finally:
    region.drop_plan_memo()
    with _collector_lock:
      _collector_pauses[0] -= 1
      if _collector_pauses[0] == 0 and _collector_pauses[1]:
        gc.enable()


def _search_space(region: ir.Region, device: DeviceSpec, *, seed: int,
                  measure: Optional[Callable[[Sequence[Plan]], Sequence[float]]],
                  population: int, top_n: int, eps: float, max_iters: int, min_iters: int,
                  streamable: Optional[frozenset[str]], space: Optional[Space]
                  ) -> SearchResult:
  """``search``'s body."""
  kw = dict(seed=seed, measure=measure, population=population, top_n=top_n, eps=eps,
            max_iters=max_iters, min_iters=min_iters)
  given = space is not None
  space = space or build_space(region, device, streamable=streamable)
  res = _search(region, device, space, **kw)
  if res.ranked or given:
    return res
  tiles = {l.name: pruning.tile_candidates(region, l.name, rule3=False) for l in region.loops}
  if tiles == space.tile_cands:
    return res
  counts = dict(space.counts, rule3_widened=True,
                **_size_counts(space.skeletons, tiles, space.splits))
  again = _search(region, device, dataclasses.replace(space, tile_cands=tiles, counts=counts),
                  **kw)
  rejected = dict(res.rejected)
  for k, v in again.rejected.items():
    rejected[k] = rejected.get(k, 0) + v
  return SearchResult(again.ranked, res.evaluated + again.evaluated,
                      res.iterations + again.iterations, rejected, again.space, again.leaders)


def _search(region: ir.Region, device: DeviceSpec, space: Space, *, seed: int,
            measure: Optional[Callable[[Sequence[Plan]], Sequence[float]]],
            population: int, top_n: int, eps: float, max_iters: int,
            min_iters: int) -> SearchResult:
  """``search`` over one ``space``."""
  rng = random.Random(seed)
  memo: dict[Candidate, Optional[Plan]] = {}
  placements: dict = {}
  checked: dict = {}
  priced: dict = {}
  placement_keys: dict = {}
  rejected: dict[str, int] = {}
  measured: dict[Candidate, float] = {}

  def evaluate(c: Candidate) -> Optional[Plan]:
    if c in memo:
      return memo[c]
    try:
      p = make_plan(region, device, c, space.streamable, placements, space.masked,
                    space.floor_regs, checked, priced, placement_keys)
    except (tiling.PlacementError, ValueError) as e:
      key = rejection_kind(str(e))
      rejected[key] = rejected.get(key, 0) + 1
      p = None
    memo[c] = p
    return p

  if not any(space.skeletons.values()):
    return SearchResult([], 0, 0, {"no tiling expression places every op": 1}, space.counts)
  pop = _seeds(space, rng)
  n_seeds = len(pop)
  while len(pop) < population + n_seeds:
    pop.append(_random(space, rng))
  best_t = math.inf
  it = 0
  stale = 0
  for it in range(1, max_iters + 1):
    plans = [(c, evaluate(c)) for c in pop]
    valid = [(c, p) for c, p in plans if p is not None]
    if not valid:
      # Nothing valid yet: widen with fresh random candidates.
      pop = [_random(space, rng) for _ in range(population)]
      continue
    valid.sort(key=_by_model)
    uniq = _distinct(valid)
    top1_t = uniq[0][1].predicted.time_s
    improved = best_t - top1_t
    if top1_t < best_t:
      best_t = top1_t
    if it >= min_iters and improved < eps * best_t:
      stale += 1
      if stale >= 2:
        break
    else:
      stale = 0
    # Next population: weighted by 1/estimate, one mutation each.
    weights = [1.0 / max(p.predicted.time_s, 1e-12) for _, p in valid]
    parents = rng.choices([c for c, _ in valid], weights=weights, k=population)
    pop = [_mutate(space, c, rng) for c in parents] + [c for c, _ in uniq[:top_n]]

  # Alg. 1 samples the space and can stop short of the model's optimum:
  # the same model reached different large-attention plans from two
  # captures of one function (seventh session). A greedy descent from the
  # best plans, one loop's tile or the grid/skeleton at a time, settles on
  # the local optimum around them.
  seen = _best_first((c, p) for c, p in memo.items() if p is not None)
  starts = seen[:REFINE_STARTS]
  if seen:
    starts += [(c, p) for c, p in _class_leaders(region, seen, starts)[:REFINE_LEADERS]
               if p.predicted.time_s <= DIVERSE_MAX_RATIO * seen[0][1].predicted.time_s]
  _refine(space, evaluate, starts)
  ranked = _best_first((c, p) for c, p in memo.items() if p is not None)
  if ranked:
    c0, p0 = ranked[0]
    memo[c0] = fewer_stages(region, p0, device, space.streamable, space.masked)
    if memo[c0] is not p0:
      ranked = _best_first((c, p) for c, p in memo.items() if p is not None)
  # The model's best plan of each structure other than its pick's, within
  # DIVERSE_MAX_RATIO of the pick (SearchResult.leaders).
  leaders = [(c, p) for c, p in _class_leaders(region, ranked, ranked[:1])
             if p.predicted.time_s <= DIVERSE_MAX_RATIO * ranked[0][1].predicted.time_s]
  if measure is not None and ranked:
    # One batch, so that its kernels compile in parallel within the tuning
    # budget: the model's top_n, then its best plan of each other structure.
    top = ranked[:top_n]
    in_top = {_structure(region, p) for _, p in top}
    batch = top + [(c, p) for c, p in leaders if _structure(region, p) not in in_top][:DIVERSE_N]
    if not _measure_into(measure, batch, measured):
      measure = None

  # Rank every valid plan seen: measured ones by measurement, unmeasured
  # ones by prediction scaled to this region's measurements (median
  # measured/predicted), plans that failed to run last. Why: when the
  # budget runs out before the model's first plan is measured (large
  # attention: its reference and compile took the whole 4 s), one slower
  # plan that happened to be measured must not displace it (it did: 844 vs
  # 585 us on an H200, fourth session).
  # Several candidates can place the same plan; a measurement of one holds
  # for all (an unmeasured twin must not outrank a plan that failed).
  by_plan: dict = {}
  for c, p in memo.items():
    if p is not None and c in measured:
      k = _launched_plan(p)
      by_plan[k] = min(by_plan.get(k, math.inf), measured[c])
  entries = [(by_plan.get(_launched_plan(p)), p) for c, p in memo.items() if p is not None]
  if measure is not None:
    entries += _measure_launch_knobs(region, device, entries, measure)
  ratios = sorted(m / p.predicted.time_s for m, p in entries
                  if m is not None and math.isfinite(m) and p.predicted.time_s > 0)
  scale = ratios[len(ratios) // 2] if ratios else 1.0

  def key(e):
    m, p = e
    if m is None:
      return (0, p.predicted.time_s * scale, str(p))
    return (0, m, str(p)) if math.isfinite(m) else (1, p.predicted.time_s, str(p))
  entries.sort(key=key)
  ranked = [p for _, p in _distinct(entries)]
  return SearchResult(ranked, len(memo), it, rejected, space.counts, [p for _, p in leaders])


# Structural classes whose model-best plan is measured after the descent.
# Why: the model's top plans are near-copies of one structure, so measuring
# them cannot correct an error the model makes about a whole structure. On
# the H100 (2026-11-21, benchmarks/RESULTS.md twelfth session) the best
# plan of another class ran 6-12% faster than the model's pick on MCFuser
# S9, S7, G7 and G8 (16-row attention tiles without a split value axis; an
# unsplit G7), while ranking outside the model's top 8.
DIVERSE_N = 8
# ... among those the model predicts at most this much slower than its best.
# The structures that won were predicted 1.2-1.5x slower (S9's 16-row plan:
# 7.13 vs 4.69 us); each candidate costs part of the tuning budget (its
# kernel compiles under the GIL in Triton's Python front end).
DIVERSE_MAX_RATIO = 1.6


def _structure(region: ir.Region, p: Plan) -> tuple:
  """A plan's structure: its grid (loops of more than one tile), split and
  the tiles of the loops that index an output (rows and columns of what
  each program writes)."""
  out_loops = {l for b in region.outputs for l in region.value_map[b.value].loops}
  tiles = dict(p.tiles)
  grid = tuple(l for l in p.grid if region.extent(l) > tiles[l])
  return (grid, p.split, tuple(sorted((l, t) for l, t in tiles.items() if l in out_loops)))


# A plan of another structure predicted within this factor of the pick is a
# tie the model cannot break (``tied_rival``). Why: on the H100 (seventieth
# session) a one-sequence decoding step in [B, heads, T, D] order had its
# 16-way split pick (head dimension looped inside each key tile) and an
# 8-way split plan (q loaded once, whole head dimension) both predicted at
# 36.7 us; they ran 35.6 and 29.6 us.
TIED_RIVAL_RATIO = 1.02


def tied_rival(region: ir.Region, pick: Plan, alternatives: Sequence[Plan]) -> Optional[Plan]:
  """Where ``pick`` splits a streamed (online-softmax) loop across
  programs, the first plan of ``alternatives`` (the model's best of each
  other structure, best first) of the plain Triton form predicted within
  ``TIED_RIVAL_RATIO`` of the pick; else None. A caller that times the pick
  may time it beside it where ``unsplit_rival`` finds no plan
  (``launch.rival_plan``).

  Example::

      res = plan_region(region, "h100")
      tied_rival(region, res.best, res.alternatives)
  """
  pred = getattr(pick, "predicted", None)
  if pred is None or not _splits_stream(region, pick):
    return None
  return next((p for p in alternatives
               if not p.form and p.predicted is not None
               and p.predicted.time_s <= TIED_RIVAL_RATIO * pred.time_s), None)


def unsplit_rival(region: ir.Region, pick: Plan, alternatives: Sequence[Plan]) -> Optional[Plan]:
  """Where ``pick`` splits a streamed (online-softmax) loop across
  programs, the first plan of ``alternatives`` (``SearchResult.leaders``:
  the model's best of each other structure, best first) that splits
  nothing and is of the plain Triton form; else None. That choice is what
  the model is least sure of (``cost_model.verdict_uncertain``), so a
  caller that times the pick may time this plan beside it
  (``launch.rival_plan``).

  Example::

      res = plan_region(region, "h100")
      unsplit_rival(region, res.best, res.alternatives)
  """
  if not _splits_stream(region, pick):
    return None
  return next((p for p in alternatives if not p.split and not p.form), None)


def _splits_stream(region: ir.Region, pick: Plan) -> bool:
  """Whether ``pick`` splits a streamed (online-softmax) loop across programs."""
  split = getattr(pick, "split", None)
  return bool(split) and split[0] in tiling.streamable_loops(region)


def _class_leaders(region: ir.Region, ranked: list, taken: list) -> list:
  """The first (candidate, plan) of each structure in ``ranked`` (the
  model's best first), skipping the structures of the pairs in ``taken``."""
  done = {_structure(region, p) for _, p in taken}
  out = []
  for c, p in ranked:
    k = _structure(region, p)
    if k not in done:
      done.add(k)
      out.append((c, p))
  return out


def _measure_into(measure, todo, measured: dict) -> bool:
  """Measures the plans of ``todo`` ((candidate, plan) pairs) into
  ``measured``; False when the callback failed (the search goes on with
  the model only). A time of None means not measured (budget spent): the
  model ranks that plan."""
  if not todo:
    return True
  try:
    times = list(measure([p for _, p in todo]))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: measure failed (%s); model only", e)
    return False
  for (c, _), t in zip(todo, times):
    if t is not None:
      measured[c] = float(t) if math.isfinite(t) else math.inf
  return True


# Plans the greedy descent starts from, and its most steps from each.
# 8 starts: with 4, MCFuser G4's descent missed a plan 2.5% better that
# the 5th-8th starts reach; each start costs ~10 ms on the paper cases.
REFINE_STARTS = 8
REFINE_STEPS = 12
# The descent also starts from the model's best plan of this many other
# structures (``_class_leaders``, within ``DIVERSE_MAX_RATIO``): the top
# starts are often one structure, and a move changes one or two tiles or
# the split, not both. With narrow-row copies priced (fifty-third
# session), MCFuser G5's top 8 were all split 8 ways and descended to a
# plan predicted 8.14 us (measured 7.1 us, H100) while the 4-way split's
# leader descends to 8.08 us (measured 6.4 us). Over the 103 benchmark
# regions only G5's pick changed, at 4 leaders as at 8 (planning +15-25%
# candidates, ~0.03 s).
REFINE_LEADERS = 4


def _by_model(cp) -> tuple:
  return (cp[1].predicted.time_s, str(cp[1]))


def _distinct(pairs) -> list:
  """(candidate, plan) pairs in their order, one per launched plan."""
  out, seen = [], set()
  for c, p in pairs:
    k = _launched_plan(p)
    if k not in seen:
      seen.add(k)
      out.append((c, p))
  return out


def _best_first(pairs) -> list:
  """Distinct (candidate, plan) pairs, the model's best first."""
  return _distinct(sorted(pairs, key=_by_model))


def _refine(space: Space, evaluate, starts) -> None:
  """Greedy descent on the model from each of ``starts``: each step takes
  the best of ``_neighbours`` while it improves. What it evaluates lands in
  ``evaluate``'s memo, which the caller ranks."""
  for c, p in starts:
    for _ in range(REFINE_STEPS):
      step = min(((n, q) for n in _neighbours(space, c) if (q := evaluate(n)) is not None),
                 key=_by_model, default=None)
      if step is None or _by_model(step) >= _by_model((c, p)):
        break
      c, p = step


def _neighbours(space: Space, c: Candidate):
  """Candidates one move from ``c``: another tile for one loop, the next
  larger/smaller tile for two loops at once (trading one for the other
  keeps a tile's footprint: 128x128 -> 256x64), another grid/skeleton, or
  another split. Why splits: a split's best tiles differ from the unsplit
  plan's, and the genetic search reached MCFuser G5's split (nx4, 9.27 us
  predicted) or the better one (nx8, 8.22 us) depending on its random path."""
  tiles = dict(c.tiles)
  for l, cands in space.tile_cands.items():
    for t in cands:
      if t != tiles[l]:
        yield dataclasses.replace(c, tiles=tuple({**tiles, l: t}.items()))
  movable = [l for l, cands in space.tile_cands.items() if len(cands) > 1]
  for l1, l2 in itertools.combinations(movable, 2):
    c1, c2 = space.tile_cands[l1], space.tile_cands[l2]
    if tiles[l1] not in c1 or tiles[l2] not in c2:
      continue
    i1, i2 = c1.index(tiles[l1]), c2.index(tiles[l2])
    for d1, d2 in itertools.product((-1, 1), repeat=2):
      if 0 <= i1 + d1 < len(c1) and 0 <= i2 + d2 < len(c2):
        yield dataclasses.replace(
            c, tiles=tuple({**tiles, l1: c1[i1 + d1], l2: c2[i2 + d2]}.items()))
  for g in space.grids:
    for sk in space.skeletons[g]:
      if (g, str(sk)) != (c.grid, c.skeleton):
        yield dataclasses.replace(c, grid=g, skeleton=str(sk))
  for s in space.splits:
    if s != c.split:
      yield dataclasses.replace(c, split=s)


def _launched_plan(p: Plan) -> tuple:
  """What identifies the kernel a plan launches."""
  return (str(p.expr), p.grid, p.tiles, p.split, p.num_warps, p.num_stages)


# (num_warps, num_stages) tried on the best measured plan. The model does
# not price them (MCFuser's does not either); cost_model.choose_warps_stages
# picks the model-only default.
LAUNCH_KNOBS = ((4, 2), (4, 3), (8, 2), (8, 3), (8, 4))


def _measure_launch_knobs(region: ir.Region, device: DeviceSpec, entries,
                          measure) -> list[tuple[float, Plan]]:
  """The best measured plan again with the other ``LAUNCH_KNOBS`` whose
  pipelined buffers fit in shared memory (Rule 4 at that stage count: a
  d=128 attention plan at 4 stages asked Triton for 272 KB and failed to
  compile, H100, 2026-11-22)."""
  done = [(m, p) for m, p in entries if m is not None and math.isfinite(m)]
  if not done:
    return []
  _, best = min(done, key=lambda e: (e[0], str(e[1])))
  variants = [dataclasses.replace(best, num_warps=w, num_stages=st) for w, st in LAUNCH_KNOBS
              if (w, st) != (best.num_warps, best.num_stages)
              and pruning.pipelined_smem_bytes(
                  region, best.expr, tiling.piece_sizes(region, best.expr, best.tile_map, best.grid),
                  st)
              <= device.smem_per_block_bytes]
  if not variants:
    return []
  try:
    times = list(measure(variants))
  except Exception as e:  # pylint: disable=broad-except
    logging.warning("jaxfuse planner: measuring launch knobs failed (%s)", e)
    return []
  return [(float(t), v) for v, t in zip(variants, times)
          if t is not None and math.isfinite(t)]
