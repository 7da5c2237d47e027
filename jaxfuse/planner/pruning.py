"""Pruning rules 1-4 of MCFuser III-C, for any region.

Rule 1 (deduplication). MCFuser: "bind spatial loops with blockIdx ... remove
the loops bound to blockIdx to derive the sub-tiling expression; candidates
sharing a sub-tiling expression per thread block are equivalent". The
sub-expression is what one thread block executes: the full expression with
Loads and Computes at their rightmost related loop (MCFuser III-B, Fig.
4(a)) and each Store just after the scope in which its value is complete
(the rule ``tiling.place`` uses: a store never sits inside a loop that
accumulates into it), then the loops bound to program ids removed. Two
expressions are one candidate when those per-block programs print the same.
Hoisting by tile size happens later, in ``tiling.place``; it is an
optimisation of a candidate, not part of its identity.

Rule 2. "When the reduced loop is positioned outside the spatial loops,
multiple tiles of partial results are cached": in the per-block
sub-expression, an op's reduced loop encloses a loop that indexes the
op's result (``kn`` for ``C = A·B``: every n-tile of C accumulates across
the k loop).

For MCFuser's GEMM chain (M=N=1024, K=H=512; b, m, h bound) this gives the
paper's counts, 26 expressions -> 5 per-block programs -> 3::

    (n(k(La,Lbb,Cc),Ld,Ce),Se)  mhnk mnhk ... mn(k,h) nm(k,h)   kept
    (nk(La,Lbb,Cc,Ld,Ce),Se)    mnkh nmkh nkmh nkhm              kept
    (n(Ld,k(La,Lbb,Cc,Ce)),Se)  nhkm hnkm                        kept
    (k(La,n(Lbb,Cc,Ld,Ce)),Se)  mknh mkhn ...                    Rule 2
    (kn(La,Lbb,Cc,Ld,Ce),Se)    knmh knhm khnm hknm              Rule 2

The paper's example says ``mhnk`` and ``mnkh`` both give ``nk``: that is
their loop structure. As per-block programs they differ (``mnkh`` loads D
and updates E inside the k loop, ``mhnk`` after it), and only counting
programs gives 5 and 3.
The search itself does not depend on the class representatives:
``tiling.place`` strips the grid loops before placing, rejects and hoists per
tile size, and equal placed programs are evaluated once.

Rule 3. Tiles are powers of two from 16 (``tl.dot``) to the next power of
two above the extent. Power-of-two extents take no padding (tile <= extent).
MCFuser keeps other extents' tiles whose padding ratio is below 0.05, but
its tiles are any multiple of 16, so 80 and 208 have exact tiles (80, 208,
104...). Triton blocks are powers of two: the nearest equivalents of those
tiles pad, and a 0.05 bound left 208 only 16 and 256 (Chimera G7-G9), so the
kernel had either 13 latency-bound 16-row programs per batch or one program
of 256 rows. Here non-power-of-two extents keep tiles padding at most
``MAX_PADDING_RATIO`` (a quarter: 64 and 128 for 208, 32 for 80); the model
prices the padded work (trip counts are rounded up). The padded single tile
(next power of two) is always kept for non-power-of-two extents up to
``MAX_PADDED_SINGLE`` so the loop can still live in one masked tile (needed
when it must be one tile, e.g. a non-streamable softmax row or a head dim),
and when nothing at all passes, the least-padded tile is kept.

Rule 4. The shared-memory estimate (MCFuser eq. 1: sum of the tile
footprints of the chain's tensors, in bytes) must not exceed 1.2 x the
device's shared memory per block.

Rule 5 (jaxfuse's, for its backend). No dot that Triton is known to
miscompile, nor a TF32 dot known to spill registers
(``dot_hazard``): the search never ranks such a plan.

Deferred sums (jaxfuse's, for one-row plans). A broadcast product is kept
whole and summed once after its loop while the kernel's kept products fit
one register cap, and one an online softmax rescales a smaller one
(``deferred_sums``); a one-row plan without a softmax that would sum a
product every step instead is not ranked (``summed_every_step``), since the
model prices one-row plans as if every sum were deferred.

Example::

    counts = space_counts(region, get_device("h100"))
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Mapping, Optional, Sequence, Union

from jaxfuse import ir
from jaxfuse.devices import contraction_dtype
from jaxfuse.planner import tiling

__all__ = ["raw_tile_options", "tile_candidates", "naive_placements", "rule1_programs",
           "rule1_classes",
           "violates_rule2", "padding_ratio", "rule3_ok", "smem_estimate",
           "rule4_ok", "dot_hazard", "broadcast_product", "deferred_sums", "summed_every_step",
           "DEFERRED_SUM_REGS_PER_THREAD", "MAX_BROADCAST_PRODUCT", "space_counts", "MAX_PADDED_SINGLE", "MAX_PADDING_RATIO",
           "SMEM_SLACK"]

SMEM_SLACK = 1.2
MAX_PADDED_SINGLE = 256
MAX_PADDING_RATIO = 0.25
MIN_DOT_TILE = 16


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def raw_tile_options(extent: int) -> int:
  """MCFuser's raw count of tile sizes: multiples of 16 up to the extent."""
  return math.ceil(extent / MIN_DOT_TILE)


def padding_ratio(extent: int, tile: int) -> float:
  return (math.ceil(extent / tile) * tile - extent) / extent


def rule3_ok(extent: int, tile: int) -> bool:
  if _is_pow2(extent):
    return tile <= extent
  return padding_ratio(extent, tile) <= MAX_PADDING_RATIO


def tile_candidates(region: ir.Region, loop: str, *, rule3: bool = True) -> tuple[int, ...]:
  """Legal tiles for ``loop``: 1 for batch loops and loops of extent 1, powers of two >= 16 up to
  the next power of two above the extent for ``tl.dot`` loops (>= 1 for
  others), filtered by Rule 3 (see the module docstring for the padded
  single tile kept for extents like 80), and 1 as well for a dot loop that
  shares its role with another (``tiling.scalar_dot_loops``: the query
  heads of a key head in grouped-query attention)."""
  ext = region.extent(loop)
  # A loop of extent 1 (BERT's batch of one, indexing the activations but
  # not the weights) is a scalar index, not a dot dim: a tile of 16 there
  # ran 16x the work and pushed the contraction off tl.dot.
  if ext == 1 or loop in tiling.batch_loops(region):
    return (1,)
  lo = MIN_DOT_TILE if loop in tiling.dot_loops(region) else 1
  hi = max(tiling.next_pow2(ext), lo)
  cands = []
  t = lo
  while t <= hi:
    cands.append(t)
    t *= 2
  if not rule3:
    return tuple(cands)
  keep = [t for t in cands if rule3_ok(ext, t)]
  if not _is_pow2(ext) and hi <= MAX_PADDED_SINGLE and hi not in keep:
    keep.append(hi)
  if not keep:
    keep = [min(cands, key=lambda t: (padding_ratio(ext, t), t))]
  if lo > 1 and loop in tiling.scalar_dot_loops(region):
    keep.append(1)
  return tuple(sorted(keep))


# -- Rule 5: dots Triton miscompiles ---------------------------------------

# Dots that Triton (3.6.0, H100, 2026-11-21) compiles into wrong results,
# and once into an illegal memory access: a dot of a tile computed in
# registers (the first GEMM's result, converted; measured as the lhs, refused
# on either side) of >= 128 rows and a reduction of >= 256, into fewer than
# 64 output columns. Measured on the
# GEMM chain (b=16, M=N=256): rows 128, reduction 256 and 16 or 32 columns
# returned errors of 1.3-1.6 (max error / max |ref|) at 4 or 8 warps, 2 or 3
# stages, K = 64, 80 or 128; 64 columns, 64 rows, a 128-wide reduction or
# rows 256 x reduction 64 were correct (benchmarks/RESULTS.md, eleventh
# session). The interpreter runs them correctly, so only this rule keeps
# them off the GPU (Rule 5: what the backend cannot compile correctly).
HAZARD_ROWS, HAZARD_RED, HAZARD_MAX_COLS = 128, 256, 64
# A second family (Triton 3.6.0, H100, 2026-11-24): a dot whose 16-bit
# operand is computed from the previous dot's result by elementwise ops
# only (a cast, a scale, a bias, ReLU), at >= 64 rows (warpgroup MMA), a
# reduction of <= 32 and a first-dot reduction tile of <= 64. Of 2,482
# probed kernels, 151 returned errors of 0.30-0.86 (float16 and bfloat16),
# all inside this corner (992 probed there), none outside it. Which of
# them fail moves with warps and stages (2 and 3 stages each fail
# somewhere), so the rule covers the whole corner. tanh and logistic
# between the dots (192 kernels) and attention's softmax, whose path
# passes a row reduction (120), never failed; the rule still covers the
# activations, as no reason for their luck is known. The plans it drops
# have 16- or 32-wide tiles on the chain's middle loop, far down the
# model's ranking (benchmarks/RESULTS.md, forty-sixth session). The
# interpreter runs them correctly.
ACC_FEED_MIN_ROWS, ACC_FEED_MAX_RED, ACC_FEED_MAX_FIRST_RED = 64, 32, 64
# A third family (same probes): in a chain of three dots, the third, whose
# operand comes (elementwise ops apart) from a dot that itself read a
# computed operand, at >= 64 rows, a reduction of >= 64 and <= 32 columns.
# On a 3-GEMM chain (x·W1·W2·W3, 128 x 256-1024-256-64, with and without
# abs between), 137 of 193 such kernels returned errors of 0.76-1.65 (the
# 56 correct ones all 64 rows at 8 warps), none of 341 outside the corner;
# two-dot chains at these tiles are correct (MCFuser G1's best plan has 64
# rows, a 128-wide reduction and 16 columns). Many of these kernels in one
# process also ended in illegal memory accesses, none alone.
CHAIN3_MIN_ROWS, CHAIN3_MIN_RED, CHAIN3_MAX_COLS = 64, 64, 32
# A fourth family (Triton 3.6.0, H100, 2026-11-24): a dot of a computed
# operand at >= 64 rows, a reduction of <= 128, into <= 32 columns, when
# neither it nor the
# contractions its operand comes from (through any ops: softmax's row
# reductions too) run a reduction loop: every reduction is one whole tile,
# so the kernel is straight-line code from the first dot to the second.
# Short sequences hit it: attention over 64 or 128 keys, a GEMM chain with
# a 64- or 128-wide middle. `plan_check --cases=short` (8 regions, 320
# plans): all 15 such plans that ran failed, 8 with errors of 1.2-1.4 and
# 7 with an illegal memory access (one ended a user's program at 128
# tokens: the plan was self-checked in its process); every plan outside
# the corner was correct, among them the same tiles with a first-dot
# reduction loop (a 32-wide tile of a 64-wide reduction), or with the
# columns looped in the kernel. The interpreter runs them correctly
# (benchmarks/RESULTS.md, fiftieth session). The bound was 128 (the eleventh
# session had measured a whole 256-wide reduction into 16 columns correct,
# on a chain whose first reduction was 80 wide)
# until MCFuser G3 (512 x 256 x 64 x 256), whose first two picks were in the
# corner with a whole 256-wide middle: 16 columns returned an error of 1.34,
# 32 columns an illegal memory access, in the self-check of three sessions'
# runs (sixty-ninth, seventieth, seventy-third).
STRAIGHT_MIN_ROWS, STRAIGHT_MAX_RED, STRAIGHT_MAX_COLS = 64, 256, 32
# TF32 dots (float32 operands, precision other than "ieee") of a computed
# tile with a reduction of at least this many: the converted float32 tile
# is held in registers, and the kernel spills. MCFuser G2
# (1x512x256x64x128, float32) with 32 rows and a whole 256-wide second
# reduction ran 156 us against XLA's 6.2 us on the H100 (2026-11-22).
# Offline sm_90 compiles (Triton 3.9 ptxas) of three float32 chains spilled
# in 20 of 33 tile combinations with a 256-wide reduction (13 of 22 on 16
# or 32 rows, 7 of 11 on 64), and in 2 of 66 with a 64- or 128-wide one
# (benchmarks/RESULTS.md, nineteenth session).
TF32_MAX_COMPUTED_RED = 256


# A contraction that is not one tl.dot (``tiling.dot_roles``) is printed as a
# broadcast product summed over K. Triton's compile time grows with its
# elements: 2^20 of them (x[b,m,k] @ w[k,n] with b and m tiles of 16, before
# ``ir.coalesce_loops``) took 91-372 s for sm_90 (2026-11-22). Larger
# products are refused; the search then ranks other tiles or leaves the
# region to XLA.
MAX_BROADCAST_PRODUCT = 2**16


def broadcast_product(region: ir.Region, op: ir.Contraction, tile: Mapping[str, int]
                      ) -> Optional[int]:
  """Elements of ``op``'s broadcast product at tiles ``tile`` (loop -> tile,
  at most the padded extent), or None when it is printed as one tl.dot."""
  vm = region.value_map

  def big(v):
    return {l for l in vm[v].loops if tile[l] > 1}
  dtypes = (vm[op.lhs].dtype, vm[op.rhs].dtype)
  # The printer pads a dot's held tiles under MIN_DOT_TILE up to it: count
  # only products that no padding makes a dot.
  padded = {l: max(v, tiling.MIN_DOT_TILE) if v > 1 else v for l, v in tile.items()}
  if tiling.dot_roles(big(op.lhs), big(op.rhs), big(op.out),
                      {l for l in op.reduce if tile[l] > 1}, padded, dtypes) is not None:
    return None
  return math.prod(tile[l] for l in set(vm[op.lhs].loops) | set(vm[op.rhs].loops))


# fp32 registers per thread that the broadcast products a one-row kernel
# keeps whole (``deferred_sums``) may take together. Why keep them: a
# ``tl.sum`` every step is a cross-thread reduction every step; one-row GEMMs
# (H100, Triton 3.6, sixty-first session, 8 shapes 768-11008 wide) ran
# 1.05-1.8x faster at equal tiles with the product summed once after the
# loop, at 32, 64 and 128 registers per thread alike (the probe's largest).
# One cap for all of a kernel's products: in a one-row nest they are live at
# once (a gated MLP's gate and up products share the k loop).
DEFERRED_SUM_REGS_PER_THREAD = 128
# ... and the most one product an online softmax rescales may take. Kept
# whole, the product is rescaled every step, all of it; summed every step,
# it is a cross-warp reduction every step. One-row multi-head decoding (32
# heads, 4096 keys, d=128, H100, sixty-ninth session): 64-key tiles (64
# registers a thread) ran 94.7 us kept whole against 105.1 us summed every
# step (8-way split 96.2 against 122.2); 128-key tiles (128 registers)
# ran 96.3 against 94.1.
RESCALED_SUM_REGS_PER_THREAD = 64


def _deferral_candidates(region: ir.Region, expr: "tiling.TilingExpr",
                         tiles: Mapping[str, int], rescaled: Collection[str]
                         ) -> list[tuple[str, int, bool]]:
  """(contraction, product elements, whether an online softmax rescales it)
  for each contraction printed as a broadcast product inside a loop it
  reduces (the outermost such loop: the one accumulating it) with a tile
  above 1; in the plan's statement order."""
  ops = {op.out: op for op in region.contractions}
  vm = region.value_map
  out = []
  for st, enclosing in tiling.statement_contexts(expr):
    op = ops.get(st.value) if st.kind == "C" else None
    loop = next((l for l in enclosing if op is not None and l in op.reduce), None)
    if (loop is None or tiling.next_pow2(tiles[loop]) <= 1
        or broadcast_product(region, op, tiles) is None):
      continue
    out.append((op.out, math.prod(tiling.next_pow2(tiles[l])
                                  for l in set(vm[op.lhs].loops) | set(vm[op.rhs].loops)),
                op.out in rescaled))
  return out


def deferred_sums(region: ir.Region, expr: "tiling.TilingExpr", tiles: Mapping[str, int],
                  num_warps: int, rescaled: Collection[str] = ()) -> frozenset[str]:
  """Contractions whose whole broadcast product the code generator keeps in
  its accumulator and sums once after the loop that accumulates it.
  Candidates: not one tl.dot (``broadcast_product``), inside a loop they
  reduce whose tile is above 1; taken in the plan's statement order while
  their products fit ``DEFERRED_SUM_REGS_PER_THREAD`` together, and one an
  online softmax rescales (``rescaled``) only within
  ``RESCALED_SUM_REGS_PER_THREAD``. The others sum every step. The printer
  defers exactly these.

  Example: ``deferred_sums(region, plan.expr, plan.tile_map, plan.num_warps)``."""
  return _within_cap(_deferral_candidates(region, expr, tiles, rescaled), num_warps)


def _within_cap(candidates: Sequence[tuple[str, int, bool]], num_warps: int) -> frozenset[str]:
  """The ``candidates`` (in order) whose products fit the caps together."""
  threads = 32 * int(num_warps)
  budget = DEFERRED_SUM_REGS_PER_THREAD * threads
  out = []
  for v, elems, rescaled in candidates:
    if elems <= budget and not (rescaled and elems > RESCALED_SUM_REGS_PER_THREAD * threads):
      budget -= elems
      out.append(v)
  return frozenset(out)


def summed_every_step(region: ir.Region, expr: "tiling.TilingExpr",
                      tiles: Mapping[str, int], num_warps: int) -> tuple[str, ...]:
  """Contractions of a plan with no online softmax that print a broadcast
  product accumulated over a tiled loop yet sum it every step, since
  ``deferred_sums`` has no room for them. The search drops such plans where
  the region is priced as an unpipelined stream
  (``cost_model.is_unpipelined``): at equal tiles that form ran up to 1.8x
  slower, and it was never the fastest form at its shape (sixty-first
  session), while the model priced it as if deferred."""
  cands = _deferral_candidates(region, expr, tiles, ())
  kept = _within_cap(cands, num_warps)
  return tuple(v for v, _, _ in cands if v not in kept)


def dot_hazard(region: ir.Region, tiles: Mapping[str, int], *, tf32: bool = True
               ) -> Optional[str]:
  """Why a plan with these tiles would print a dot that Triton miscompiles
  (see ``HAZARD_ROWS``, ``ACC_FEED_MIN_ROWS``, ``CHAIN3_MIN_ROWS`` and
  ``STRAIGHT_MIN_ROWS``), a
  broadcast product too large to compile (``MAX_BROADCAST_PRODUCT``) or,
  with ``tf32``, a dot that spills registers (see ``TF32_MAX_COMPUTED_RED``),
  or None.
  The search drops such plans, and the printer refuses the first two
  (``CodegenError``) should one be handed over."""
  vm = region.value_map
  ext = region.loop_extents
  produced = {op.out for op in region.ops}

  def t(l):
    return min(int(tiles[l]), tiling.next_pow2(ext[l]))
  tile = {l: t(l) for l in ext}

  def whole(loops) -> bool:   # one tile each: no loop in the kernel
    return all(tile[l] >= tiling.next_pow2(ext[l]) for l in loops)
  for op in region.contractions:
    n = broadcast_product(region, op, tile)
    if n is not None and n > MAX_BROADCAST_PRODUCT:
      return (f"{op.out}: a broadcast product of {n} elements (not one tl.dot), "
              f"which compiles for minutes (limit {MAX_BROADCAST_PRODUCT})")
  for op in region.contractions:
    for computed, other in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
      if computed not in produced:
        continue
      out = vm[op.out].loops
      mine, theirs = set(vm[computed].loops), set(vm[other].loops)
      rows = math.prod(t(l) for l in out if l in mine and l not in theirs)
      cols = math.prod(t(l) for l in out if l in theirs and l not in mine)
      red = math.prod(t(l) for l in op.reduce)
      if rows >= HAZARD_ROWS and red >= HAZARD_RED and cols < HAZARD_MAX_COLS:
        return (f"{op.out}: a dot of a computed {rows}x{red} tile into {cols} columns, "
                "which Triton miscompiles")
      if (rows >= STRAIGHT_MIN_ROWS and red <= STRAIGHT_MAX_RED and cols <= STRAIGHT_MAX_COLS
              and whole(op.reduce)):
        ups = _upstream_contractions(region, computed)
        if ups and all(whole(u.reduce) for u in ups):
          return (f"{op.out}: a dot of a computed {rows}x{red} tile into {cols} columns "
                  "with no reduction loop before it, which Triton miscompiles")
      # Both families below need warpgroup-MMA rows; the walk is skipped otherwise.
      feeders = (_elementwise_feeders(region, computed)
                 if rows >= min(CHAIN3_MIN_ROWS, ACC_FEED_MIN_ROWS) else [])
      if (rows >= CHAIN3_MIN_ROWS and red >= CHAIN3_MIN_RED and cols <= CHAIN3_MAX_COLS
              and any(f.lhs in produced or f.rhs in produced for f in feeders)):
        return (f"{op.out}: a third chained dot ({rows}x{red} tile into {cols} columns), "
                "which Triton miscompiles")
      if rows >= ACC_FEED_MIN_ROWS and red <= ACC_FEED_MAX_RED:
        for first in feeders:
          first_red = math.prod(t(l) for l in first.reduce)
          if first_red <= ACC_FEED_MAX_FIRST_RED:
            return (f"{op.out}: a dot of {first.out}'s accumulator, elementwise ops apart "
                    f"({rows}x{red} tile, first reduction tile {first_red}), which "
                    "Triton miscompiles")
      if (tf32 and contraction_dtype(region, op) == "float32" and op.precision != "ieee"
              and red >= TF32_MAX_COMPUTED_RED):
        return (f"{op.out}: a TF32 dot of a computed {rows}x{red} tile, which spills "
                "registers")
  return None


def _elementwise_feeders(region: ir.Region, v: str) -> list[ir.Contraction]:
  """The contractions whose results reach ``v`` through elementwise ops
  only, where ``v`` is a 16-bit float; none where a reduction lies on the
  way (see ``ACC_FEED_MIN_ROWS``)."""
  if region.value_map[v].dtype not in ("float16", "bfloat16"):
    return []
  return _upstream_contractions(region, v, elementwise_only=True)


def _upstream_contractions(region: ir.Region, v: str, *, elementwise_only: bool = False
                           ) -> list[ir.Contraction]:
  """The contractions ``v`` is computed from, through any other ops (with
  ``elementwise_only``, through elementwise ops only: none when another op
  lies on the way)."""
  found, todo, seen = [], [v], set()
  while todo:
    x = todo.pop()
    if x in seen:
      continue
    seen.add(x)
    op = region.producer(x)
    if isinstance(op, ir.Contraction):
      found.append(op)
    elif isinstance(op, ir.Elementwise) or (op is not None and not elementwise_only):
      todo.extend(op.inputs)
    elif op is not None:
      return []
  return found


# -- Rule 1 / Rule 2 --------------------------------------------------------

def _naive_ops(region: ir.Region) -> tuple[tuple, tuple]:
  """What ``_naive_placed`` reads of each op, once per region: the distinct
  loop tuples of ops and inputs; per op (index of its loops, (Load, index
  of the input's loops) per region input it reads, its Compute, and where
  the region returns its result (the result's loops, its Store), else
  None); and per op that reduces
  (index of its loops, the loops it reduces, its result's loops), for
  Rule 2."""
  got = region._op_memo.get(("naive_ops", None))  # pylint: disable=protected-access
  if got is None:
    inputs, outputs = set(region.input_names), set(region.output_names)
    index: dict[tuple[str, ...], int] = {}

    def at(loops):
      return index.setdefault(tuple(loops), len(index))
    # The statements too: immutable, so every skeleton's placement shares them.
    ops = tuple(
        (at(region.op_loops(op)),
         tuple((tiling.Stmt("L", x), at(region.value(x).loops))
               for x in op.inputs if x in inputs),
         tiling.Stmt("C", op.out),
         (frozenset(region.value(op.out).loops), tiling.Stmt("S", op.out))
         if op.out in outputs else None)
        for op in region.ops)
    reducing = tuple((at(region.op_loops(op)), frozenset(tiling.reduced_by(op)),
                      frozenset(region.value(op.out).loops))
                     for op in region.ops if tiling.reduced_by(op))
    got = region._op_memo[("naive_ops", None)] = (  # pylint: disable=protected-access
        tuple(index), ops, reducing)
  return got


_NOT_NESTED, _RULE2_EVERYWHERE = "not nested", "rule 2 everywhere"


def _naive_placed(region: ir.Region, skeleton: tiling.TilingExpr,
                  rule2_under: Sequence[Collection[str]] = ()
                  ) -> Union[tiling.TilingExpr, str]:
  """The skeleton with L/C/S statements at their rightmost related loop
  (MCFuser Fig. 4(a)), no hoisting, no validity checks. ``_NOT_NESTED``
  when an op's loops are not nested in this skeleton; with
  ``rule2_under`` (sets of bound loops), ``_RULE2_EVERYWHERE`` when Rule 2
  rejects the placement under each of them: a compute sits at its
  anchor, so where computes sit is known before any statement is placed."""
  # No recursive closures here or below: a closure's reference to itself
  # is a cycle, and every skeleton's tables would be garbage that only the
  # collector frees.
  parent: dict[str, Optional[str]] = {}
  children: dict[Optional[str], list] = {None: []}
  stack: list = [(skeleton.body, None)]
  while stack:
    body, p = stack.pop()
    for n in body:
      if isinstance(n, tiling.LoopNode):
        parent[n.loop] = p
        children.setdefault(p, []).append(n.loop)
        children.setdefault(n.loop, [])
        stack.append((n.body, n.loop))

  ancestors: dict[str, tuple[str, ...]] = {}
  for l in parent:
    chain, x = [], l
    while x is not None:
      chain.append(x)
      x = parent[x]
    ancestors[l] = tuple(chain)

  def anc(l):
    return ancestors[l] if l is not None else ()

  def anchor(loops):
    rel = [l for l in loops if l in parent]
    if not rel:
      return None, True
    deepest = max(rel, key=lambda l: len(ancestors[l]))
    return deepest, all(l in ancestors[deepest] for l in rel)

  # Ops and inputs share loop tuples: each is anchored once per skeleton.
  loop_sets, ops, reducing = _naive_ops(region)
  anchors = [anchor(loops) for loops in loop_sets]
  if not all(anchors[op[0]][1] for op in ops):
    return _NOT_NESTED
  if rule2_under:
    # _rule2_pairs of the computes, each at its anchor.
    pairs = []
    for at, red, out_loops in reducing:
      inner_first = anc(anchors[at][0])
      for k, l in enumerate(inner_first):
        if l in red:
          later = out_loops.intersection(inner_first[:k])
          if later:
            pairs.append((l, later))
    if all(_pairs_violate(pairs, drop) for drop in rule2_under):
      return _RULE2_EVERYWHERE
  stmts: dict[Optional[str], list] = {}
  for i, (op_loops, loads, compute, stored) in enumerate(ops):
    a, _ = anchors[op_loops]
    for load, x_loops in loads:
      la, _ = anchors[x_loops]
      # the load sits at its rightmost related loop on the consumer's path
      if la is not None and a is not None and la not in anc(a):
        la = a
      stmts.setdefault(la, []).append(((i, 0), load))
    stmts.setdefault(a, []).append(((i, 1), compute))
    if stored is not None:
      # As in tiling.place: the store follows the scope in which the output
      # is complete, i.e. it leaves every enclosing loop that does not index
      # the output (those accumulate into it).
      out_loops, store = stored
      sa = a
      for l in anc(a):
        if l not in out_loops:
          sa = parent[l]
      stmts.setdefault(sa, []).append(((i, 2), store))

  return tiling.TilingExpr(_naive_emit(None, stmts, children, {}))


def _naive_first(l: Optional[str], stmts: dict, children: dict, firsts: dict) -> float:
  """The first op index placed in loop ``l``'s subtree (``_naive_placed``)."""
  m = firsts.get(l)
  if m is None:
    m = min([k[0] for k, _ in stmts.get(l, [])] or [math.inf])
    for c in children.get(l, []):
      m = min(m, _naive_first(c, stmts, children, firsts))
    firsts[l] = m
  return m


def _naive_emit(l: Optional[str], stmts: dict, children: dict,
                firsts: dict) -> tuple[tiling.Node, ...]:
  """Loop ``l``'s body: its statements and child loops in op order."""
  items = list(stmts.get(l, []))
  for c in children.get(l, []):
    items.append(((_naive_first(c, stmts, children, firsts), 1), c))
  items.sort(key=lambda p: p[0])
  return tuple(it if isinstance(it, tiling.Stmt)
               else tiling.LoopNode(it, _naive_emit(it, stmts, children, firsts))
               for _, it in items)


def _op_order(region: ir.Region) -> tuple[dict, dict, dict]:
  """(op index, values read, first reader's index) by value: what
  ``_normalize`` sorts by."""
  idx = {op.out: i for i, op in enumerate(region.ops)}
  reads = {op.out: frozenset(op.inputs) for op in region.ops}
  first_use: dict[str, int] = {}
  for i, op in enumerate(region.ops):
    for a in op.inputs:
      first_use.setdefault(a, i)
  return idx, reads, first_use


def _normalize(region: ir.Region, expr: tiling.TilingExpr,
               order: Optional[tuple[dict, dict, dict]] = None,
               memo: Optional[dict] = None) -> tiling.TilingExpr:
  """Statements of one scope in dependence order (loads before their first
  consumer, stores after the compute), so that splicing removed loops does
  not make two equal per-block programs print differently. ``order``:
  ``_op_order(region)``, when already computed; ``memo``: normalized
  scopes by scope, for this region (a scope's order depends on it alone,
  and Rule 1's expressions share most of theirs)."""
  normalizer = _Normalizer(order or _op_order(region), {} if memo is None else memo)
  return tiling.TilingExpr(normalizer.scope(expr.body))


class _Normalizer:
  """``_normalize``'s state: methods, not recursive closures (a closure's
  reference to itself is a cycle, and each call's tables would be garbage
  that only the collector frees)."""

  def __init__(self, order: tuple[dict, dict, dict], memo: dict):
    self.idx, self.reads, self.first_use = order
    self.memo = memo
    # A loop's sort key and the values its computes read, once per node
    # (scope sorts every scope, and each sort keys whole subtrees). Keyed by
    # id: every node keyed is in the tree being built or in ``memo``, alive
    # until the end.
    self.keys: dict[int, tuple] = {}
    self.read_in: dict[int, frozenset] = {}

  def key(self, n) -> tuple:
    if isinstance(n, tiling.Stmt):
      if n.kind == "L":
        return (self.first_use.get(n.value, 0), 0, n.value)
      return (self.idx[n.value], 1 if n.kind == "C" else 2, "")
    k = self.keys.get(id(n))
    if k is None:
      ks = [self.key(c) for c in n.body]
      k = self.keys[id(n)] = (min(ks)[0] if ks else math.inf, 1, "")
    return k

  def read(self, n) -> frozenset:
    if isinstance(n, tiling.Stmt):
      return self.reads[n.value] if n.kind == "C" else frozenset()
    r = self.read_in.get(id(n))
    if r is None:
      r = self.read_in[id(n)] = frozenset().union(*(self.read(c) for c in n.body))
    return r

  def scope(self, body: tuple) -> tuple:
    got = self.memo.get(body)
    if got is not None:
      return got
    out = sorted((tiling.LoopNode(n.loop, self.scope(n.body))
                  if isinstance(n, tiling.LoopNode) else n for n in body), key=self.key)
    # A load goes before the first sibling that consumes it (a loop holding
    # a later op's compute can sort ahead of that op's load).
    for ld in [n for n in out if isinstance(n, tiling.Stmt) and n.kind == "L"]:
      first = next(i for i, n in enumerate(out) if n is ld or ld.value in self.read(n))
      if out[first] is not ld:
        out.remove(ld)
        out.insert(first, ld)
    got = self.memo[body] = tuple(out)
    return got


def rule1_classes(region: ir.Region, skeletons: Sequence[tiling.TilingExpr],
                  bound: Iterable[str]) -> dict[str, list[tiling.TilingExpr]]:
  """Rule 1: skeletons grouped by per-block program (insertion ordered; the
  first skeleton of each group is its representative)."""
  placed = naive_placements(region, skeletons)
  return {k: members for k, (_, members) in rule1_programs(region, placed, bound).items()}


def naive_placements(region: ir.Region, skeletons: Sequence[tiling.TilingExpr], *,
                     rule2_under: Sequence[Collection[str]] = (),
                     counts: Optional[dict] = None
                     ) -> list[tuple[tiling.TilingExpr, Optional[tiling.TilingExpr]]]:
  """(skeleton, its naive placement or None) per skeleton: what Rule 1
  reads of it under any grid, so a search over several grids places each
  skeleton once. None: an op's loops are not nested in the skeleton.

  ``rule2_under``: the sets of bound loops (grids) the caller applies Rule
  2 under; skeletons whose placement Rule 2 rejects under every one are
  left out, unplaced (on an attention training step's merged dk+dv region,
  587 of 1006). ``counts``: gets ``not_nested`` and
  ``rule2_everywhere``, the skeletons of each kind."""
  out = []
  n = {_NOT_NESTED: 0, _RULE2_EVERYWHERE: 0}
  for sk in skeletons:
    p = _naive_placed(region, sk, tuple(frozenset(b) for b in rule2_under))
    if isinstance(p, str):
      n[p] += 1
      if p == _RULE2_EVERYWHERE:
        continue
      p = None
    out.append((sk, p))
  if counts is not None:
    counts["not_nested"] = n[_NOT_NESTED]
    counts["rule2_everywhere"] = n[_RULE2_EVERYWHERE]
  return out


def rule1_programs(region: ir.Region,
                   placed: Sequence[tuple[tiling.TilingExpr, Optional[tiling.TilingExpr]]],
                   bound: Iterable[str], *, rule2: bool = False
                   ) -> dict[str, tuple[tiling.TilingExpr, list[tiling.TilingExpr]]]:
  """Rule 1 over ``naive_placements``: per-block program text ->
  (that program, the skeletons that give it), insertion ordered.

  ``rule2``: leave out the skeletons whose program violates Rule 2 before
  forming classes. The classes kept are those ``violates_rule2`` passes,
  with the same members: Rule 2 reads only which loops enclose each
  compute, which normalizing (a reordering of siblings) keeps, so it is
  checked on the placement's enclosing loops less the bound ones, and
  rejected skeletons are never stripped or normalized (on an attention
  training step's merged dk+dv region, Rule 2 rejects 858 of 890 classes
  at the default grid)."""
  bound = tuple(bound)
  order = _op_order(region)
  out: dict[str, tuple[tiling.TilingExpr, list[tiling.TilingExpr]]] = {}
  # Skeletons that differ only in bound loops strip to one expression
  # (that is Rule 1's point): normalize and print each such expression once.
  seen: dict[tiling.TilingExpr, tuple[str, tiling.TilingExpr]] = {}
  drop = frozenset(bound)
  normalized = region.plan_memo.setdefault(("normalized", None), {})
  pairs = region.plan_memo.setdefault(("rule2_pairs", None), {})
  for sk, p in placed:
    if p is None:
      continue
    if rule2:
      # Rule 2's pairs of a placement are the same under every grid.
      got = pairs.get(p)
      if got is None:
        got = pairs[p] = _rule2_pairs(region, tiling.statement_contexts(p))
      if _pairs_violate(got, drop):
        continue
    stripped = tiling.strip_loops(p, bound)
    got = seen.get(stripped)
    if got is None:
      program = _normalize(region, stripped, order, normalized)
      got = seen[stripped] = (str(program), program)
    out.setdefault(got[0], (got[1], []))[1].append(sk)
  return out


def violates_rule2(region: ir.Region, sub: tiling.TilingExpr) -> bool:
  """Rule 2 on a per-block expression: some op's reduced loop encloses a
  loop that indexes the op's result."""
  return _violates_rule2(region, tiling.statement_contexts(sub), frozenset())


def _violates_rule2(region: ir.Region, contexts, drop: frozenset) -> bool:
  """``violates_rule2`` on an expression's ``statement_contexts``, with the
  loops in ``drop`` stripped (``tiling.strip_loops``: Rule 2 reads only the
  loops that enclose each compute, so the stripped tree need not be built)."""
  return _pairs_violate(_rule2_pairs(region, contexts), drop)


def _pairs_violate(pairs, drop: frozenset) -> bool:
  """Whether one of ``_rule2_pairs`` survives stripping the loops in
  ``drop``: its reduced loop and one of the loops it encloses."""
  return any(r not in drop and not later <= drop for r, later in pairs)


def _rule2_pairs(region: ir.Region, contexts) -> list[tuple[str, frozenset]]:
  """(reduced loop, the loops indexing the op's result that it encloses)
  per compute of ``contexts`` and loop it reduces: Rule 2 rejects where
  one such pair survives stripping (its reduced loop, and one of the
  others)."""
  loops = region._op_memo.get(("rule2_loops", None))  # pylint: disable=protected-access
  if loops is None:
    # (reduced loops, result loops) per op's result, once per region.
    loops = region._op_memo[("rule2_loops", None)] = {  # pylint: disable=protected-access
        op.out: (frozenset(tiling.reduced_by(op)), frozenset(region.value(op.out).loops))
        for op in region.ops}
  pairs = []
  for st, enclosing in contexts:
    if st.kind != "C":
      continue
    red, out_loops = loops[st.value]
    if not red:
      continue
    for i, l in enumerate(enclosing):
      if l in red:
        later = out_loops.intersection(enclosing[i + 1:])
        if later:
          pairs.append((l, later))
  return pairs


# -- Rule 4 ------------------------------------------------------------------

def smem_estimate(region: ir.Region, tiles: Mapping[str, int], *,
                  register_accumulators: bool = False) -> int:
  """MCFuser eq. (1) in bytes: tile footprints of the region's inputs,
  contraction results and outputs (elementwise temporaries live in
  registers alongside them and are not counted).

  ``register_accumulators``: leave out the contraction results, for a
  caller that bounds them by the register file instead (the planner's
  register budget): Triton on Hopper keeps wgmma accumulators in
  registers, and counting them here twice rejected attention plans Triton
  runs in 160 KB (256x64 score tiles at d=128)."""
  vm = region.value_map
  names = list(region.input_names)
  if not register_accumulators:
    names += [op.out for op in region.contractions]
  names += [v for v in region.output_names if v not in names]
  total = 0
  for v in dict.fromkeys(names):
    val = vm[v]
    total += math.prod(tiles[l] for l in val.loops) * ir.dtype_itemsize(val.dtype)
  return total


def pipelined_smem_bytes(region: ir.Region, expr: "tiling.TilingExpr",
                         tiles: Mapping[str, int], num_stages: int) -> int:
  """Shared memory Triton's software pipeliner allocates for a placed plan:
  each load inside a loop gets ``num_stages`` buffers of its tile, a load
  outside every loop one. Matched Triton 3.6's request exactly on an H200
  (MCFuser G5 with tiles m=64, n=128, k=512: 360,448 B at 2 stages), where
  eq. (1) said 208 KB. Used to choose ``num_stages``, not for Rule 4. A
  load of a tile the kernel already holds (``tiling.shared_loads``) takes
  none."""
  # Linear in the stages: (looped, hoisted) bytes once per expression and
  # tiles (the search asks at two stage counts, the model at the plan's).
  key = ("pipelined_smem", expr, tuple(tiles.items()))
  got = region.plan_memo.get(key)
  if got is None:
    vm = region.value_map
    shared = tiling.shared_loads(region, expr, tiles)
    looped = hoisted = 0
    for st, enclosing in tiling.statement_contexts(expr):
      if st.kind != "L" or st.value in shared:
        continue
      val = vm[st.value]
      size = math.prod(tiles[l] for l in val.loops) * ir.dtype_itemsize(val.dtype)
      if enclosing:
        looped += size
      else:
        hoisted += size
    got = region.plan_memo[key] = (looped, hoisted)
  return got[0] * num_stages + got[1]


def rule4_ok(region: ir.Region, tiles: Mapping[str, int], smem_per_block: int, *,
             register_accumulators: bool = False) -> bool:
  return (smem_estimate(region, tiles, register_accumulators=register_accumulators)
          <= SMEM_SLACK * smem_per_block)


# -- counts ------------------------------------------------------------------

def space_counts(region: ir.Region, device, bound: Optional[Sequence[str]] = None) -> dict:
  """The search-space sizes per pruning stage (MCFuser Fig. 7).

  ``bound``: loops bound to program ids for Rule 1 (default: the region's
  spatial loops, as MCFuser binds them). Returns raw, expressions,
  rule1_expressions, rule2_expressions, rule3 (candidates), rule4
  (candidates), and the per-loop tile candidates.
  """
  sks = tiling.enumerate_skeletons(region)
  loops = tiling.tiled_loops(region)
  raw = len(sks) * math.prod(raw_tile_options(region.extent(l)) for l in loops)
  bound = tuple(region.spatial_loops() if bound is None else bound)
  classes = rule1_programs(region, naive_placements(region, sks), bound)
  kept = [key for key, (sub, _) in classes.items() if not violates_rule2(region, sub)]
  cands = {l: tile_candidates(region, l) for l in loops}
  combos = 1
  for l in loops:
    combos *= len(cands[l])
  n3 = len(kept) * combos
  fit = 0
  ext = region.loop_extents
  full = {l: 1 for l in ext}
  import itertools  # pylint: disable=import-outside-toplevel
  for ts in itertools.product(*(cands[l] for l in loops)):
    t = dict(full)
    t.update(zip(loops, ts))
    if rule4_ok(region, t, device.smem_per_block_bytes):
      fit += 1
  return {
      "raw": raw,
      "expressions": len(sks),
      "rule1_expressions": len(classes),
      "rule2_expressions": len(kept),
      "rule3": n3,
      "rule4": len(kept) * fit,
      "tile_candidates": {l: list(c) for l, c in cands.items()},
  }
