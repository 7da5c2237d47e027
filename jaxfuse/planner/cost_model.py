"""MCFuser's analytical performance model (IV-A, eq. 2-5) on placed plans.

``t = (t_mem + t_comp) * alpha`` with

* ``t_mem = sum over Load/Store statements of bytes x trip counts / W``
  (``movement.placed_volume``: hoisted statements run fewer times),
* ``t_comp = sum over Compute statements of tile FLOPs x trip counts / P``
  (contractions at the tensor-core rate of the input dtype, elementwise ops
  and reductions at the vector rate; recomputation under loops or grid
  axes an op does not use is counted, which is what makes binding a
  consumer-private loop such as ``h`` to program ids cost something),
* ``alpha = (N_block + N_SM) / N_block``.

Three refinements of ``t_comp`` that MCFuser's model lacks and that decided
plans on Hopper (benchmarks/RESULTS.md, 2026-11-21: the plain model tied
16-wide and 64-wide key tiles in attention and picked the 16-wide one, 2x
slower than cuDNN):

* a contraction runs at ``P x dot_efficiency``: below ``device.mma_rows``
  rows ``tl.dot`` cannot use wgmma, and narrow column and reduction tiles
  pay per-instruction operand traffic and per-step loop overhead
  (``x / (x + 16)`` each);
* transcendental ops (``exp``...) run at the SFU rate, not the FMA rate;
* an accumulator fed through a streamed (online) softmax is rescaled once
  per step of the streamed loop (the code generator's
  ``acc *= exp(m_old - m_new)``), which narrow key tiles multiply.

A split reduction (``Plan.split``) adds the second pass: partial results
in fp32 written by the first kernel, read and reduced by the second, plus
one kernel launch.

Example::

    pred = predict(region, expr, tiles, grid, get_device("h100"))
    pred.time_s, pred.alpha, pred.programs
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

from jaxfuse import ir
from jaxfuse.devices import DeviceSpec, region_dtype
from jaxfuse.planner import movement, pruning, tiling
from jaxfuse.planner.plan import Prediction

__all__ = ["predict", "num_programs", "choose_warps", "choose_warps_stages",
           "accumulator_bytes", "register_budget_bytes",
           "floor_time", "unfused_time", "dot_efficiency"]

# Elementwise functions that run on the special-function units.
TRANSCENDENTAL = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
                            "erf", "sin", "cos", "rsqrt", "sqrt", "pow"})
# Tile width at which operand traffic / loop overhead halves tensor-core
# throughput (see dot_efficiency).
HALF_EFFICIENCY_TILE = 16
# Throughput of tl.dot without wgmma (mma.sync) relative to wgmma on Hopper.
NARROW_ROWS_EFFICIENCY = 0.6


def _rows(region: ir.Region, op: "ir.Contraction", tiles: Mapping[str, int]) -> int:
  """Rows of ``op``'s output tile: its lhs-only output loops."""
  vm = region.value_map
  lhs, rhs = set(vm[op.lhs].loops), set(vm[op.rhs].loops)
  return math.prod(tiles[l] for l in vm[op.out].loops if l in lhs and l not in rhs)


def dot_efficiency(region: ir.Region, op: "ir.Contraction", tiles: Mapping[str, int],
                   device: DeviceSpec) -> float:
  """Fraction of the tensor-core peak one ``tl.dot`` reaches at these tiles.

  rows: the lhs-only output loops; cols: the rhs-only output loops; red:
  the contracted loops (batch loops, tile 1, drop out).
  """
  vm = region.value_map
  lhs, rhs = set(vm[op.lhs].loops), set(vm[op.rhs].loops)
  out = vm[op.out].loops
  rows = _rows(region, op, tiles)
  cols = math.prod(tiles[l] for l in out if l in rhs and l not in lhs)
  red = math.prod(tiles[l] for l in op.reduce)
  eta = 1.0 if rows >= device.mma_rows else NARROW_ROWS_EFFICIENCY
  h = HALF_EFFICIENCY_TILE
  return eta * cols / (cols + h) * red / (red + h)


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
  """Registers held by fp32 accumulator tiles of the contractions."""
  vm = region.value_map
  return sum(4 * math.prod(tiles[l] for l in vm[op.out].loops)
             for op in region.contractions)


# Plans whose pipelined buffers do not fit at 2 stages are rejected: the
# one 1-stage plan measured (MCFuser G5, tiles m=64 n=128 k=512, Triton
# 3.6, H200, 2026-11-21) compiled but failed the self-check (error 0.98).
MIN_STAGES = 2
# fp32 accumulator registers one thread may hold (of 255) before the
# kernel spills; the rest hold operands, the softmax tile and addresses.
ACC_REGS_PER_THREAD = 128


def choose_warps(region: ir.Region, tiles: Mapping[str, int]) -> int:
  """num_warps: 8 for dot tiles of 128x128 or more with at least 128 rows,
  else 4.

  Why 128 rows: a Hopper warpgroup (4 warps) issues wgmma on 64 rows, so
  8 warps on a 64-row tile split the columns instead and exchange row
  maxima and sums through shared memory. On an H200 (2026-11-21,
  benchmarks.model_fidelity) every 64-row plan with 8 warps measured
  slower than the same rows with 4 warps: 8.3 vs 6.2 us on attention S1,
  3.1 vs 2.8 us on GEMM chain G3.
  """
  vm = region.value_map
  ops = region.contractions
  area = max([math.prod(tiles[l] for l in vm[op.out].loops) for op in ops] or [0])
  rows = min([_rows(region, op, tiles) for op in ops] or [0])
  return 8 if area >= 128 * 128 and rows >= 128 else 4


def choose_warps_stages(region: ir.Region, expr: tiling.TilingExpr,
                        tiles: Mapping[str, int], device: DeviceSpec) -> tuple[int, int]:
  """(num_warps, num_stages) for a placed plan: ``choose_warps``, and the
  larger of 3 and 2 stages whose pipelined buffers
  (``pruning.pipelined_smem_bytes``) fit in shared memory (``MIN_STAGES``
  when neither does; the planner then rejects the plan)."""
  for stages in (3, 2):
    if pruning.pipelined_smem_bytes(region, expr, tiles, stages) <= device.smem_per_block_bytes:
      return choose_warps(region, tiles), stages
  return choose_warps(region, tiles), MIN_STAGES


def register_budget_bytes(num_warps: int) -> int:
  """Bytes of fp32 accumulators a program of ``num_warps`` warps holds in
  registers without spilling."""
  return num_warps * 32 * ACC_REGS_PER_THREAD * 4


def predict(region: ir.Region, expr: tiling.TilingExpr, tiles: Mapping[str, int],
            grid: Sequence[str], device: DeviceSpec,
            split: Optional[tuple[str, int]] = None,
            streamable: Optional[frozenset] = None) -> Prediction:
  """The model's time for a placed plan (see the module docstring).
  ``streamable``: loops the code generator streams (default
  ``tiling.streamable_loops(region)``)."""
  if streamable is None:
    streamable = tiling.streamable_loops(region)
  ext = region.loop_extents
  vm = region.value_map

  def trips(l):
    t = math.ceil(ext[l] / tiles[l])
    if split and l == split[0]:
      t = math.ceil(t / split[1])
    return t

  programs = num_programs(region, tiles, grid, split)
  per_tensor = movement.placed_volume(region, expr, tiles, grid, split)
  bytes_moved = sum(per_tensor.values())
  flops = 0
  vec = 0
  sfu = 0
  t_dot = 0.0
  peak = device.peak(region_dtype(region))
  for st, enclosing in tiling.statement_contexts(expr):
    if st.kind != "C":
      continue
    op = region.producer(st.value)
    ol = set(region.op_loops(op))
    around = set(enclosing) | set(grid)
    work = 1
    for l in ol:
      work *= tiles[l] * (trips(l) if l in around else 1)
    for l in around - ol:
      work *= trips(l)
    if split:
      # every part runs this statement; per-program trips of the split loop
      # are already its share
      work *= split[1]
    if isinstance(op, ir.Contraction):
      flops += 2 * work
      t_dot += 2 * work / (peak * dot_efficiency(region, op, tiles, device))
      for l in _rescaled_by_stream(region, op, streamable):
        if l in around and trips(l) > 1:
          vec += work // tiles[l]
    elif isinstance(op, ir.Elementwise) and op.fn in TRANSCENDENTAL:
      sfu += work
    else:
      vec += work
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
  alpha = (programs + device.sm_count) / programs
  time_s = (t_mem + t_comp) * alpha + extra
  return Prediction(time_s=time_s, t_mem_s=t_mem, t_comp_s=t_comp, alpha=alpha,
                    bytes_moved=int(bytes_moved), flops=int(flops),
                    smem_bytes=pruning.smem_estimate(region, tiles),
                    programs=programs)


def floor_time(region: ir.Region, device: DeviceSpec) -> float:
  """Roofline floor: max(FLOPs / P, minimum bytes / W)."""
  return max(region.flops() / device.peak(region_dtype(region)),
             region.min_bytes() / device.mem_bandwidth_Bps)


def unfused_time(region: ir.Region, device: DeviceSpec) -> float:
  """A rough time for the region as separate ops (each intermediate
  written and read once, one launch per contraction)."""
  vm = region.value_map
  ext = region.loop_extents
  inter = 0
  for op in region.ops:
    if op.out in region.output_names:
      continue
    inter += 2 * math.prod(ext[l] for l in vm[op.out].loops) * ir.dtype_itemsize(vm[op.out].dtype)
  t = (region.min_bytes() + inter) / device.mem_bandwidth_Bps
  t = max(t, region.flops() / device.peak(region_dtype(region)))
  return t + device.kernel_launch_s * max(len(region.contractions) - 1, 0)
