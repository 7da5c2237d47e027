"""MCFuser's analytical performance model (IV-A, eq. 2-5) on placed plans,
with a per-program critical path measured on Hopper.

MCFuser: ``t = (t_mem + t_comp) * alpha`` with

* ``t_mem = sum over Load/Store statements of bytes x trip counts / W``
  (``movement.placed_volume``: hoisted statements run fewer times),
* ``t_comp = sum over Compute statements of tile FLOPs x trip counts / P``
  (contractions at the tensor-core rate of the input dtype, elementwise ops
  and reductions at the vector rate; recomputation under loops or grid
  axes an op does not use is counted, which is what makes binding a
  consumer-private loop such as ``h`` to program ids cost something),
* ``alpha = (N_block + N_SM) / N_block``.

jaxfuse replaces ``alpha`` by the critical path of one program::

    t = max(t_traffic (+) t_comp, waves * t_program)
    t_traffic = max(min_bytes / W, bytes / (N_SM * W_sm))
    waves = ceil(N_block / (N_SM * programs_per_sm))
    t_program = t_loads + t_comp * N_SM / N_block
                + steps * t_step + starts * NESTED_LOOP_FILL_S,
                x (1 + STAGE2_PENALTY) at 2 stages
    t_loads = (looped / N_block) / W_sm - LOOP_LOAD_OVERLAP * min(that, t_dot share)
              + (1 + HOISTED_LOAD_EXTRA) * (hoisted / N_block) / W_sm

where ``a (+) b`` is ``a + b`` while an SM runs one warpgroup (4 warps) at
a time, and hides part of the shorter under the longer when it runs two
or more (``OVERLAP_TRAFFIC``; and inside ``t_comp``, tensor-core vs
vector/SFU work, ``OVERLAP_COMPUTE``).

``W_sm`` (``device.sm_bandwidth_Bps``) is what one program streams from
L2/HBM (``hoisted``: the bytes of loads issued before the plan's loops,
``looped`` the rest; a program of one warpgroup hides part of its looped
loads under its tensor-core work, see ``LOOP_LOAD_OVERLAP``), ``steps``
the serial pipelined loop steps of a program and ``t_step``
(``device.loop_step_s``) their fixed cost, ``starts`` the times a program
enters a loop nested in another (``inner_loop_starts``: each refills that
loop's pipeline); ``t_traffic`` lets re-reads that programs of one wave
share come from L2 (``t_mem``, all bytes at HBM bandwidth, is still
reported), and ``programs_per_sm`` (at most 2) lets small tiles share an
SM. The last two took large attention
(8x16 heads, T=2048, d=64) from a 21% to a 3% regret. Why: on an H200
(benchmarks/RESULTS.md, fourth session) alpha over-predicted grids of
16-64 programs 3-5x (one SM pulls ~75 GB/s, not W / N_SM = 33 GB/s) and
ranked MCFuser G6's candidates with Spearman 0.67 and a 74% regret. The
constants were fitted on ~1,600 measured candidates (G1-G6, G10, S1-S3,
S7, S9, two large attention cases); the final fidelity run gave regret
<= 2.4% on G1-G4 and S1-S3 and Spearman 0.90-0.95 except S2 (0.78). The
nested-loop refill term, added after, re-scores those 35 saved samples at
Spearman >= 0.86 and regret <= 12.9% except G6 (0.83, as before), and a
fresh run drawn by it (fifth session) gave Spearman 0.93-0.98 and regret
<= 7.2% on G1-G4 and S1-S3; S2's 16-row attention tiles are still priced
~2x too slow (the narrow-row factor comes from GEMM chains). ``Prediction.alpha`` reports
``t / (t_mem + t_comp)``, the factor the grid costs over the roofline sum.

Three refinements of ``t_comp`` that MCFuser's model lacks and that decided
plans on Hopper (benchmarks/RESULTS.md, 2026-11-21: the plain model tied
16-wide and 64-wide key tiles in attention and picked the 16-wide one, 2x
slower than cuDNN):

* a contraction runs at ``P x dot_efficiency``: below ``device.mma_rows``
  rows ``tl.dot`` cannot use wgmma (``NARROW_ROWS_EFFICIENCY`` x rows /
  ``mma_rows``; in a chain, warps that repeat each other's rows,
  ``mma_sync_warps``, each pay), and narrow column and reduction tiles pay per-instruction
  operand traffic and per-step loop overhead (``x / (x + 16)`` each);
* each elementwise op costs the vector ops and SFU results its printed
  Triton spelling compiles to (``ELEMENTWISE_COST``: ``exp`` one SFU
  result, ``tanh`` ten vector ops and two), at the FMA and SFU rates;
* an accumulator fed through a streamed (online) softmax is rescaled once
  per step of the streamed loop (the code generator's
  ``acc *= exp(m_old - m_new)``), which narrow key tiles multiply.

A loop whose tiles a causal mask hides runs only the tiles its program
keeps (``masked_trip_fractions``, from the same relation the code
generator's loop bounds skip by): work, bytes and steps at the average
program's share, and the longest program as a bound (grids of
``MASKED_MIN_WAVES`` or more waves). Priced as full, the plans of 12
recorded causal attention runs (H100, sixteenth and thirty-fifth sessions)
read 1.76-2.89x their measured kernel times, against 1.17-1.52x for 12
non-causal runs; priced this way 0.94-1.50x. A sliding window (a band
bounded on both sides) is priced the same way, and in grids of fewer waves
at its longest program, which runs only the tiles the window spans.

A split reduction (``Plan.split``) adds the second pass: partial results
in fp32 written by the first kernel, read and reduced by the second, plus
one kernel launch.

Example::

    pred = predict(region, expr, tiles, grid, get_device("h100"))
    pred.time_s, pred.alpha, pred.programs
"""

from __future__ import annotations

import functools
import math
from typing import Any, Collection, Mapping, Optional, Sequence

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec, contraction_dtype, region_peak
from jaxfuse.planner import movement, pruning, tiling
from jaxfuse.planner.plan import Prediction

__all__ = ["predict", "elementwise_cost", "ELEMENTWISE_COST", "num_programs", "choose_warps",
           "choose_warps_stages", "programs_per_sm",
           "accumulator_bytes", "epilogue_live_tiles", "is_gemm_epilogue",
           "register_tile_bytes", "register_budget_bytes", "unsplit_floor_regs",
           "unsplit_floor_tiles", "tile_rows",
           "floor_time", "unfused_time", "dot_efficiency", "slower_than_unfused",
           "writes_its_intermediates",
           "verdict_uncertain", "UNCERTAIN_BELOW", "STREAMED_SPLIT_UNCERTAIN_BELOW",
           "masked_trip_fractions", "MASKED_MIN_WAVES",
           "tf32_held_operand_bytes",
           "inner_loop_starts", "tf32_transposed_elements", "UNFUSED_MARGIN",
           "NESTED_LOOP_FILL_S", "TF32_TRANSPOSE_S_PER_ELEMENT", "LOOP_LOAD_OVERLAP",
           "HOISTED_LOAD_EXTRA"]

# Elementwise functions that run on the special-function units.
TRANSCENDENTAL = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
                            "erf", "sin", "cos", "rsqrt", "sqrt", "pow"})
# What one result of an elementwise fn costs as the Triton printer spells it:
# (vector ops, SFU results), counted in the PTX Triton emits for sm_90
# (triton 3.9; the spellings are codegen.triton_printer's). ``tl.log`` and
# ``tl.erf`` are libdevice polynomials on the FMA pipe; ``/`` inside the
# helpers is div.full.f32 (MUFU.RCP plus a scaled multiply). Pricing
# tanh-GELU as one SFU op (its printed tanh_ is an exp, a division and 8
# more ops) ranked plans that recompute a GEMM's GELU for every output tile
# first: MCFuser G9 + GELU ran 77% slower than the best measured plan (H100,
# fortieth session). ``exp`` is priced as softmax prints it, one ex2 after
# codegen.rewrite.fold_exp2 moves log2(e) into the scores' scale. ``div``
# stays one vector op: softmax's division, which streamed plans apply to the
# accumulator after the loop, is priced on the score tile, and the attention
# samples were fitted with that; pricing it at div.full's MUFU.RCP and the
# deferred division at the accumulator (tried, fortieth session) turned
# regrets of 2-9% into 30-58% on two sliding-window and one decode sample.
# Functions not listed cost one vector op, or one SFU result if in
# TRANSCENDENTAL.
ELEMENTWISE_COST = {
    "exp": (0, 1), "exp2": (0, 1), "sqrt": (0, 1), "rsqrt": (0, 1),
    "logistic": (4, 2), "tanh": (10, 2), "erf": (15, 1), "log": (25, 0),
    "log1p": (33, 1), "expm1": (38, 2), "pow": (42, 1), "sign": (4, 0),
}


def elementwise_cost(fn: str) -> tuple[int, int]:
  """(vector ops, SFU results) per result of elementwise ``fn``."""
  if fn in ELEMENTWISE_COST:
    return ELEMENTWISE_COST[fn]
  return (0, 1) if fn in TRANSCENDENTAL else (1, 0)


# Tile width at which operand traffic / loop overhead halves tensor-core
# throughput (see dot_efficiency).
HALF_EFFICIENCY_TILE = 16
# Throughput of tl.dot on fewer rows than wgmma takes (mma.sync on 16-32
# rows), relative to wgmma on Hopper, times rows / mma_rows. First fitted
# at 0.4 with the per-program path on MCFuser G1-G6, G10, S1-S3, S7, S9
# (H200, fourth session: 16-row plans measured 2-3x slower than their
# 64-row neighbours; a flat 0.6 ranked them first). Part of that gap was
# warps repeating each other's rows (``mma_sync_warps``); with those
# copies priced, re-scoring the 38 saved float16 fidelity samples (H100,
# benchmarks/RESULTS.md fifty-third session) gave mean regret 2.04% at
# 0.6-0.7 (2.52% at 0.4 without the copies), and at 0.75 a 32-row
# 256-column MCFuser G6 plan that measured 1.56x the best came first.
# Those samples are all 16-bit chains. Elsewhere the rate stays 0.4
# (``NARROW_ROWS_EFFICIENCY_OTHER``), where keep-or-drop verdicts were
# fitted with it: a region of one contraction, against XLA's few-row GEMM
# price (twenty-ninth session; at 0.6 BERT-Base's 32-token FFN GEMM + GELU,
# measured 5.2 us fused against XLA's 4.5, would be fused without a
# timing), and float32 (TF32) chains, whose mma.sync reads twice the
# operand bytes per flop (at 0.6 float32 MCFuser G4, measured 11.6 us
# fused against XLA's 9.7 in the thirty-fourth session, would be fused
# under tune='model'; the 12 float32 samples' mean regret moved only
# 10.3% -> 9.8%).
NARROW_ROWS_EFFICIENCY = 0.6
NARROW_ROWS_EFFICIENCY_OTHER = 0.4
# A program with 2 pipeline stages keeps one load in flight while it
# computes; at 3 stages the same tiles measured faster (G4: n=64 at 3
# stages 6.3 us vs n=128 at 2 stages 7.5 us; refitted with the L2 and
# co-residency terms on three runs of G1-G4).
STAGE2_PENALTY = 0.15
# Exposed latency each time a program enters a loop nested inside another
# loop (``inner_loop_starts``), about one global-memory round trip. Triton
# software-pipelines a loop's loads across its own iterations only: every
# entry into an inner loop waits for its first tile (pipeline prologue) and
# drains it at the end, and the enclosing loop's own loads (the V tile of
# attention) are not prefetched. Measured on an H200 (fourth-session samples,
# benchmarks/results/fidelity-s4): attention S2 plans whose head dimension is
# split (``n(k(...), ...)``, k=16/32 inside the key loop) ran 1.3-1.5x slower
# than predicted (m=64 n=32 k=32 h=32: 18.3 us measured, 11.9 predicted),
# which with the narrow-row plans held S2's Spearman at 0.78; with this term
# it is 0.86, and every saved sample that met Spearman >= 0.85 and regret
# < 15% still does (G5's regret 0 -> 9.6%; G6 stays at 0.83). Scanned over
# 0.3-0.8 us: 0.4-0.7 us meet the targets, 0.8 us sends G6's regret to 110%.
NESTED_LOOP_FILL_S = 0.5e-6
# Plans whose contractions are all broadcast products (no ``tl.dot``; a
# one-row GEMM's tiles are 1 x n x k): Triton 3.6 software-pipelines only
# loads that feed a dot, so each step of such a program waits for its own
# loads; ``num_stages`` 1 and 3 ran alike. A program then streams at its
# bytes in flight over a memory round trip, not at the pipelined
# ``sm_bandwidth``, and its first loads' latency is exposed once. The
# product runs on the FMA pipe: per multiply-add one FMA, and one convert
# per element of a 16-bit operand tile (``BROADCAST_PRODUCT_OPS``), not a
# tensor-core dot at the narrow-row rate (which priced a one-row GEMM of
# 90 MB at 48 us; it ran 33 us). The two constants were fitted by grid
# search on 750 measured one-row GEMM kernels at 4 warps (H100, Triton 3.6,
# 2026-11-24, benchmarks/RESULTS.md sixty-first session: 8 shapes 768-11008
# wide, tiles n 32-256 x k 16-256, split 1-16); on 50 printed plans per
# shape the model then ranked with Spearman 0.64-0.94, its pick within 3%
# of the best on six shapes and 21-22% off on the two 90 MB ones, where
# its time is HBM traffic and the plans near-tie.
UNPIPELINED_PROGRAM_BANDWIDTH_BPS = 20e9
UNPIPELINED_FILL_S = 2.5e-6
BROADCAST_PRODUCT_OPS = {2: 2, 4: 1}

# An unpipelined stream that reads an input larger than the L2 in rows
# narrower than NARROW_RUN_BYTES (its unit-stride loop's tile: 16 float16
# columns of a weight) reads it from HBM at 1 / NARROW_RUN_FACTOR of the
# bandwidth: the rest of each DRAM burst serves the neighbouring program
# only while it stays in L2. H100, sixty-second session: LLaMA-2-7B's
# one-token down projection (90 MB) ran 36-43 us at n=16 against 33-35 us at
# n=32 to 64 (the model, HBM-bound there, priced them alike and picked
# n=16); TinyLlama's (23 MB) ran 12.0-12.4 us at n=16 and 11.7-12.0 at 32-64.
NARROW_RUN_BYTES = 64
NARROW_RUN_FACTOR = 1.15


def narrow_run_bytes(region: ir.Region, tiles: Mapping[str, int], l2_bytes: int) -> int:
  """Bytes of ``region``'s inputs over ``l2_bytes`` that a plan at
  ``tiles`` reads in rows under ``NARROW_RUN_BYTES`` (see there)."""
  vm = region.value_map
  ext = region.loop_extents
  out = 0
  for b in region.inputs:
    unit = [l for l, st in b.strides if st == 1 and ext[l] > 1]
    item = ir.dtype_itemsize(vm[b.value].dtype)
    size = math.prod(ext[l] for l, st in b.strides if st != 0) * item
    if unit and min(tiles[unit[0]], ext[unit[0]]) * item < NARROW_RUN_BYTES and size > l2_bytes:
      out += size
  return out


# Seconds per element per program for a float32 operand tile that a TF32
# dot (``precision`` other than "ieee") needs K-major (contiguous along the
# contraction) while memory holds it MN-major: Hopper's TF32 wgmma takes
# K-major operands only, so Triton transposes the tile through shared
# memory. Least squares (no intercept) on 11 float32 cases on the H100
# (MCFuser G1, G2, G4, G7, G8, S1, S2, S4, S6, S7, S9; 2026-11-22,
# benchmarks/RESULTS.md seventeenth session): the model without it predicted
# 0.35-0.8x their kernel times. With it the planner picked plans with fewer
# such elements per program, measured 1.13x -> 1.17x XLA over those cases
# (G1 0.64x -> 1.17x; S4 and S6 lost 20-30%); 20 plans refit to 0.24e-9.
# Only wgmma dots pay it (``tf32_transposed_elements``): a dot on fewer rows
# than ``mma_rows`` runs mma.sync, whose operands go from shared memory to
# registers element by element in any order. Counted on those too, 691
# measured float32 candidates of MCFuser G1-G12 (H100, 2026-11-22,
# benchmarks/RESULTS.md nineteenth session) ranked with Spearman 0.81-0.95;
# counted on wgmma dots only, 0.89-0.98.
TF32_TRANSPOSE_S_PER_ELEMENT = 0.23e-9


def tf32_transposed_elements(region: ir.Region, expr: tiling.TilingExpr,
                             tiles: Mapping[str, int], trips, mma_rows: int = 64) -> int:
  """Elements per program of loaded float32 operand tiles that a TF32 wgmma
  dot (at least ``mma_rows`` rows) reads against their memory order: the
  buffer's contiguous loop is not one the dot reduces. The MCFuser chains'
  right-hand operands (``[k, n]``, ``[n, h]``) and attention's V are such
  tiles, attention's K^T is not."""
  vm = region.value_map
  layout = {b.value: dict(b.strides) for b in region.inputs if vm[b.value].dtype == "float32"}
  if not layout:
    return 0   # every 16-bit region: predict() runs for each plan the search scores
  total = 0
  for st, enclosing in tiling.statement_contexts(expr):
    if st.kind != "L" or st.value not in layout:
      continue
    contiguous = [l for l, s in layout[st.value].items() if s == 1]
    for op in region.consumers(st.value):
      if (isinstance(op, ir.Contraction) and op.precision != "ieee"
          and contiguous and contiguous[0] not in op.reduce
          and _rows(region, op, tiles) >= mma_rows):
        total += (math.prod(tiles[l] for l in vm[st.value].loops)
                  * math.prod(trips(l) for l in enclosing))
        break
  return total


def tf32_held_operand_bytes(region: ir.Region, expr: tiling.TilingExpr,
                            tiles: Mapping[str, int]) -> int:
  """Bytes of float32 operand tiles a TF32 dot holds in registers for a
  whole loop: loaded outside a loop that encloses the dot. The printer
  rounds float32 operands to TF32 in registers (``tf32_``), and ptxas
  hoists the rounding of a loop-invariant tile, so that tile stays in
  registers where a 16-bit one stays in shared memory.

  Why: offline sm_90 compiles of 36 float32 plans of the paper cases (Triton
  3.9, 2026-11-22) spilled exactly when accumulators plus these tiles
  passed ``ACC_REGS_PER_THREAD`` (MCFuser G12's pick, 128x128 A tile and
  128x128 accumulator: 55 spill loads, measured 2.1x slower than
  predicted on the H100)."""
  vm = region.value_map
  loaded = {b.value for b in region.inputs if vm[b.value].dtype == "float32"}
  if not loaded:
    return 0
  where = {(st.kind, st.value): enclosing for st, enclosing in tiling.statement_contexts(expr)}
  total = 0
  for op in region.contractions:
    if op.precision != "default" or ("C", op.out) not in where:
      continue
    depth = len(where[("C", op.out)])
    for v in {op.lhs, op.rhs} & loaded:
      if ("L", v) in where and len(where[("L", v)]) < depth:
        total += 4 * math.prod(tiles[l] for l in vm[v].loops)
  return total


_dot_loops = ir.contraction_loops


def is_row_dot(region: ir.Region, op: "ir.Contraction") -> bool:
  """Whether ``op`` pairs its operands element by element: each output
  loop indexes both (``rowsum(do * o)`` in attention's backward). No tile
  makes it a ``tl.dot``: the printer multiplies and sums on the FMA pipe,
  and its rows say nothing of the chain's other dots."""
  rows, cols, _, _ = _dot_loops(region, op)
  return not rows and not cols


def _tensor_core_dots(region: ir.Region) -> tuple:
  got = region._op_memo.get(("tensor_core_dots", None))  # pylint: disable=protected-access
  if got is None:
    got = region._op_memo[("tensor_core_dots", None)] = tuple(  # pylint: disable=protected-access
        op for op in region.contractions if not is_row_dot(region, op))
  return got


def _gemm_dims(region: ir.Region, op: "ir.Contraction",
               sizes: Mapping[str, int]) -> tuple[int, int, int, int]:
  """(rows, cols, batch, red) of ``op`` at ``sizes`` (tiles or extents):
  the products of ``_dot_loops``."""
  return tuple(math.prod(sizes[l] for l in loops) for loops in _dot_loops(region, op))


def _rows(region: ir.Region, op: "ir.Contraction", tiles: Mapping[str, int]) -> int:
  """Rows of ``op``'s output tile: its lhs-only output loops."""
  n = 1
  for l in _dot_loops(region, op)[0]:
    n *= tiles[l]
  return n


def dot_efficiency(region: ir.Region, op: "ir.Contraction", tiles: Mapping[str, int],
                   device: DeviceSpec) -> float:
  """Fraction of the tensor-core peak one ``tl.dot`` reaches at these tiles.

  rows: the lhs-only output loops; cols: the rhs-only output loops; red:
  the contracted loops (batch loops, tile 1, drop out).
  """
  rows, cols, _, red = _gemm_dims(region, op, tiles)
  chain16 = region._op_memo.get(("chain16", op))  # pylint: disable=protected-access
  if chain16 is None:
    chain16 = region._op_memo[("chain16", op)] = (  # pylint: disable=protected-access
        len(_tensor_core_dots(region)) > 1
        and ir.dtype_itemsize(contraction_dtype(region, op)) <= 2)
  narrow = NARROW_ROWS_EFFICIENCY if chain16 else NARROW_ROWS_EFFICIENCY_OTHER
  eta = 1.0 if rows >= device.mma_rows else narrow * rows / device.mma_rows
  h = HALF_EFFICIENCY_TILE
  return eta * cols / (cols + h) * red / (red + h)


def mma_sync_warps(region: ir.Region, tiles: Mapping[str, int], num_warps: int,
                   device: DeviceSpec) -> Optional[tuple[int, int]]:
  """(warps along rows, warps along columns) of the mma.sync layout Triton
  gives a chain of dots on fewer rows than wgmma takes (``mma_rows``), or
  None where the plan's dots run wgmma or the region has one contraction.

  Why: Triton (3.6-3.9, ``warpsPerTileV2`` in AccelerateMatmul) gives every
  dot of a chain the layout it picks for the one it rewrites first, the
  chain's last: all warps along the rows when that dot's tile has at least
  as many rows as columns, else all along the columns. On 16- or 32-row
  tiles warps along the rows hold copies of one another's rows: compiled
  for sm_90, attention S7 at m=16 n=256 h=16 issues 160 mma.sync per warp
  against 48 at h=32, and its warps compute the whole score tile and
  softmax each (242 registers against 126)."""
  dots = _tensor_core_dots(region)
  if len(dots) < 2 or tile_rows(region, tiles) >= device.mma_rows:
    return None
  rows, cols, _, _ = _gemm_dims(region, dots[-1], tiles)
  return (num_warps, 1) if rows >= cols else (1, num_warps)


# Rows and columns of one warp's mma.sync instruction (m16n8k16).
_MMA_SYNC_ROWS, _MMA_SYNC_COLS = 16, 8


def warp_replication(layout: Optional[tuple[int, int]], rows: int, cols: int) -> float:
  """How many warps of ``layout`` (``mma_sync_warps``) compute each element
  of a ``rows`` x ``cols`` tile: warps beyond the tile's 16-row or 8-column
  instruction blocks repeat their neighbours' work."""
  if layout is None:
    return 1.0
  wr, wc = layout
  distinct = (min(wr, max(1, math.ceil(rows / _MMA_SYNC_ROWS)))
              * min(wc, max(1, math.ceil(cols / _MMA_SYNC_COLS))))
  return wr * wc / distinct


def inner_loop_starts(expr: tiling.TilingExpr, trips) -> int:
  """Times one program enters a loop that is nested in another loop of
  ``expr``: for each non-top-level ``LoopNode``, the product of the trip
  counts (``trips(loop)``) of the loops around it. Top-level loops are
  entered once per program, like a loop-free body, and are not counted.
  Why: each entry refills that loop's software pipeline
  (``NESTED_LOOP_FILL_S``)."""
  # An explicit stack, not a recursive closure: the closure's reference to
  # itself is a cycle, garbage that only the collector frees, and the model
  # runs this per plan it prices.
  total = 0
  stack = [(expr.body, 1, False)]
  while stack:
    nodes, entries, nested = stack.pop()
    for n in nodes:
      if isinstance(n, tiling.LoopNode):
        if nested:
          total += entries
        stack.append((n.body, entries * trips(n.loop), True))
  return total


def _rescaled_by_stream(region: ir.Region, op, streamable: frozenset) -> tuple[str, ...]:
  """The streamed loops along which ``op``'s accumulator is rescaled: those
  it reduces over and along which a max it depends on is taken."""
  loops = [l for l in getattr(op, "reduce", ()) if l in streamable]
  if not loops:
    return ()
  seen, stack, maxed = set(), list(op.inputs), set()
  while stack:
    v = stack.pop()
    if v in seen or v in region.input_names:
      continue
    seen.add(v)
    p = region.producer(v)
    if isinstance(p, ir.Reduction) and p.kind == "max":
      maxed.add(p.loop)
    stack.extend(p.inputs)
  return tuple(l for l in loops if l in maxed)


def num_programs(region: ir.Region, tiles: Mapping[str, int], grid: Sequence[str],
                 split: Optional[tuple[str, int]] = None) -> int:
  ext = region.loop_extents
  n = 1
  for g in grid:
    n *= math.ceil(ext[g] / tiles[g])
  if split:
    n *= split[1]
  return n


def accumulator_bytes(region: ir.Region, tiles: Mapping[str, int]) -> int:
  """Registers held by fp32 accumulator tiles of the contractions. A row
  dot whose result tile is one row or column (``rowsum(do * o)``) is held
  like a softmax's row statistics, which ``BASE_REGS_PER_THREAD`` covers.
  Counted, its 512 B pushed the training forward's 128-row tiles just over
  4 warps' budget, which the inference forward's fill exactly, so the
  search fell back to narrower plans. Not counted, the picks of eight
  training forwards ran 0.78-1.04x their old time on an H100 (d128 at
  2048 tokens 611.0 against 734.6 us; eighty-first session)."""
  total = 0
  for op in region.contractions:
    loops = region.value(op.out).loops
    if is_row_dot(region, op) and sum(tiles[l] > 1 for l in loops) <= 1:
      continue
    total += 4 * math.prod(tiles[l] for l in loops)
  return total


def is_gemm_epilogue(region: ir.Region) -> bool:
  """One contraction and no reduction: a GEMM with an elementwise epilogue
  (bias, activation), which keeps no row statistics."""
  return len(region.contractions) == 1 and not any(
      isinstance(op, ir.Reduction) for op in region.ops)


def epilogue_live_tiles(region: ir.Region) -> int:
  """The most fp32 tiles of the contraction's output shape that its
  elementwise epilogue holds at once, the accumulator counted: 1 for a bias
  or ReLU (each result replaces its operand), 2 for GELU and SiLU (``x *
  f(x)`` keeps ``x`` while ``f(x)`` is computed). Regions that are not
  ``is_gemm_epilogue`` give 1.

  The printer computes each elementwise op on the whole fp32 tile, and
  Triton 3.6 keeps an operand that is read again later in registers beside
  the values computed in between (``register_tile_bytes`` says where that
  costs).
  """
  if not is_gemm_epilogue(region):
    return 1
  (op,) = region.contractions
  shape = set(region.value_map[op.out].loops)
  tile_valued = {v.name for v in region.values if set(v.loops) == shape}
  ops = [o for o in region.ops if isinstance(o, ir.Elementwise)]
  last_use: dict[str, int] = {}
  for i, o in enumerate(ops):
    for a in o.args:
      if isinstance(a, str):
        last_use[a] = i
  stored = {b.value for b in region.outputs}
  live = {op.out}
  most = 1
  for i, o in enumerate(ops):
    if o.out in tile_valued:
      live.add(o.out)
    live = {v for v in live if v in stored or last_use.get(v, -1) > i}
    most = max(most, len(live))
  return most


def register_tile_bytes(region: ir.Region, tiles: Mapping[str, int], num_warps: int) -> int:
  """fp32 tile bytes that count against a program's register budget: the
  accumulators, and for a GEMM with an elementwise epilogue run by one
  warpgroup (4 warps), the epilogue's live tiles (``epilogue_live_tiles``).

  Why one warpgroup: of 67 printed kernels of BERT's FFN GEMM + bias +
  exact GELU (512x768x3072; H100, Triton 3.6, fifty-seventh session), the
  11 holding 128 or more accumulator registers per thread spilled and none
  holding 64 did. At 4 warps the spilling plans (64x256, 128x128) ran
  1.13-1.42x their predicted time, and BERT-Large's FFN part, 64x256 at 4
  warps, took 31.6 us per layer against ~19 us for XLA's GEMM and GELU
  kernels. At 8 warps they (128x256, 256x128) ran 0.79-0.82x their
  predicted time, and at 4096 rows 128x256 at 8 warps was the fastest GEMM
  + GELU tiling measured.
  """
  acc = accumulator_bytes(region, tiles)
  return acc * epilogue_live_tiles(region) if num_warps <= 4 else acc


# Plans whose pipelined buffers do not fit at 2 stages are rejected: the
# one 1-stage plan measured (MCFuser G5, tiles m=64 n=128 k=512, Triton
# 3.6, H200, 2026-11-21) compiled but failed the self-check (error 0.98).
MIN_STAGES = 2
# fp32 accumulator registers one thread may hold (of 255) before the
# kernel spills; the rest (BASE_REGS_PER_THREAD) hold operands, softmax
# statistics and addresses. Measured on an H200 (Triton 3.6, 2026-11-21,
# attention 8x16x2048, a sweep of 24 configurations of one kernel variant):
# 4 warps holding 192 per thread ran fastest (d=64, 128x128 scores: 353
# us; d=128, 128x64 scores: 632 us); 256 per thread spilled and ran 2.1x
# slower (d=128, 128x128).
ACC_REGS_PER_THREAD = 192
# The same budget for tiles of 64 rows let in plans (64x256 scores, whole
# short sequences in one tile) that the model ranks above what they measure:
# attention S1-S9 picked them and ran 1.19x cuDNN in kernel time against
# 1.34x with them out (H200, 2026-11-21; S4 5.07 vs 4.06 us). Until the
# model prices what they lose, 64-row tiles keep 128.
NARROW_ACC_REGS_PER_THREAD = 128
# The budget of a region whose key tiles a causal mask or a sliding window
# hides (``tiling.masked_tile_relations``), at any tile height. The mask's
# compares do not wait for the score tile's wgmma, so they are computed
# early and held beside the accumulators: Triton 3.6 compiled for sm_90
# (ptxas -v; benchmarks/RESULTS.md, forty-first session) spills 932-1000 B
# per thread on causal d=64 scores of 128x128 at 4 warps (352-396 B
# unmasked; that loop alone spills 980 B masked and 592 B unmasked), and
# 172-328 B where 128 fp32 registers per thread sufficed unmasked. In the
# six causal and window fidelity samples (299 candidates measured on an
# H100), no plan holding more than 128 per thread ran within 8% of its
# sample's best; the best of each held 64-128.
MASKED_ACC_REGS_PER_THREAD = 128


def choose_warps(region: ir.Region, tiles: Mapping[str, int], masked: bool = False,
                 floor_regs: int = 0) -> int:
  """num_warps: 8 when every contraction has at least 128 rows and either
  the contractions' fp32 tiles exceed what 4 warps hold in registers
  (``register_budget_bytes(4)``) or the region is one contraction with an
  elementwise epilogue (no reduction); else 4.

  Why 128 rows: a Hopper warpgroup (4 warps) issues wgmma on 64 rows, so
  8 warps on a 64-row tile split the columns instead and exchange row
  maxima and sums through shared memory. On an H200 (2026-11-21,
  benchmarks.model_fidelity) every 64-row plan with 8 warps measured
  slower than the same rows with 4 warps: 8.3 vs 6.2 us on attention S1,
  3.1 vs 2.8 us on GEMM chain G3. Why registers: 128-row tiles that fit
  in 4 warps' registers ran faster with 4 warps than with 8 (attention
  8x16x2048, d=64, 128x128 scores: 353 vs 494 us; d=128, 128x64 scores:
  632 vs 698 us). Why one contraction: a GEMM with an elementwise
  epilogue keeps no row statistics, and a second warpgroup halves each
  thread's share of the epilogue; with 128x128 tiles 8 warps ran 5-20%
  faster than 4 (GEMM + bias + SiLU, M=128-4096, K=768-1024, N=3072-4096,
  H100, 2026-11-22, benchmarks/RESULTS.md twenty-sixth session).
  """
  rows = tile_rows(region, tiles)
  if rows < 128:
    return 4
  if is_gemm_epilogue(region):
    return 8
  # The budget the plan is checked against (``masked``, ``floor_regs``: see
  # ``register_budget_bytes``): a masked 128-row tile over 4 warps' budget
  # goes to 8 warps, as an unmasked one does, rather than being rejected.
  budget = register_budget_bytes(4, rows, masked=masked, floor_regs=floor_regs)
  return 8 if accumulator_bytes(region, tiles) > budget else 4


def tile_rows(region: ir.Region, tiles: Mapping[str, int]) -> int:
  """The fewest rows (wgmma M) among the plan's contraction tiles."""
  return min([_rows(region, op, tiles) for op in _tensor_core_dots(region)] or [0])


def choose_warps_stages(region: ir.Region, expr: tiling.TilingExpr,
                        tiles: Mapping[str, int], device: DeviceSpec, masked: bool = False,
                        floor_regs: int = 0) -> tuple[int, int]:
  """(num_warps, num_stages) for a placed plan: ``choose_warps``, and the
  larger of 3 and 2 stages whose pipelined buffers
  (``pruning.pipelined_smem_bytes``) fit in shared memory (``MIN_STAGES``
  when neither does; the planner then rejects the plan)."""
  warps = choose_warps(region, tiles, masked, floor_regs)
  for stages in (3, 2):
    if pruning.pipelined_smem_bytes(region, expr, tiles, stages) <= device.smem_per_block_bytes:
      return warps, stages
  return warps, MIN_STAGES


# Programs co-resident on one SM that the per-program path credits (more
# fit when small tiles leave shared memory and registers free, but they
# then share the SM's issue slots and L2 bandwidth).
MAX_PROGRAMS_PER_SM = 2
# Registers per thread besides the fp32 accumulators (operands, addresses,
# softmax statistics).
BASE_REGS_PER_THREAD = 64
# Fractions of the shorter of two kinds of work hidden under the longer when
# an SM holds two or more warpgroups (co-resident programs, or the two
# warpgroups of an 8-warp program): tensor-core vs vector/SFU work, and
# L2/HBM traffic vs both. One warpgroup alone runs them in turn (Triton 3.6
# waits on each wgmma before the softmax reads it), several drift out of
# phase and one's softmax runs under another's wgmma. Fitted on an H100
# (2026-11-21, benchmarks/RESULTS.md, seventh session: attention 8x16 heads,
# T=2048/4096, d=64/128, 36 tile/warp/stage configurations each): without
# them the model picked 256x128 tiles at 8 warps for d=64 (374 us) over
# 128-row 4-warp tiles that ran 327-338 us, and priced every large plan
# 1.4-1.7x too slow.
OVERLAP_COMPUTE = 0.5
OVERLAP_TRAFFIC = 0.25
# Within one program of one warpgroup, the fraction of its in-loop loads'
# time that runs under its tensor-core work (up to the smaller of the two):
# Triton's software pipeline issues the loads of later steps before it
# waits on this step's wgmma. Loads a plan issues before its loops
# (``movement.hoisted_load_bytes``: the whole-k row tile of
# ``(Lx0,n(...))``) overlap nothing and cost ``1 + HOISTED_LOAD_EXTRA``
# times their bytes at ``W_sm``. Fitted together (0.6, 1.0) on 38 saved
# float16 fidelity samples (H100, benchmarks/results s13, s17, s39, s46,
# s47, s51; 1,900 measured plans) by re-scoring them
# (``model_fidelity --rescore``): the purely additive program priced split
# GEMM-chain plans with a k loop 20-30% above their kernel times and
# ranked the hoisted whole-k plans first; MCFuser G5's regret went 21-22%
# -> 9-10%, attention S6's 14% -> 1%, the mean regret 4.1% -> 2.6%, the
# worst 22% -> 11%, samples at the targets 36 -> 38 of 38, with the
# lowest Spearman 0.87 -> 0.85 (attention S2 and S3); the command is in
# RESULTS. Applied to two warpgroups as well, it ranked a 128x128 8-warp
# sliding-window plan first (30% regret); applied with TF32 transposes,
# float32 MCFuser G11's regret rose 17% -> 27%. Measured with them (H100,
# 2026-11-24, benchmarks/RESULTS.md fifty-second session): a fresh
# fidelity run gave Spearman 0.86-0.95 and regret <= 5.5% on G1-G4 and
# S1-S3 and 0% on G5; the five paper regions whose pick changed ran 17%
# faster (MCFuser G5), 11% (S6), 4% (Chimera G2) and 2-3% slower
# (MCFuser G7, Chimera G6); the 33 cases' kernels 2.03x ``jax.jit``'s under
# tune='auto' (1.97x before).
LOOP_LOAD_OVERLAP = 0.6
HOISTED_LOAD_EXTRA = 1.0


def _overlapped(a: float, b: float, fraction: float) -> float:
  """Time of two kinds of work when ``fraction`` of the shorter one runs
  under the longer."""
  return max(a, b) + (1.0 - fraction) * min(a, b)


def programs_per_sm(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
                    num_stages: int, device: DeviceSpec,
                    num_warps: Optional[int] = None,
                    smem_bytes: Optional[int] = None) -> int:
  """Programs of a plan one SM runs at once: limited by pipelined shared
  memory, threads (2048 per SM) and registers, at most
  ``MAX_PROGRAMS_PER_SM``. ``num_warps`` defaults to ``choose_warps``'s;
  ``smem_bytes`` to ``pruning.pipelined_smem_bytes`` at ``num_stages``
  (``predict`` passes the value it reports)."""
  threads = (num_warps or choose_warps(region, tiles)) * 32
  if smem_bytes is None:
    smem_bytes = pruning.pipelined_smem_bytes(region, expr, tiles, num_stages)
  smem = max(1, smem_bytes)
  regs = min(255.0, BASE_REGS_PER_THREAD + accumulator_bytes(region, tiles) / 4 / threads)
  return max(1, min(MAX_PROGRAMS_PER_SM, device.smem_per_block_bytes // smem,
                    2048 // threads, int(device.regs_per_sm // (threads * regs))))


def register_budget_bytes(num_warps: int, rows: int = 128, masked: bool = False,
                          floor_regs: int = 0) -> int:
  """Bytes of fp32 accumulators a program of ``num_warps`` warps, on tiles
  of ``rows`` rows, may hold in registers (see ``ACC_REGS_PER_THREAD``);
  ``masked``: the region's key tiles are masked
  (``MASKED_ACC_REGS_PER_THREAD``); ``floor_regs``: per-thread registers
  the budget does not go below (``unsplit_floor_regs``)."""
  if masked:
    per_thread = MASKED_ACC_REGS_PER_THREAD
  else:
    per_thread = ACC_REGS_PER_THREAD if rows >= 128 else NARROW_ACC_REGS_PER_THREAD
  return num_warps * 32 * max(per_thread, floor_regs) * 4


def unsplit_floor_regs(region: ir.Region) -> int:
  """fp32 accumulator registers per thread of the narrowest plan that keeps
  each output row whole: one warpgroup (4 warps) on 64 rows, every
  contraction that feeds no other one over its whole columns (attention's
  head dimension, padded to a power of two as tiles are), the others 64
  wide along the loop their consumer reduces (the key tile). At most
  ``ACC_REGS_PER_THREAD``.

  Why: ``NARROW_ACC_REGS_PER_THREAD`` and ``MASKED_ACC_REGS_PER_THREAD``
  were set where head dimensions of 64-128 leave whole-row plans under
  them. At d=256 (Gemma) the output tile alone holds 128 registers per
  thread at 64 rows, so every whole-row plan was rejected and the planner
  split the head dimension over programs, computing the scores and their
  softmax once per part. Measured on an H100 (Triton 3.6, 2026-11-25,
  sixty-fourth session; 1x16 heads over 8 key/value heads, 4096 tokens,
  float16): the split picks ran 1181 us (causal, soft-capped scores), 640
  us (causal) and 2490 us (no mask: the 192-register 128x128 plan, which
  spills) against 399, 340 and 621 us for 64x64 score tiles over whole
  rows at 4 warps, which hold this floor (160 registers), the fastest of
  88 plans measured in each case."""
  regs = accumulator_bytes(region, unsplit_floor_tiles(region)) // (4 * 32 * 4)
  return min(regs, ACC_REGS_PER_THREAD)


def unsplit_floor_tiles(region: ir.Region) -> dict[str, int]:
  """The tiles of ``unsplit_floor_regs``'s plan (loops it does not name: 1).

  Example::

      unsplit_floor_tiles(examples.attention(1, 16, 4096, 4096, 256))
      # rows 64, keys 64, head dimension 256
  """
  vm = region.value_map
  ext = region.loop_extents
  tiles = {l: 1 for l in ext}
  for op in region.contractions:
    cols = ir.contraction_loops(region, op)[1]
    consumers = [c for c in region.contractions if c is not op and _reads(region, c, op.out)]
    if consumers:
      for c in consumers:
        for l in set(c.reduce) & set(vm[op.out].loops):
          tiles[l] = min(64, tiling.next_pow2(ext[l]))
    else:
      for l in cols:
        tiles[l] = tiling.next_pow2(ext[l])   # the padded tile the budget check sees
  for op in region.contractions:
    rows = ir.contraction_loops(region, op)[0]
    left = 64
    for l in sorted(rows, key=lambda l: -ext[l]):
      if tiles[l] == 1 and left > 1:
        tiles[l] = min(left, tiling.next_pow2(ext[l]))
        left //= tiles[l]
  return tiles


def _reads(region: ir.Region, consumer: "ir.Contraction", value: str) -> bool:
  """Whether ``consumer`` reads ``value`` through elementwise ops and
  reductions (not through another contraction)."""
  return region.computed_from((consumer.lhs, consumer.rhs), value, through_contractions=False)


# Masked tiles are priced as skipped only where the grid runs at least this
# many waves. Then longest-first issue (the code generator's
# ``heavy_first_loops``) evens the load over the waves and the average
# program sets the time. In one wave every program starts at once and the
# one that runs every tile sets it; SMs that also hold a second program run
# a full-length one beside it, which the full-work throughput term stands
# for. At 2-3 waves the per-wave average misprices the few heavy programs,
# and the grids it would pick there (MCFuser S2 causal: 192-384 programs with
# 2 per SM) are the partly co-resident ones the model already prices ~20%
# fast (S2 non-causal, 192 programs: 6.7 predicted, 8.0 us measured; H100
# fidelity sample of the thirteenth session). Not priced: where heads that
# read different keys run one after another (plain multi-head attention),
# each head's longest programs start after the previous head's shortest,
# and the grid's last wave holds one head's long programs (a 3-14% tail in
# simulation; forty-fourth session of benchmarks/RESULTS.md).
MASKED_MIN_WAVES = 4


def masked_trip_fractions(region: ir.Region, expr: tiling.TilingExpr,
                          tiles: Mapping[str, int], grid: Sequence[str],
                          split: Optional[tuple[str, int]] = None,
                          masked: Optional[Mapping[str, Any]] = None
                          ) -> dict[str, tuple[float, float]]:
  """Loop -> (mean, max) over programs of the fraction of its trips a
  program runs, for each sequential loop whose tiles a causal mask or a
  sliding window hides (``masked``: ``tiling.masked_tile_relations``, the
  ``streaming.Band`` the code generator's loop bounds skip by) relative to
  a grid loop or a loop around it. Why: the code generator skips those
  tiles, so causal attention runs about half the key steps of the full loop
  (a window of w keys, about w / T of them); priced as full, every causal
  plan read ~2x its measured time and its tiles were chosen for the full
  loop."""
  if masked is None:
    masked = tiling.masked_tile_relations(region)
  if not masked:
    return {}
  ext = region.loop_extents
  out = {}
  seen = set()
  for _, enclosing in tiling.statement_contexts(expr):
    for depth, l in enumerate(enclosing):
      if l in seen or l not in masked:
        continue
      band = masked[l]
      other = band.other
      if other in grid:
        per_program = True
      elif other in enclosing[:depth]:
        per_program = False
      else:
        continue
      seen.add(l)
      parts = split[1] if split and split[0] == l else 1
      bounds = (band.lower, band.upper)
      mean, most = _masked_trips(ext[l], tiles[l], ext[other], tiles[other], bounds, parts)
      if not per_program:   # a program runs every tile of the other loop
        most = _part_max(ext[l], tiles[l], ext[other], tiles[other], bounds, parts)
      out[l] = (mean, most)
  return out


@functools.lru_cache(maxsize=4096)
def _masked_trip_counts(ext_l: int, t_l: int, ext_o: int, t_o: int,
                        bounds: tuple[Optional[int], Optional[int]],
                        parts: int) -> tuple[tuple[int, ...], int]:
  """Trips of loop l that the code generator runs for each (tile of the
  other loop, part of l) pair, as its loop bounds compute them, and the
  full per-part trip count. ``bounds``: the ``streaming.Band``'s (lower,
  upper) offsets, i in [o + lower, o + upper]."""
  lower, upper = bounds
  full = math.ceil(math.ceil(ext_l / t_l) / parts)
  per = full * t_l
  counts = []
  for i in range(math.ceil(ext_o / t_o)):
    first, last1 = i * t_o, (i + 1) * t_o
    for p in range(parts):
      lo, hi = p * per, min(ext_l, p * per + per)
      if upper is not None:
        hi = min(hi, last1 + upper)
      if lower is not None:
        lo = max(lo, (first + lower) // t_l * t_l)
      counts.append(max(0, math.ceil((hi - lo) / t_l)))
  return tuple(counts), full


def _masked_trips(ext_l, t_l, ext_o, t_o, bounds, parts) -> tuple[float, float]:
  counts, full = _masked_trip_counts(ext_l, t_l, ext_o, t_o, bounds, parts)
  return sum(counts) / (len(counts) * full), max(counts) / full


def _part_max(ext_l, t_l, ext_o, t_o, bounds, parts) -> float:
  """The largest fraction one part runs over all tiles of the other loop
  (when that loop is sequential, a program runs all of its tiles)."""
  counts, full = _masked_trip_counts(ext_l, t_l, ext_o, t_o, bounds, parts)
  tiles_o = len(counts) // parts
  return max(sum(counts[i * parts + p] for i in range(tiles_o))
             for p in range(parts)) / (tiles_o * full)


def is_unpipelined(region: ir.Region, tiles: Mapping[str, int],
                   streamable: Optional[frozenset] = None) -> bool:
  """Whether every contraction of ``region`` prints as a broadcast product
  at ``tiles`` (``pruning.broadcast_product``), so that no load of the
  program is software-pipelined (see ``UNPIPELINED_PROGRAM_BANDWIDTH_BPS``),
  in a region without an online softmax. Such a softmax at one query row
  (multi-head decoding) keeps the narrow-row dot price it was fitted with:
  priced this way, the model's pick for a 4-batch 32-head decoding step ran
  127 us against 93 us for the best plan measured (H100, sixty-first
  session). ``streamable``: ``tiling.streamable_loops(region)`` where the
  caller has it."""
  if not region.contractions:
    return False
  if streamable is None:
    streamable = tiling.streamable_loops(region)
  if streamable:
    return False
  key = ("unpipelined", tuple(tiles.items()))
  got = region.plan_memo.get(key)
  if got is None:
    got = region.plan_memo[key] = all(
        pruning.broadcast_product(region, op, tiles) is not None for op in region.contractions)
  return got


def predict(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
            grid: Sequence[str], device: DeviceSpec,
            split: Optional[tuple[str, int]] = None,
            streamable: Optional[frozenset] = None,
            num_stages: Optional[int] = None,
            num_warps: Optional[int] = None,
            masked: Optional[Mapping[str, Any]] = None) -> Prediction:
  """The model's time for a placed plan (see the module docstring).
  ``streamable``: loops the code generator streams (default
  ``tiling.streamable_loops(region)``); ``num_stages``, ``num_warps``: the
  plan's pipeline depth and warps (default: ``choose_warps_stages``'s);
  ``masked``: loops whose masked tiles the code generator skips (default
  ``tiling.masked_tile_relations(region)``, see ``masked_trip_fractions``).
  Where a plan of ``MASKED_MIN_WAVES`` or more waves skips tiles, programs
  differ in length: the grid's time is its average program's per wave, and
  at least its longest program's; with fewer waves, the longest program's
  (full length under a causal mask, a window's span under a window)."""
  if streamable is None:
    streamable = tiling.streamable_loops(region)
  if num_stages is None:
    num_stages = choose_warps_stages(region, expr, tiles, device)[1]
  ext = region.loop_extents
  vm = region.value_map

  trip = movement.program_trips(region, tiles, split)

  def trips(l):
    return trip[l]

  programs = num_programs(region, tiles, grid, split)
  sms = device.sm_count
  if masked is None:
    masked = tiling.masked_tile_relations(region)
  # The search's warps (make_plan) when the caller gives none.
  num_warps = num_warps or choose_warps(region, tiles, bool(masked), unsplit_floor_regs(region))
  smem_bytes = pruning.pipelined_smem_bytes(region, expr, tiles, num_stages)
  pps = programs_per_sm(region, expr, tiles, num_stages, device, num_warps, smem_bytes)
  waves = math.ceil(programs / (sms * pps))
  fractions = {}
  if masked:
    fractions = masked_trip_fractions(region, expr, tiles, grid, split, masked)
    if waves < MASKED_MIN_WAVES:
      # Few waves: the longest program sets the time. Under a one-sided
      # (causal) band that is the full loop, priced as such; under a
      # window, the tiles its span covers.
      fractions = {l: (f[1], f[1]) for l, f in fractions.items()
                   if masked[l].lower is not None and masked[l].upper is not None}
  mean = {l: f[0] for l, f in fractions.items()}
  layout = mma_sync_warps(region, tiles, num_warps, device)
  unpipelined = is_unpipelined(region, tiles, streamable)
  # The longest program's too, under a mask (see t_grid below).
  most = {l: f[1] for l, f in fractions.items()}
  works = _statement_work(region, expr, tiles, grid, split, trips, streamable, device,
                          [mean, most] if fractions else [mean], layout, unpipelined)
  flops, t_dot, vec, sfu, steps = works[0]
  volumes = movement.placed_volumes(region, expr, tiles, grid, split,
                                    [mean, most] if fractions else [mean])
  bytes_moved = sum(volumes[0].values())
  t_mem = bytes_moved / device.mem_bandwidth_Bps
  t_comp = t_dot + vec / device.vector_flops + sfu / device.sfu_ops
  extra = 0.0
  if split:
    out_elems = sum(math.prod(ext[l] for l in vm[b.value].loops) for b in region.outputs)
    partial = out_elems * split[1] * 4
    final = sum(math.prod(ext[l] for l in vm[b.value].loops) *
                ir.dtype_itemsize(vm[b.value].dtype) for b in region.outputs)
    # first pass writes fp32 partials instead of the outputs; second pass
    # reads them and writes the outputs.
    t_mem += (partial - final) / device.mem_bandwidth_Bps
    extra = (partial + final) / device.mem_bandwidth_Bps + device.kernel_launch_s
    bytes_moved += 2 * partial
  # Warpgroups (4 warps) that run at once: within one program, and on
  # every SM (co-resident programs count when each SM gets them; in a
  # partial wave the SMs holding two programs set the time, and an
  # attention sample, S2, ranked such grids 26% too fast when they did).
  groups = max(1, num_warps // 4)
  per_sm = max(1, min(pps, programs // sms)) * groups
  share = min(1.0, max(0.0, per_sm - 1.0))

  hoisted = movement.hoisted_load_bytes(region, expr, tiles, grid, split)
  program_bw = UNPIPELINED_PROGRAM_BANDWIDTH_BPS if unpipelined else device.sm_bandwidth_Bps

  def program_time(t_dot, t_comp, moved, steps, scale):
    def run_trips(l):
      return trips(l) * scale.get(l, 1.0)
    t_vec = t_comp - t_dot
    t_busy = _overlapped(t_dot, t_vec, OVERLAP_COMPUTE) if groups >= 2 else t_comp
    transposed = tf32_transposed_elements(region, expr, tiles, run_trips if scale else trips,
                                          device.mma_rows)
    t_looped = (moved - hoisted) / programs / program_bw
    t_hoisted = hoisted / programs / program_bw
    # In-loop loads that land while the program's one warpgroup waits on
    # its wgmma (see LOOP_LOAD_OVERLAP; two warpgroups already overlap
    # through OVERLAP_COMPUTE, and TF32 transposes sit between the two).
    hidden = 0.0
    if groups == 1 and not transposed:
      hidden = LOOP_LOAD_OVERLAP * min(t_looped, t_dot * sms / programs)
    t = (t_looped - hidden + t_hoisted * (1.0 + HOISTED_LOAD_EXTRA)
         + t_busy * sms / programs + steps * device.loop_step_s
         + inner_loop_starts(expr, run_trips if scale else trips) * NESTED_LOOP_FILL_S
         + transposed * TF32_TRANSPOSE_S_PER_ELEMENT)
    if unpipelined:
      return t
    return t * (1.0 + STAGE2_PENALTY) if num_stages <= 2 else t

  t_program = program_time(t_dot, t_comp, bytes_moved, steps, mean)
  t_grid = waves * t_program
  if fractions:
    # The longest program (heavy programs are issued first, so a partial
    # last wave holds short ones and the average sets the waves' time).
    _, l_dot, l_vec, l_sfu, l_steps = works[1]
    l_moved = sum(volumes[1].values())
    if split:
      l_moved += 2 * partial
    l_comp = l_dot + l_vec / device.vector_flops + l_sfu / device.sfu_ops
    t_grid = max(t_grid, program_time(l_dot, l_comp, l_moved, l_steps, most))
  t_vec = t_comp - t_dot
  t_shared = _overlapped(t_dot, t_vec, OVERLAP_COMPUTE * share)
  # Throughput side: re-reads of tiles that concurrently running programs
  # share come from L2, so traffic is bounded by HBM for the bytes the
  # region must move and by the SMs' L2 bandwidth for all of them.
  hbm = region.min_bytes()
  if unpipelined:
    hbm += (NARROW_RUN_FACTOR - 1.0) * narrow_run_bytes(region, tiles, device.l2_bytes)
  t_traffic = max(hbm / device.mem_bandwidth_Bps,
                  bytes_moved / (sms * device.sm_bandwidth_Bps))
  t_throughput = _overlapped(t_traffic, t_shared, OVERLAP_TRAFFIC * share)
  body = max(t_throughput, t_grid)
  if unpipelined:
    body += UNPIPELINED_FILL_S
  time_s = body + extra
  return Prediction(time_s=time_s, t_mem_s=t_mem, t_comp_s=t_comp,
                    alpha=body / (t_mem + t_comp) if t_mem + t_comp > 0 else 1.0,
                    bytes_moved=int(bytes_moved), flops=int(flops),
                    smem_bytes=smem_bytes,
                    programs=programs, t_program_s=t_program, steps=math.ceil(steps),
                    t_dot_s=t_dot, t_vector_s=t_vec, t_traffic_s=t_traffic,
                    waves=waves)


def _work_statements(region: ir.Region, expr: tiling.TilingExpr, grid: Sequence[str],
                     streamable: frozenset) -> tuple:
  """What ``_statement_work`` reads of each Compute statement whatever the
  tiles, once per placed expression, grid and streamable loops (the search
  prices one placement at several tiles): (enclosing loops, the op's
  loops inside ``grid`` or the enclosing ones, its loops outside them,
  the other enclosing or grid loops, the op, its kind, the kind's
  coefficient, the op's loops on the dots' rows and the rest of them,
  and the loops along which a dot's accumulator is rescaled)."""
  key = ("work_statements", expr, tuple(grid), streamable)
  got = region.plan_memo.get(key)
  if got is not None:
    return got
  row_loops = set()
  for op in _tensor_core_dots(region):
    row_loops.update(_dot_loops(region, op)[0])
  out = []
  for st, enclosing in tiling.statement_contexts(expr):
    if st.kind != "C":
      continue
    op = region.producer(st.value)
    ol = region.op_loops(op)
    around = set(grid) | set(enclosing)
    coeff, rescaled = 0, ()
    if isinstance(op, ir.Contraction):
      size = ir.dtype_itemsize(contraction_dtype(region, op))
      kind = "row" if is_row_dot(region, op) else "dot"
      coeff = BROADCAST_PRODUCT_OPS.get(size, 1)
      rescaled = tuple(l for l in _rescaled_by_stream(region, op, streamable) if l in around)
    elif isinstance(op, ir.Elementwise):
      kind, coeff = "ew", elementwise_cost(op.fn)
    else:
      kind = "vec"
    out.append((enclosing, tuple(l for l in ol if l in around),
                tuple(l for l in ol if l not in around),
                tuple(l for l in around if l not in ol), op, kind, coeff,
                tuple(l for l in ol if l in row_loops),
                tuple(l for l in ol if l not in row_loops), rescaled))
  got = region.plan_memo[key] = tuple(out)
  return got


def _statement_work(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
                    grid: Sequence[str], split: Optional[tuple[str, int]], trips,
                    streamable: frozenset, device: DeviceSpec,
                    scales: Sequence[Mapping[str, float]],
                    layout: Optional[tuple[int, int]] = None,
                    unpipelined: bool = False
                    ) -> list[tuple[float, float, float, float, float]]:
  """(flops, tensor-core seconds, vector ops, SFU ops, steps of the longest
  loop nest) of a placed plan's Compute statements over all programs, per
  mapping of ``scales``: with the trips of each loop in it times its
  fraction (the model prices a masked plan's average and longest program;
  what does not depend on the fraction is derived once for both).
  ``layout``: the chain's mma.sync warps (``mma_sync_warps``); the
  tensor-core and vector work of a tile its warps repeat counts once per
  copy (dots, and the ops on tiles of the dots' rows, which share their
  layout; an op on a loaded operand tile alone keeps a blocked layout over
  all warps). ``unpipelined``: the plan's contractions are broadcast
  products (``is_unpipelined``), priced on the FMA pipe."""
  trip = {l: trips(l) for l in tiles}
  # Per Compute statement: (enclosing loops, their trips, work at full
  # trips, copies, kind, its two coefficients, tiles of the loops its
  # accumulator is rescaled along).
  terms = []
  for (enclosing, ol_around, ol_within, others, op, kind, coeff, ol_rows, ol_rest,
       rescaled) in _work_statements(region, expr, grid, streamable):
    n = 1
    for l in enclosing:
      n *= trip[l]
    work = 1
    for l in ol_around:
      work *= tiles[l] * trip[l]
    for l in ol_within:
      work *= tiles[l]
    for l in others:
      work *= trip[l]
    if split:
      # every part runs this statement; per-program trips of the split loop
      # are already its share
      work *= split[1]
    copies = 1.0
    a, b = 0, 0
    if kind in ("row", "dot"):
      if layout is not None:
        rows, cols, _, _ = _gemm_dims(region, op, tiles)
        copies = warp_replication(layout, rows, cols)
      if kind == "row" or unpipelined:
        kind, a = "fma", coeff
      else:
        peak = device.dot_peak(contraction_dtype(region, op), op.precision)
        a = peak * dot_efficiency(region, op, tiles, device)
    else:
      if layout is not None and ol_rows:
        copies = warp_replication(layout, math.prod(tiles[l] for l in ol_rows),
                                  math.prod(tiles[l] for l in ol_rest))
      if kind == "ew":
        a, b = coeff
    terms.append((enclosing, n, work, copies, kind, a, b,
                  tuple(tiles[l] for l in rescaled if trip[l] > 1) if kind == "dot" else ()))

  out = []
  for scale in scales:
    flops = 0
    vec = 0
    sfu = 0
    t_dot = 0.0
    steps = 1
    for enclosing, n, work, copies, kind, a, b, rescaled in terms:
      run = 1.0
      for l in enclosing:
        if l in scale:
          run *= scale[l]
      steps = max(steps, n * run if scale else n)
      if run != 1.0:
        work *= run
      if kind == "fma":
        flops += 2 * work
        vec += copies * work * a
      elif kind == "dot":
        flops += 2 * work
        t_dot += copies * 2 * work / a
        for t in rescaled:
          vec += copies * (work // t if run == 1.0 else work / t)
      elif kind == "ew":
        vec += copies * a * work
        sfu += copies * b * work
      else:
        vec += copies * work
    out.append((flops, t_dot, vec, sfu, steps))
  return out


def floor_time(region: ir.Region, device: DeviceSpec) -> float:
  """Roofline floor: max(FLOPs / P, minimum bytes / W)."""
  return max(region.flops() / region_peak(region, device),
             region.min_bytes() / device.mem_bandwidth_Bps)


# How XLA's own GEMM kernels (cuBLAS, or its Triton GEMM fusions) are
# priced. Output tiles the libraries pick among on Hopper (cuBLAS's kernel
# names read 64x128 .. 128x256, e.g. ``nvjet_sm90_hsh_128x256_64x4``), the
# split-K factors they use when those tiles do not fill the GPU, and the
# fixed cost of one such kernel and of one 64-deep step of its K loop.
# Fitted on the H100 (benchmarks/RESULTS.md, fifty-eighth session) to 100
# float16 GEMMs XLA ran from 8x3072x768 to 2048x22016x4096; over those and
# 22 batched ones of the paper cases, predicted over measured kernel time
# is 0.50-1.65, geometric mean 0.97, log-rms 0.20 (the batched GEMMs with
# 64-80 output columns read 0.5-0.9). The estimate it replaces (128-square
# tiles, every tile re-read priced at HBM bandwidth, loads and tensor-core
# work added) read 0.33-5.1x of the same kernels, 2.8-5.1x above 512 rows.
_LIBRARY_TILES = ((64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128))
_LIBRARY_SPLITS = (1, 2, 4, 8, 16)
_LIBRARY_KERNEL_S = 2.0e-6
_LIBRARY_STEP_S = 25e-9


def _library_gemm_time(rows: int, cols: int, batch: int, red: int, itemsize: int,
                       peak: float, device: DeviceSpec) -> float:
  """One contraction as XLA's library GEMM kernel: the fastest of
  ``_LIBRARY_TILES`` output tilings and ``_LIBRARY_SPLITS`` split-K factors
  (a split adds the kernel that sums its fp32 partials). Each program
  streams its operand tiles from L2 at one SM's bandwidth while its tensor
  cores work (the libraries pipeline the two, so the longer counts), in
  whole waves over the SMs; the kernel is at least as long as its unique
  bytes at HBM bandwidth (re-reads of a tile by other programs come from
  L2) and its FLOPs at the tensor-core peak.

  Example::

      t = _library_gemm_time(512, 3072, 1, 768, 2, h100.peak("float16"), h100)
  """
  sms = device.sm_count
  bw = device.mem_bandwidth_Bps
  flops = 2.0 * batch * rows * cols * red
  best = math.inf
  for tr, tc in _LIBRARY_TILES:
    tiles = batch * math.ceil(rows / tr) * math.ceil(cols / tc)
    for s in _LIBRARY_SPLITS:
      if s > 1 and (red / s < 128 or tiles * s > 2 * sms):
        continue
      part = math.ceil(red / s)
      t_program = (max((tr + tc) * part * itemsize / device.sm_bandwidth_Bps,
                       2.0 * tr * tc * part * sms / peak)
                   + math.ceil(part / 64) * _LIBRARY_STEP_S)
      written = batch * rows * cols * (4 * s if s > 1 else itemsize)
      unique = batch * (rows * red + red * cols) * itemsize + written
      t = (max(math.ceil(tiles * s / sms) * t_program, unique / bw, flops / peak)
           + _LIBRARY_KERNEL_S)
      if s > 1:   # the reduction kernel reads s fp32 partials, writes the result
        t += batch * rows * cols * (4 * s + itemsize) / bw + _LIBRARY_KERNEL_S
      best = min(best, t)
  return best


# XLA's reduction kernel for a vector-matrix dot (``ir.vector_dot_dims``)
# takes about this much more than its matrix at HBM bandwidth. Fitted on
# the H100 (sixtieth session): [1,768]x[768,3072] and [1,1024]x[1024,4096]
# float16 ran in 6.2 and 7.4 us (this price at 3 TB/s: 6.3 and 7.5 us).
XLA_VECTOR_DOT_S = 4.7e-6


def _xla_vector_dot_time(red: int, width: int, itemsize: int, device: DeviceSpec) -> float:
  """A vector-matrix dot as XLA runs it: one reduction kernel over the
  ``red x width`` matrix.

  Where the contracted extent is the longer one, XLA sometimes runs a
  multiply kernel first that writes the whole product ([1,3072]x[3072,768]:
  12.3 us, [1,4096]x[4096,1024]: 17.0 us on the H100, sixtieth session) and
  sometimes not (Llama-2-7B's MLP at one token ran at 92% of HBM
  bandwidth). Not knowing when, the price leaves that kernel out: it then
  reads XLA as faster than it may be, so the model keeps fewer such
  regions, and ``tune='auto'`` times the ones in its uncertain band.

  Example::

      t = _xla_vector_dot_time(3072, 768, 2, get_device("h100"))
  """
  return red * width * itemsize / device.mem_bandwidth_Bps + XLA_VECTOR_DOT_S


def _elementwise_instruction_time(region: ir.Region, device: DeviceSpec,
                                  outs: Optional[Collection[str]] = None) -> float:
  """Seconds of vector and SFU work for the region's elementwise ops (those
  whose output is in ``outs``, or all), each result computed once at the
  price ``elementwise_cost`` gives its Triton spelling."""
  ext, vm = region.loop_extents, region.value_map
  vec = sfu = 0.0
  for op in region.ops:
    if isinstance(op, ir.Elementwise) and (outs is None or op.out in outs):
      n = math.prod(ext[l] for l in vm[op.out].loops)
      v, f = elementwise_cost(op.fn)
      vec += v * n
      sfu += f * n
  return vec / device.vector_flops + sfu / device.sfu_ops


def _computed_from(region: ir.Region, sources) -> set:
  """Outputs of the elementwise ops computed from ``sources`` through
  elementwise ops only (XLA fuses those into one kernel)."""
  down = set(sources)
  found = set()
  for op in region.ops:
    if isinstance(op, ir.Elementwise) and any(a in down for a in op.inputs):
      down.add(op.out)
      found.add(op.out)
  return found


def _fused_reads(region: ir.Region, value: str) -> frozenset:
  """The values a kernel of XLA's reads to compute ``value``: those as
  large as it that it is computed from through elementwise ops, which XLA
  fuses into the kernel that reads them (contraction results, reductions'
  results, region inputs). Smaller ones (an attention's row maxima) are
  left out.

  Why: a float32 softmax over float16 scores reads the scores, 2 bytes an
  element, and converts them in registers; and XLA runs a softmax's two
  reductions as one kernel that reads the scores once (a Triton softmax
  kernel on Hopper; seventieth session). Priced as two kernels over the
  4-byte converted values, XLA's ops of a BERT training step's forward
  attention came to 29.1 us per Base-b1 layer and 144.3 per Small-b8
  layer, where XLA ran them in 20.1 and 62 (seventy-first and
  seventy-fourth sessions); MCFuser's S1-S9 at 1.05-1.82x XLA's kernel
  time, large attention at 2x.
  """
  vm, ext = region.value_map, region.loop_extents
  size = lambda v: math.prod(ext[l] for l in vm[v].loops)
  n = size(value)
  reads, seen, stack = set(), set(), [value]
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    op = region.producer(v)
    if isinstance(op, ir.Elementwise):
      stack.extend(a for a in op.inputs if size(a) >= n)
    elif not isinstance(op, ir.Iota):   # an index is computed, not read
      reads.add(v)
  return frozenset(reads)


def _innermost_in_all(region: ir.Region, loop: str, values) -> bool:
  """Whether ``loop`` is the innermost dimension of each of ``values`` as
  XLA holds them: a contraction's result in its loops' order (the order of
  the GEMM's output), a region input by its strides.

  Why: XLA fuses a softmax into one row-reduction kernel only where the
  reduced dimension is the minor one. On the H100 (seventy-fourth session)
  head-major attention's softmax ran as one kernel that read the scores
  once (D256-T4096: 370 us), token-major attention's, whose scores the
  GEMM writes keys before queries, as a maximum, an exponential with its
  sum and a transpose (1148 us)."""
  vm = region.value_map
  inputs = {b.value: b for b in region.inputs}
  for v in values:
    if v in inputs:
      st = dict(inputs[v].strides)
      if st.get(loop, 0) != 1:
        return False
    elif isinstance(region.producer(v), ir.Contraction):
      if vm[v].loops[-1] != loop:
        return False
  return True


def unfused_time(region: ir.Region, device: DeviceSpec) -> float:
  """The region as XLA runs it unfused: each contraction one library GEMM
  (``_library_gemm_time``; those XLA merges, ``ir.xla_merged_dots``, one
  GEMM together), each reduction one memory-bound kernel over its
  input, elementwise ops fused into those kernels (their instructions
  added), except where XLA runs them in elementwise kernels of their own: a
  single contraction's epilogue after ``ir.xla_epilogue_split``, the join of
  sibling GEMMs (``ir.xla_joins``), the per-part kernels of stacked dots.
  Each of those is bound by its traffic or its instructions, whichever is
  longer. A vector-matrix dot is XLA's reduction (``_xla_vector_dot_time``).
  A GEMM operand or result whose buffer order its GEMM cannot take is
  copied first (or after) by a kernel that reads and writes it
  (``ir.xla_gemm_copies``).

  Why: a fused plan predicted slower than this is left to XLA under
  tune=model. On an H200 (fourth session) this estimate was 0.6-1.7x XLA's
  measured kernel time on the 33 paper cases; the fused plans it rejects
  (MCFuser G5, G6) measured 1.4-1.7x slower than XLA. Elementwise work
  priced as free (until the forty-second session) left three GEMM-GELU-GEMM
  chains that ran 1.04-1.32x faster fused to XLA, while the fused side
  counts the same GELU's instructions; with it the 0.75 bound
  (``UNFUSED_MARGIN``) separates all 18 FFN-width chains of the twentieth
  session (benchmarks/RESULTS.md).

  Example::

      ratio = plan.predicted.time_s / unfused_time(region, get_device("h100"))
  """
  vm = region.value_map
  ext = region.loop_extents
  total = 0.0
  # Contractions XLA merges into one GEMM (ir.xla_merged_dots): the group
  # is priced once, at its first member, with the members' columns (a
  # shared lhs) or rows (a shared rhs) summed.
  merged: dict[str, tuple[int, int, int, int]] = {}
  priced_with_first: set = set()
  reduced: set = set()
  for group in ir.xla_merged_dots(region):
    dims = [_gemm_dims(region, c, ext) for c in group]
    rows, cols, batch, red = dims[0]
    if all(c.lhs == group[0].lhs for c in group):
      cols = sum(d[1] for d in dims)
    else:
      rows = sum(d[0] for d in dims)
    merged[group[0].out] = (rows, cols, batch, red)
    priced_with_first.update(c.out for c in group[1:])
  for op in region.ops:
    if isinstance(op, ir.Contraction):
      if op.out in priced_with_first:
        continue
      rows, cols, batch, red = merged.get(op.out) or _gemm_dims(region, op, ext)
      itemsize = ir.dtype_itemsize(vm[op.lhs].dtype)
      if ir.vector_dot_dims(rows, cols, batch):
        total += _xla_vector_dot_time(red, max(rows, cols), itemsize, device)
        continue
      peak = device.dot_peak(contraction_dtype(region, op), op.precision)
      total += _library_gemm_time(rows, cols, batch, red, itemsize, peak, device)
    elif isinstance(op, ir.Reduction):
      n = math.prod(ext[l] for l in vm[op.inputs[0]].loops)
      reads = _fused_reads(region, op.inputs[0])
      if _innermost_in_all(region, op.loop, reads):
        # Reductions over one loop of what the same values compute (a
        # softmax's maximum and sum) are one kernel of XLA's (_fused_reads).
        if (op.loop, reads) in reduced:
          continue
        reduced.add((op.loop, reads))
        width = sum(ir.dtype_itemsize(vm[v].dtype) for v in reads)
      else:
        # Reduced across rows (token-major attention's scores, whose GEMM
        # writes keys before queries): XLA runs each reduction as a kernel
        # of its own over the value it reduces.
        width = ir.dtype_itemsize(vm[op.inputs[0]].dtype)
      total += 2 * n * width / device.mem_bandwidth_Bps + device.min_kernel_s
  # Elementwise kernels of their own: (op outputs, traffic s, launches).
  own: list[tuple[set, float, int]] = []
  placed: set = set()
  cut = ir.xla_epilogue_split(region)
  if cut is not None:
    # The epilogue after the cut: one kernel that reads the cut value and
    # writes the result. With an erf in it (exact GELU) XLA runs two: the
    # first writes a float32 intermediate that the second reads with the
    # cut value again. On the H100 (fifty-eighth session) exact GELU's
    # epilogue took 4.7-73.7 us at 128x3072 .. 4096x4096, as this traffic
    # says (3.8-80 us), where tanh-GELU's and SiLU's one kernel took
    # 2.3-23 us.
    src = vm[cut]
    n = math.prod(ext[l] for l in src.loops)
    item = ir.dtype_itemsize(src.dtype)
    outs = _computed_from(region, {cut})
    if any(isinstance(o, ir.Elementwise) and o.fn == "erf" and o.out in outs
           for o in region.ops):
      own.append((outs, n * (3 * item + 8) / device.mem_bandwidth_Bps, 2))
    else:
      own.append((outs, 2 * n * item / device.mem_bandwidth_Bps, 1))
    placed |= outs
  for join, dots in ir.xla_joins(region).items():
    # Sibling GEMMs joined (a gated MLP): XLA's kernel after the GEMMs reads
    # each joined result and writes the join, with the elementwise ops on
    # the GEMMs' results (the join's operands and the rest of the epilogue)
    # fused into it.
    n = math.prod(ext[l] for l in vm[join].loops)
    read = sum(math.prod(ext[l] for l in vm[d].loops) * ir.dtype_itemsize(vm[d].dtype)
               for d in dots)
    outs = _computed_from(region, set(dots)) - placed
    own.append((outs, (read + n * ir.dtype_itemsize(vm[join].dtype)) / device.mem_bandwidth_Bps, 1))
    placed |= outs
  if region.part_loop:
    # Sibling dots (ir.with_parts): XLA merges them into one GEMM (priced
    # above, the parts as more columns) and then runs one kernel per part
    # that reads the merged result and writes the part's output (its slice,
    # with the epilogue fused in). Measured on an H100 at 512x768, three
    # parts (2026-11-22): 1.34-2.14 us each after a 7.5 us GEMM.
    outs = _computed_from(region, {c.out for c in region.contractions}) - placed
    traffic = sum(2 * math.prod(b.shape) * ir.dtype_itemsize(vm[b.value].dtype)
                  for b in region.outputs) / device.mem_bandwidth_Bps
    own.append((outs, traffic, sum(b.parts for b in region.outputs)))
    placed |= outs
  for b in ir.xla_gemm_copies(region):
    # XLA's transpose of a GEMM operand or result (ir.xla_gemm_copies): one
    # kernel that reads and writes the buffer.
    n = math.prod(ext[l] for l in vm[b.value].loops)
    total += 2 * n * ir.dtype_itemsize(vm[b.value].dtype) / device.mem_bandwidth_Bps
    total += device.min_kernel_s
  # The rest run inside the GEMMs' and reductions' kernels, after (or
  # between) their loads and dots: their instructions add, as they add to a
  # fused plan's compute time in ``predict``.
  total += _elementwise_instruction_time(region, device, {
      o.out for o in region.ops if isinstance(o, ir.Elementwise) and o.out not in placed})
  for outs, traffic, launches in own:
    total += (max(traffic, _elementwise_instruction_time(region, device, outs))
              + launches * device.min_kernel_s)
  return total


# A fused plan is left to XLA unless it is predicted under this fraction of
# ``unfused_time``. Both estimates err, and not alike: on the H100 the
# fused prediction of kernels under 3 us is 1.4-1.9x short of their measured
# time (the launch ramp it leaves out) while ``unfused_time`` runs 0.5-1.4x
# XLA's, so measured ratios ran 0.95-2.6x the model's. Over the 33 float16
# paper cases and 18 GEMM-GELU-GEMM chains at BERT/ViT FFN widths
# (benchmarks/RESULTS.md, twentieth session; device span against XLA's),
# every region predicted under 0.75x ran at least as fast as XLA, and 11 of
# the 12 predicted at 0.82-1.52x ran at 0.50-0.92x XLA's speed (the twelfth,
# MCFuser G6 at 0.87x, ran 1.2x faster). float32 (TF32) chains agree: every
# one predicted under 0.75x measured at least 0.91x XLA, while the old 1.5x
# bound kept chains measuring 0.53-0.98x (nineteenth session). Re-checked
# against the library GEMM price of the fifty-eighth session: every region
# measured there and predicted under 0.75x (the 33 paper cases, BERT's
# parts, GEMM + GELU at 8-4096 rows) ran in less kernel time than XLA's or
# within 2% of it in one kernel against two.
UNFUSED_MARGIN = 0.75


def writes_its_intermediates(region: ir.Region) -> Optional[str]:
  """Why ``region`` is left to XLA whatever its plan, or None: among the
  intermediates it must write because the program reads them after it
  (``ir.written_intermediates``) are wider copies of a narrower product
  (float32 exponentials of float16 ``q @ k`` scores), which XLA's
  program does not write.

  Why: a training step's forward attention with its softmax in float32
  wrote its float32 scores and exponentials and its float16 probabilities
  for the backward (10 bytes a score; 6 since capture drops the dead code
  that read the scores). XLA's program writes the float16 scores and
  probabilities (4 bytes) and recomputes the rest inside the backward's
  kernels. On the H100 (seventy-first session, BERT training steps) the
  fused kernel took 26.5 us per layer against XLA's 20.1 at Base batch 1,
  and 116 against 62 at Small batch 8. Timed alone against its own ops,
  which had to write the same arrays, it had won (116.5 against 162.7
  us), so no timing of the region can tell. Over the step the device time
  was 0.93x (Base) and 0.86x (Small) of XLA's. Writing the float16 scores
  instead and recomputing the exponentials after the region (4 bytes) did
  not help either: the region, which must hold whole rows to write the
  probabilities, ran 16.0 us per Base layer and 73.8 per Small-b8 layer,
  and the steps ran slower than without it (seventy-fourth session). With
  the softmax in float16 the region writes float16 scores, exponentials
  and probabilities (6 bytes), and fused it ran 16.4 us per Base layer
  against XLA's 21.9: such a region is not left.
  """
  written = ir.written_intermediates(region)
  vm = region.value_map
  wide = []
  for v in written:
    width = ir.dtype_itemsize(vm[v].dtype)
    sources = [c.out for c in region.contractions if region.computed_from(v, c.out)]
    if sources and width > max(ir.dtype_itemsize(vm[c].dtype) for c in sources):
      wide.append(v)
  if not wide:
    return None
  ext = region.loop_extents
  nbytes = sum(math.prod(ext[l] for l in vm[v].loops) * ir.dtype_itemsize(vm[v].dtype)
               for v in wide)
  return (f"writes {', '.join(sorted(wide))} ({nbytes / 2**20:.1f} MiB), wider copies of "
          f"a product that the program reads after it: XLA's ops write the product "
          f"narrow and recompute them where they are read")


def slower_than_unfused(region: ir.Region, plan, device: DeviceSpec) -> Optional[str]:
  """Why ``plan`` should be left to XLA on the model's word, or None."""
  pred = getattr(plan, "predicted", None)
  if pred is None:
    return None
  unfused = unfused_time(region, device)
  if pred.time_s > UNFUSED_MARGIN * unfused:
    return (f"predicted {pred.time_s * 1e6:.1f} us fused vs {unfused * 1e6:.1f} us "
            f"as separate kernels (fused only when predicted under {UNFUSED_MARGIN}x "
            f"of that)")
  return None


# Regions predicted at or above this ratio of ``unfused_time`` are left to
# XLA on the model's word in every mode but 'measure'; below it the model is
# unsure where ``verdict_uncertain`` says. Refitted with the library GEMM
# price of the fifty-eighth session (benchmarks/RESULTS.md): float16
# regions measured faster fused than XLA were predicted at up to 1.54x of
# ``unfused_time`` (MCFuser G5 1.02 and G6 1.11, 1.5-1.7x faster; the gated
# MLPs' gate/up parts at 128 tokens, TinyLlama 1.29 and LLaMA-2-7B 1.36,
# 1.04-1.26x; a 4096x4096x1024 GEMM + SiLU 1.54, 1.05x), while regions
# that lose or tie were predicted from 0.99 up (Qwen2-0.5B's gate/up part
# 0.99; 4096x768x3072 GEMM + GELU/SiLU 1.26-1.40, 0.88-0.95x XLA). The
# bound was 1.0 with the old price, which read XLA's GEMMs at 0.4-5x their
# time. float32: the model under-predicts fused TF32 kernels (seventeenth
# session); such regions are timed below this bound too.
UNCERTAIN_BELOW = 2.0
# Plans that split a streamed loop across programs (attention at one query
# token against thousands of keys, flash-decoding) are timed against XLA
# under tune='auto' when predicted between UNFUSED_MARGIN and this ratio of
# ``unfused_time``, and below UNFUSED_MARGIN too where the model has an
# unsplit plan to time beside the pick (``search.unsplit_rival``). On the
# H100 (thirty-sixth session) four decoding steps in the [B, T, heads, D]
# layout were predicted at 0.99-1.55x XLA's ops and ran 1.2-3.2x faster
# than them: the fused price counts the 16-row padding of a 4-row head
# group at the narrow-row dot rate. XLA's copies of the key/value cache
# into head-major order are priced now (``ir.xla_gemm_copies``), which puts
# the batch-8 step at 0.43x; but the model ranks split against unsplit
# plans loosely (seventieth session, 64 measured plans each: Spearman
# 0.73-0.94; at batch 8 its split pick ran 17% slower than the best, an
# unsplit plan), and the timing is what brings that plan in beside the pick
# (``launch.rival_plan``).
STREAMED_SPLIT_UNCERTAIN_BELOW = 2.0


def verdict_uncertain(region: ir.Region, plan, device: DeviceSpec,
                      rival: Any = None) -> Optional[str]:
  """Why the model's keep-or-drop verdict on ``plan`` (``slower_than_unfused``)
  is not to be trusted, or None. ``tune='auto'`` times such a region's
  kernel against XLA's ops on the GPU instead.

  * float32 (TF32, 3xTF32 or IEEE) dots predicted below ``UNCERTAIN_BELOW``
    of the unfused time: no bound below that separates the float32 chains
    that lose to XLA from those that win (the losers have the lowest
    ratios, 0.46-0.75, with winners among them; benchmarks/RESULTS.md,
    thirty-first session).
  * 16-bit regions predicted between ``UNFUSED_MARGIN`` and
    ``UNCERTAIN_BELOW`` of the unfused time.
  * plans that split a streamed (online-softmax) loop, predicted between
    ``UNFUSED_MARGIN`` and ``STREAMED_SPLIT_UNCERTAIN_BELOW`` of the unfused
    time, or below ``UNFUSED_MARGIN`` where ``rival`` (the model's best
    unsplit plan, ``search.unsplit_rival``) is given: the timing is then
    the pick's against that plan's as much as against XLA's.

  Example::

      res = plan_region(region, "h100")
      why = verdict_uncertain(region, res.best, get_device("h100"),
                              rival=search.unsplit_rival(region, res.best, res.alternatives))
  """
  pred = getattr(plan, "predicted", None)
  if pred is None:
    return None
  unfused = unfused_time(region, device)
  ratio = pred.time_s / unfused if unfused > 0 else math.inf
  split = getattr(plan, "split", None)
  if (split and split[0] in tiling.streamable_loops(region)
      and ratio < STREAMED_SPLIT_UNCERTAIN_BELOW):
    if ratio >= UNFUSED_MARGIN:
      return (f"streamed loop {split[0]} split across programs (flash-decoding), "
              f"predicted at {ratio:.2f}x the separate kernels' time: the model is not "
              f"fitted to such plans or to XLA's ops at these shapes")
    if rival is not None:
      return (f"streamed loop {split[0]} split across programs (flash-decoding), "
              f"predicted at {ratio:.2f}x the separate kernels' time: the model ranks "
              f"such plans against unsplit ones loosely")
  if ratio >= UNCERTAIN_BELOW:
    return None
  wide = sorted({contraction_dtype(region, op) for op in region.contractions}
                & {"float32", "float64"})
  if wide:
    return (f"{'/'.join(wide)} dots: below {UNCERTAIN_BELOW:g}x the separate kernels' "
            f"time, the model does not separate the chains that lose to XLA from "
            f"those that win")
  if ratio >= UNFUSED_MARGIN:
    return (f"predicted at {ratio:.2f}x the separate kernels' time, between the "
            f"{UNFUSED_MARGIN}x bound and {UNCERTAIN_BELOW:g}x")
  return None
