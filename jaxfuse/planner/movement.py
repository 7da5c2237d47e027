"""Data movement volume and memory usage (Chimera IV-B, Alg. 1).

Two views of the same quantity:

* ``chimera_volume``: Chimera's Algorithm 1 literally, for a permutation of
  the loops (block execution order) and tile sizes: per IO tensor of each
  contraction, the footprint times the trip counts of the loops from the
  innermost loop that accesses it outwards (observations 1 and 2), with the
  producer's private loops erased before the consumer is visited
  (observation 3); intermediates move nothing. MU is the largest sum of
  footprints of one op. This is what the Lagrange tile solver minimises.
* ``placed_volume``: bytes per tensor of a placed per-program expression
  (``tiling.place``) plus the grid: each Load/Store moves its tile once per
  iteration of every loop around it and once per program. This is what the
  performance model charges, and it sees hoisting (a loop of one tile moves
  nothing). A load the kernel shares with an earlier input of the same
  array (``tiling.shared_loads``) moves nothing.

Counting convention: a tensor's tiles along the loops that index it cover
the tensor exactly (edge tiles are masked, so they move only what is
there); loops that do not index it multiply by their trip count. With tiles
that divide the extents this is the papers' ``footprint x trip counts``;
otherwise it is exact where theirs over-counts the padding. Chimera's
worked example for order ``mlkn`` becomes
``MK⌈L/T_L⌉ + KL⌈M/T_M⌉ + NL⌈M/T_M⌉ + MN⌈L/T_L⌉`` for any tiles.

Example::

    dv, mu, per_tensor = chimera_volume(chain, "mlkn", tiles)
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Union

from jaxfuse import ir
from jaxfuse.planner import tiling

__all__ = ["chimera_volume", "placed_volume", "placed_volumes", "program_trips", "hoisted_load_bytes", "op_footprints", "io_tensors"]


def _trips(ext: int, tile: float, continuous: bool) -> float:
  return ext / tile if continuous else math.ceil(ext / tile)


def io_tensors(region: ir.Region) -> dict[str, str]:
  """Maps each contraction operand/result to the region buffer it stands for
  (an input reached through elementwise ops only, or an output), or ''."""
  inputs = set(region.input_names)
  outputs = set(region.output_names)
  from_input: dict[str, str] = {v: v for v in inputs}
  for op in region.ops:
    if isinstance(op, ir.Elementwise):
      srcs = [from_input.get(a) for a in op.inputs]
      if len(srcs) == 1 and srcs[0]:
        from_input[op.out] = srcs[0]
  to_output: dict[str, str] = {v: v for v in outputs}
  for op in reversed(region.ops):
    if isinstance(op, ir.Elementwise) and op.out in to_output:
      for a in op.inputs:
        # only the operand that carries the data (same loops) stands for it
        if set(region.value(a).loops) == set(region.value(op.out).loops):
          to_output.setdefault(a, to_output[op.out])
  out = {}
  for op in region.contractions:
    for v in (op.lhs, op.rhs, op.out):
      out[v] = from_input.get(v) or to_output.get(v) or ""
  return out


def chimera_volume(region: ir.Region, perm: Union[str, Sequence[str]],
                   tiles: Mapping[str, float], *, continuous: bool = False
                   ) -> tuple[float, float, dict[str, float]]:
  """Chimera Alg. 1: ``(DV, MU, DM per IO tensor)`` in elements.

  ``perm`` is the block execution order, outermost first (a string of
  single-letter loops or a sequence of names); loops of the region missing
  from it (batch loops) are taken as outermost. ``continuous=True`` uses
  ``L/T`` instead of ``⌈L/T⌉`` (the relaxation Lagrange multipliers solve).
  """
  if isinstance(perm, str):
    names = {l.name for l in region.loops}
    perm = list(perm) if all(c in names for c in perm) and not "." in perm \
        else perm.split(".")
  perm = [l for l in region.loops if l.name not in perm] + list(perm)
  perm = [p.name if isinstance(p, ir.Loop) else p for p in perm]
  ext = region.loop_extents
  for l in ext:
    if l not in perm:
      raise ValueError(f"perm: loop {l} missing")
  order = list(perm)
  dv = 0.0
  mu = 0.0
  per: dict[str, float] = {}
  # A tile's extent along each loop, and the loop's trips, once per call.
  held = {l: tiles[l] if continuous else min(tiles[l], ext[l]) for l in ext if l in tiles}
  trips = {l: _trips(ext[l], tiles[l], continuous) for l in ext if l in tiles}
  for op_loops, later, tensors in _chimera_ops(region):
    total_df = 0.0
    for t, tl, is_io in tensors:
      df = math.prod(held[l] for l in tl)
      total_df += math.prod(tiles[l] for l in tl)
      if not is_io:
        continue
      dm = df
      keep_reuse = True
      for l in reversed(order):
        if l not in op_loops:
          continue
        if l in tl:
          keep_reuse = False
          # exact coverage along a loop that indexes the tensor
          dm *= ext[l] / held[l]
        elif not keep_reuse:
          dm *= trips[l]
      per[t] = per.get(t, 0.0) + dm
      dv += dm
    # observation 3: the producer's private loops do not move consumer data
    order = [l for l in order if not (l in op_loops and l not in later)]
    mu = max(mu, total_df)
  return dv, mu, per


def _chimera_ops(region: ir.Region) -> tuple:
  """What ``chimera_volume`` reads of each contraction, in order: its
  loops, the loops of the contractions after it, and (tensor, its loops,
  whether it stands for a region buffer) for its operands and result.
  Derived once per region: the Lagrange solve evaluates the volume
  hundreds of times."""
  got = region._op_memo.get(("chimera_ops", None))  # pylint: disable=protected-access
  if got is not None:
    return got
  io = io_tensors(region)
  vm = region.value_map
  pos = {id(op): i for i, op in enumerate(region.ops)}
  out = []
  for op in region.contractions:
    later = set()
    for other in region.contractions:
      if other is not op and pos[id(other)] > pos[id(op)]:
        later |= set(region.op_loops(other))
    out.append((frozenset(region.op_loops(op)), frozenset(later),
                tuple((t, frozenset(vm[t].loops), bool(io.get(t)))
                      for t in (op.lhs, op.rhs, op.out))))
  got = region._op_memo[("chimera_ops", None)] = tuple(out)  # pylint: disable=protected-access
  return got


def op_footprints(region: ir.Region, tiles: Mapping[str, int]) -> dict[str, int]:
  """Chimera's per-op memory usage: sum of tile footprints (elements) of the
  tensors each contraction touches."""
  vm = region.value_map
  out = {}
  for op in region.contractions:
    out[op.out] = sum(math.prod(tiles[l] for l in vm[t].loops)
                      for t in (op.lhs, op.rhs, op.out))
  return out


def _moved_statements(region: ir.Region, expr: tiling.TilingExpr, grid: Sequence[str],
                      split: Optional[tuple[str, int]], skip: frozenset) -> tuple:
  """What ``placed_volumes`` reads of each Load/Store statement (but those of
  ``skip``: the loads ``tiling.shared_loads`` shares) whatever the tiles,
  once per placed expression, grid and split: (statement, enclosing loops,
  elements of its buffer, the enclosing or grid loops that do not index
  the buffer, its split factor, its item size)."""
  key = ("moved_statements", expr, tuple(grid), split, skip)
  got = region.plan_memo.get(key)
  if got is not None:
    return got
  ext = region.loop_extents
  bufs = {b.value: b for b in region.inputs + region.outputs}
  vm = region.value_map
  out = []
  for st, enclosing in tiling.statement_contexts(expr):
    if st.kind == "C" or st.value in skip:
      continue
    xl = {l for l, s in bufs[st.value].strides if s != 0}
    n = 1
    for l in xl:
      n *= ext[l]
    out.append((st, enclosing, n, tuple(l for l in set(enclosing) | set(grid) if l not in xl),
                split[1] if split and split[0] not in xl else 1,
                ir.dtype_itemsize(vm[st.value].dtype)))
  got = region.plan_memo[key] = tuple(out)
  return got


def program_trips(region: ir.Region, tiles: Mapping[str, int],
                  split: Optional[tuple[str, int]] = None) -> dict[str, int]:
  """Each tiled loop's trips per program (a split loop's share of them):
  what the data-movement model and the cost model count loops by."""
  ext = region.loop_extents
  out = {l: math.ceil(ext[l] / tiles[l]) for l in ext if l in tiles}
  if split:
    out[split[0]] = math.ceil(out[split[0]] / split[1])
  return out


def placed_volume(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
                  grid: Sequence[str], split: Optional[tuple[str, int]] = None,
                  run_fraction: Optional[Mapping[str, float]] = None) -> dict[str, int]:
  """Bytes moved per input/output buffer by a placed plan (all programs).

  ``split=(loop, parts)``: ``loop``'s tiles are shared among ``parts``
  programs, so per program it runs ``⌈trips/parts⌉`` times.
  ``run_fraction``: loop -> the fraction of its trips a program runs (the
  tiles a causal mask hides are skipped); statements inside it move that
  fraction.
  """
  return placed_volumes(region, expr, tiles, grid, split, [run_fraction])[0]


def placed_volumes(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
                   grid: Sequence[str], split: Optional[tuple[str, int]],
                   run_fractions: Sequence[Optional[Mapping[str, float]]]
                   ) -> list[dict[str, int]]:
  """``placed_volume`` at each of ``run_fractions``, what does not depend on
  the fraction derived once (the model prices a masked plan's average and
  longest program)."""
  trips = program_trips(region, tiles, split)
  moved = []
  for st, enclosing, n, looped, parts, size in _moved_statements(
      region, expr, grid, split, frozenset(tiling.shared_loads(region, expr, tiles))):
    for l in looped:
      n *= trips[l]
    moved.append((st.value, enclosing, n * parts, size))
  outs = []
  for run_fraction in run_fractions:
    out: dict[str, int] = {}
    for value, enclosing, n, size in moved:
      for l in enclosing:
        if run_fraction and l in run_fraction:
          n *= run_fraction[l]
      out[value] = out.get(value, 0) + round(n * size)
    outs.append(out)
  return outs


def hoisted_load_bytes(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
                       grid: Sequence[str], split: Optional[tuple[str, int]] = None) -> int:
  """Bytes (all programs) of the loads a plan issues before its loops: the
  Load statements at the top level of an ``expr`` that has a loop (the
  whole-k row tile of ``(Lx0,n(...))``, attention's query tile). They are
  part of ``placed_volume`` too; the cost model prices them apart because
  no loop's software pipeline overlaps them with compute. A plan without
  loops has none."""
  if all(isinstance(n, tiling.Stmt) for n in expr.body):
    return 0
  trips = program_trips(region, tiles, split)
  total = 0
  for st, enclosing, n, looped, parts, size in _moved_statements(
      region, expr, grid, split, frozenset(tiling.shared_loads(region, expr, tiles))):
    if st.kind == "L" and not enclosing:
      for l in looped:
        n *= trips[l]
      total += n * parts * size
  return total
