"""Prints a Triton kernel from a region and a plan.

The printed kernel follows the plan literally: program-id loops form the
grid, every ``LoopNode`` of the tiling expression becomes a ``for`` over
tiles, and each ``L``/``C``/``S`` statement is emitted where the plan placed it.
Values live in registers as tiles whose dims are the value's loops with a
tile larger than one, in the region's loop order (but a wide loaded ``tl.dot``
operand, in the order the dot reads it: ``TRANSPOSED_OPERAND_MIN_RED``); loops
of tile 1 are scalar indices. Contractions use ``tl.dot`` when each of the
M/N/K dims is one loop with a tile >= 16, otherwise a broadcast multiply and
``tl.sum`` (summed once after a loop that accumulates it, where the products
fit the register cap of ``pruning.deferred_sums``).
Accumulators are float32. Reductions over a sequential loop accumulate
across its iterations; when they feed values along that loop they run online
(``streaming.analyze``).

Example::

    k = print_kernel(region, plan)
    print(k.source)
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
from typing import Collection, Optional, Sequence

from jaxfuse import ir
from jaxfuse.codegen import rewrite, streaming
from jaxfuse.planner.plan import Plan
# The printer refuses what the planner prunes and defers the sums it prices.
from jaxfuse.planner.pruning import deferred_sums, dot_hazard
from jaxfuse.planner import tiling
from jaxfuse.planner.tiling import LoopNode, Stmt, next_pow2

__all__ = ["CodegenError", "PrintedKernel", "ScratchSpec", "dot_hazard", "kernel_name_for",
           "print_kernel"]


class CodegenError(RuntimeError):
  """The generator cannot produce a kernel for this region/plan."""


@dataclasses.dataclass(frozen=True)
class ScratchSpec:
  """An fp32 workspace of ``numel`` elements (split plans' partial results)."""
  name: str
  numel: int


@dataclasses.dataclass(frozen=True)
class PrintedKernel:
  source: str
  kernel_name: str
  grid: tuple[int, ...]
  constexprs: tuple[tuple[str, int], ...]
  num_warps: int
  num_stages: int
  combine_name: Optional[str] = None
  combine_grid: Optional[tuple[int, ...]] = None
  scratch: tuple[ScratchSpec, ...] = ()
  combine_constexprs: tuple[tuple[str, int], ...] = ()
  # Bytes of Triton's global scratch per program (the Gluon printer's
  # device-made TMA descriptors); 0: none.
  global_scratch: int = 0


# The combine pass of a split plan re-tiles the outputs until it has this many
# programs or tiles this small: with the main kernel's tiles (often 16 programs
# of 64x128 fp32 x parts) it read its partials at one SM's bandwidth and took
# longer than the main kernel (MC-G5 on the H100: 9.8 us vs 6.1 us, 2026-11-21).
COMBINE_MIN_PROGRAMS = 256
COMBINE_MAX_TILE_ELEMS = 1024
COMBINE_MIN_TILE = 16


_TL_DTYPE = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
             "float64": "tl.float64", "int32": "tl.int32", "int64": "tl.int64", "bool": "tl.int1"}
_FLOAT = tiling.FLOAT_DTYPES
# ir.PRECISIONS -> tl.dot's input_precision for float32 operands.
_INPUT_PRECISION = {"default": "tf32", "tf32x3": "tf32x3", "ieee": "ieee"}
_RESERVED = {"tl", "triton", "libdevice", "range", "float", "int", "min", "max", "len", "pid"}
_MAX_AXIS12 = 65535
# A causal loop is split into whole and edge tiles only when the model
# predicts at least this many program waves. Same plans with and without
# the split (H100, 2026-11-22): 8 x 16 heads at T = 512-2048, 2 or more
# waves, 2% slower to 21% faster at 4-32 key tiles; S1 and S3 causal (one
# wave of 128 programs, 4 key tiles) 6-8% slower, where each program's
# latency is the kernel's and the second loop's pipeline fill adds to it.
WHOLE_TILES_MIN_WAVES = 2


# Triton spelling of each elementwise fn ({i} is operand i). cost_model's
# ELEMENTWISE_COST prices these spellings (and _HELPERS) as they compile.
ELEMENTWISE_SPELLING = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "neg": "(-{0})", "max": "tl.maximum({0}, {1})", "min": "tl.minimum({0}, {1})",
    "abs": "tl.abs({0})", "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})",
    "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "square": "({0} * {0})",
    "erf": "tl.erf({0})", "log1p": "log1p_({0})", "expm1": "expm1_({0})",
    "tanh": "tanh_({0})", "pow": "pow_({0}, {1})",
    "logistic": "(1.0 / (1.0 + tl.exp(-{0})))",
    "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0))",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "and": "({0} & {1})", "or": "({0} | {1})",
    "not": "({0} == 0)", "select": "tl.where({0}, {2}, {1})"}


# Math without libdevice, so that the interpreter (which has no libdevice)
# runs exactly the source the GPU compiles.
_HELPERS = {
    "tanh": """def tanh_(x):
  # sign(x) * (1 - e^{-2|x|}) / (1 + e^{-2|x|}): no overflow for large |x|
  t = tl.exp(-2.0 * tl.abs(x))
  r = (1.0 - t) / (1.0 + t)
  return tl.where(x < 0, -r, r)""",
    "log1p": """def log1p_(x):
  # log(u) * x / (u - 1) with u = 1 + x corrects the rounding of 1 + x
  u = 1.0 + x
  d = u - 1.0
  return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))""",
    "expm1": """def expm1_(x):
  # (u - 1) * x / log(u) with u = e^x (Kahan); exact for small |x|
  u = tl.exp(x)
  lu = tl.log(u)
  r = tl.where(u == 1.0, x, (u - 1.0) * (x / tl.where(lu == 0.0, 1.0, lu)))
  return tl.where(u == float("inf"), u, tl.where(x < -40.0, -1.0, r))""",
    "tf32": """def tf32_(x):
  # Round to TF32's 10 mantissa bits, to nearest (ties away), as cuBLAS
  # does: Hopper's TF32 MMA reads float32 bits and drops the low 13, and
  # truncation measured 3.5x XLA's error on float32 chains (H100, 2026-11-22).
  # A NaN stays as it is (its payload could carry into infinity).
  r = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
  return tl.where(x == x, r, x)""",
    "pow": """def pow_(a, b):
  # |a|^b with the sign of a for odd integer b; NaN for a < 0 and fractional b
  r = tl.exp2(b * tl.log2(tl.abs(a)))
  fb = tl.floor(b)
  odd = (b - 2.0 * tl.floor(b * 0.5)) == 1.0
  r = tl.where(a < 0.0, tl.where(fb == b, tl.where(odd, -r, r), float("nan")), r)
  return tl.where(b == 0.0, 1.0, r)""",
}


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _plus(expr: str, k: int) -> str:
  """``expr + k`` as printed source (nothing added for 0)."""
  return expr if k == 0 else f"{expr} + {k}" if k > 0 else f"{expr} - {-k}"


def _lit(a: ir.Literal) -> str:
  v = a.value
  if isinstance(v, bool) or a.dtype == "bool":
    return "True" if v else "False"
  if a.dtype in _FLOAT:
    f = float(v)
    if math.isinf(f):
      return 'float("-inf")' if f < 0 else 'float("inf")'
    if math.isnan(f):
      return 'float("nan")'
    return repr(f)
  return repr(int(v))


@dataclasses.dataclass
class _Tile:
  """A value's tile in registers: variable, dim order (loops), dtype."""
  var: str
  order: tuple[str, ...]
  dtype: str            # IR-style dtype of the register tile
  zpad: frozenset = frozenset()   # loops along which padded lanes hold 0
  pieces: tuple = ()    # one variable per piece of a pieced loop (var is the first)


@dataclasses.dataclass
class _Open:
  """An open sequential loop while printing its body."""
  node: LoopNode
  accs: list            # values accumulating in this loop (op order)
  after: list           # statements deferred until the loop ends
  stream: Optional[streaming.StreamedLoop]


@dataclasses.dataclass(frozen=True)
class _Partial:
  """Where a split accumulator's partial results live (``scratch_layout``)."""
  value: str
  dims: tuple[str, ...]
  strides: dict
  part_size: int
  scratch: ScratchSpec


# The constexpr that turns on a printed kernel's grid dependency wait
# (``_Printer.emit_grid_dependency_wait``); 0 in the interpreter, which
# lacks the instruction.
PDL_FLAG = "USE_PDL"
GRID_WAIT_LINES = (f"if {PDL_FLAG}:", "    tl.extra.cuda.gdc_wait()")

# Triton's largest tensor (triton.language.core.TRITON_MAX_TENSOR_NUMEL).
MAX_TENSOR_NUMEL = 1 << 20

# A loaded tl.dot operand whose tile is printed in another order than the dot
# reads it (``tl.dot(a, tl.trans(b))``) is loaded in the dot's order instead
# (``_Printer.load_order``) where its reduction tile is at least
# TRANSPOSED_OPERAND_MIN_RED and its other dims' tile at least
# TRANSPOSED_OPERAND_MIN_OTHER. Why: Triton 3.6 on the H100 miscompiles that
# transpose when the loaded tile is contiguous along the other dim. BERT-Base's
# stacked q/k/v weight gradients (``pklm,kln->pmn``, l = 512 tokens, the whole
# l in one tile, 64 x 128 outputs) loaded x[l, n] as an [n, l] tile, contiguous
# along n, and returned relative errors of 1.0 (every output column wrong);
# loaded as [l, n], the same plan was correct. Hand-written probes (float16 and
# bfloat16, 4 or 8 warps, the whole reduction in one tile or a loop of 512-wide
# steps): every transposed operand of 128 x 512 contiguous along its 128 failed,
# the right one (64 rows) and the left one (128 rows, 64 columns); none did
# with a 256-wide reduction (up to 256 x 256), 64 along the other dim,
# contiguous along the reduction, or loaded in the dot's order (H100 and H200,
# seventy-first session). The interpreter runs them all correctly. Outside
# this corner loads keep the region's order: the change is not measured there.
TRANSPOSED_OPERAND_MIN_RED, TRANSPOSED_OPERAND_MIN_OTHER = 512, 128


class _Printer:

  def __init__(self, region: ir.Region, plan: Plan, kernel_name: str):
    self.r = region
    self.plan = plan
    self.name = kernel_name
    self.vm = region.value_map
    self.ext = region.loop_extents
    self.order = [l.name for l in region.loops]
    self.info = streaming.analyze(region)
    self.ops = {op.out: op for op in region.ops}
    self.op_index = {op.out: i for i, op in enumerate(region.ops)}
    self.inputs = {b.value: b for b in region.inputs}
    self.outputs = {b.value: b for b in region.outputs}
    self.lines: list[str] = []
    self.helpers: set[str] = set()
    self.ind = 1
    self.scopes: list[dict[str, _Tile]] = [{}]
    self.names_used: set[str] = set()
    self.open: list[_Open] = []
    self.acc_loop: dict[str, _Open] = {}      # value -> loop it accumulates in
    self.acc_tile: dict[str, _Tile] = {}
    self.deferred: dict[str, tuple[str, ...]] = {}   # value -> in-tile loops its acc sums last
    self.deferrable: Optional[frozenset[str]] = None  # pruning.deferred_sums of the plan
    self.scaled: dict[str, _Open] = {}        # value -> loop whose running max it uses
    # Masking values printed as their kept operand here (tiles the mask keeps whole).
    self.whole_kept: dict[str, str] = {}
    self.lazy_loads = False                   # combine pass: load inputs where first needed
    self.lpt: Optional[tuple[str, list[str], int]] = None   # see grid_axes
    self.heavy: set[str] = set()                            # heavy_first_loops of the plan
    self._setup_loops()
    # Inputs whose tiles are an earlier input's (one array read twice).
    self.shared = tiling.shared_loads(region, plan.expr, plan.tile_map)

  # ------------------------------------------------------------------ setup
  def _setup_loops(self) -> None:
    plan, r = self.plan, self.r
    tiles = plan.tile_map
    for l in self.order:
      if l not in tiles:
        raise CodegenError(f"plan has no tile for loop {l}")
    seq = []

    def walk(nodes):
      for n in nodes:
        if isinstance(n, LoopNode):
          seq.append(n.loop)
          walk(n.body)
    walk(plan.expr.body)
    self.seq = set(seq)
    self.grid_loops = tuple(plan.grid)
    for l in self.grid_loops:
      if l not in self.ext:
        raise CodegenError(f"grid loop {l} is not a loop of the region")
      if l in self.seq:
        raise CodegenError(f"loop {l} is both a program-id loop and sequential")
    self.split = plan.split
    if self.split:
      sl, parts = self.split
      if sl not in self.seq:
        raise CodegenError(f"split loop {sl} must be a sequential loop of the plan")
      if parts < 1:
        raise CodegenError(f"split parts must be >= 1, got {parts}")
    self.T: dict[str, int] = {}
    self.kind: dict[str, str] = {}
    dot_dims = self._dot_dims()
    for l in self.order:
      t = int(tiles[l])
      if t < 1:
        raise CodegenError(f"tile of {l} must be >= 1, got {t}")
      if l in self.grid_loops:
        self.kind[l] = "grid"
      elif l in self.seq:
        self.kind[l] = "seq"
      else:
        if t < self.ext[l]:
          raise CodegenError(f"loop {l} (extent {self.ext[l]}) has tile {t} but is neither "
                             "a program-id loop nor sequential")
        self.kind[l] = "single"
      t = next_pow2(t)
      if self.kind[l] == "single":
        t = min(t, next_pow2(self.ext[l]))
        if l in dot_dims and 1 < t < 16:
          t = 16   # tl.dot needs >= 16; the padding is masked
      self.T[l] = t
    hazard = dot_hazard(r, tiles, tf32=False)
    if hazard:
      raise CodegenError(hazard)
    # Single tiles of K-only loops print as power-of-two pieces (64 + 16 for 80).
    self.pieces: dict[str, tuple[tuple[int, int], ...]] = {}
    for l, sizes in tiling.pieced_loops(r, self.T, [x for x in self.order
                                                    if self.kind[x] == "single"]).items():
      starts = [sum(sizes[:i]) for i in range(len(sizes))]
      self.pieces[l] = tuple(zip(starts, sizes))
    self.piece: dict[str, int] = {}   # loop -> the piece being printed
    # Names of loop extents and tiles in the kernel signature.
    taken = {self._sanitize(v.name) for v in r.values}
    self.EXT, self.BLK = {}, {}
    for l in self.order:
      up = l.upper()
      e = up if (up not in taken and up.isidentifier() and not keyword.iskeyword(up)
                 and sum(1 for x in self.order if x.upper() == up) == 1) else f"EXT_{l}"
      self.EXT[l] = e
      self.BLK[l] = f"BLOCK_{up}" if sum(1 for x in self.order if x.upper() == up) == 1 else f"BLOCK_{l}"

  def _dot_dims(self) -> set[str]:
    out = set()
    for op in self.r.contractions:
      a, b = set(self.vm[op.lhs].loops), set(self.vm[op.rhs].loops)
      o = set(self.vm[op.out].loops)
      out |= (a & o) - b
      out |= (b & o) - a
      out |= (a & b) & set(op.reduce)
    return out

  # ------------------------------------------------------------- utilities
  @staticmethod
  def _sanitize(name: str) -> str:
    s = "".join(c if (c.isalnum() or c == "_") else "_" for c in name)
    if not s or s[0].isdigit():
      s = "v_" + s
    if keyword.iskeyword(s) or s in _RESERVED or s.startswith(("offs_", "mask_", "acc_", "start_",
                                                                "i_", "pid_", "BLOCK_", "EXT_")):
      s = s + "_v"
    return s

  def emit(self, line: str) -> None:
    self.lines.append("  " * self.ind + line)

  def fresh(self, base: str) -> str:
    """A variable name not bound in any open scope (avoids loop-carried clashes)."""
    if not any(t.var == base for sc in self.scopes for t in sc.values()) and base not in self.names_used:
      self.names_used.add(base)
      return base
    i = 1
    while f"{base}_{i}" in self.names_used:
      i += 1
    self.names_used.add(f"{base}_{i}")
    return f"{base}_{i}"

  def lookup(self, v: str) -> Optional[_Tile]:
    for sc in reversed(self.scopes):
      if v in sc:
        return sc[v]
    return None

  def bind(self, v: str, tile: _Tile) -> None:
    self.scopes[-1][v] = tile

  def bl(self, v: str) -> tuple[str, ...]:
    """Block loops of a value: its loops with a tile > 1, in region order."""
    ls = set(self.vm[v].loops)
    return tuple(l for l in self.order if l in ls and self.T[l] > 1)

  def needs_mask(self, l: str) -> bool:
    if l in self.pieces:
      start, size = self.pieces[l][self.piece[l]]
      return start + size > self.ext[l]
    return self.T[l] > 1 and self.ext[l] % self.T[l] != 0

  def _suffix(self, l: str) -> str:
    return f"_{self.piece[l]}" if l in self.pieces else ""

  def idx1(self, l: str) -> str:
    """1-D offsets (tile > 1) or scalar index (tile 1) of loop ``l`` (of
    the current piece for a pieced loop)."""
    return f"offs_{l}{self._suffix(l)}" if self.T[l] > 1 else f"i_{l}"

  def mask_var(self, l: str) -> str:
    return f"mask_{l}{self._suffix(l)}"

  def blk(self, l: str) -> str:
    return str(self.pieces[l][self.piece[l]][1]) if l in self.pieces else self.BLK[l]

  def expand(self, expr: str, src: Sequence[str], dst: Sequence[str]) -> str:
    """Broadcasts a tile with dims ``src`` to dims ``dst`` (src within dst)."""
    src, dst = tuple(src), tuple(dst)
    if not src or src == dst:
      return expr
    missing = [l for l in src if l not in dst]
    if missing:
      raise CodegenError(f"cannot broadcast dims {src} to {dst}")
    rel = tuple(l for l in dst if l in src)
    if rel != src:
      expr = self.permute(expr, src, rel)
    if len(rel) == len(dst):
      return expr
    return f"{expr}[{', '.join(':' if l in src else 'None' for l in dst)}]"

  @staticmethod
  def permute(expr: str, src: Sequence[str], dst: Sequence[str]) -> str:
    src, dst = tuple(src), tuple(dst)
    if src == dst:
      return expr
    if len(src) == 2:
      return f"tl.trans({expr})"
    return f"tl.permute({expr}, ({', '.join(str(src.index(l)) for l in dst)}))"

  def mask_expr(self, dims: Sequence[str]) -> Optional[str]:
    ms = [l for l in dims if self.needs_mask(l)]
    if not ms:
      return None
    return " & ".join(self.expand(self.mask_var(l), (l,), dims) for l in ms)

  def float32_operand(self, expr: str, t: _Tile, ir_dtype: str) -> str:
    """``expr`` (tile ``t``, or a masked or permuted view of it) as a
    contraction computed in float32 reads it. A value of 16-bit ``ir_dtype``
    that the kernel computed in float32 registers is rounded to that dtype
    first: elementwise intermediates keep float32 (excess precision, as
    XLA's fusions do), but a contraction that mixes such a value with a
    float32 one reads what the program rounded, as a 16-bit ``tl.dot``
    reads its rounded operands. Why: a float32 program's
    ``relu(x @ w.astype(bfloat16)) @ w2`` ran with unrounded weights, 2.1e-3
    off the program (XLA on the H100 rounds them in this chain) and over
    the self-check's tolerance (sixty-third session's fuzzing). Triton's
    interpreter truncates to bfloat16 where the GPU rounds to nearest."""
    if t.dtype == "float32" and ir_dtype in ("float16", "bfloat16"):
      return f"{expr}.to({_TL_DTYPE[ir_dtype]}).to(tl.float32)"
    return expr if t.dtype == "float32" else f"{expr}.to(tl.float32)"

  def f32(self, t: _Tile) -> str:
    if t.dtype in ("float16", "bfloat16"):
      return f"{t.var}.to(tl.float32)"
    return t.var

  def shape(self, dims: Sequence[str]) -> str:
    return "(" + ", ".join(self.blk(l) for l in dims) + ("," if len(dims) == 1 else "") + ")"

  # ----------------------------------------------------------- the kernel
  def offset_args(self) -> list[str]:
    """One int argument per window input: its offset, given at launch
    (``ir.Buffer.window``). They follow the input pointers."""
    return [f"{self._sanitize(b.value)}_off" for b in self.r.inputs if b.window]

  def decorator(self) -> str:
    # Offsets are not specialized (Triton would compile once per value class):
    # the kernel rounds them to their known multiple itself.
    args = self.offset_args()
    return f"@triton.jit(do_not_specialize={args!r})" if args else "@triton.jit"

  def emit_window_bases(self) -> None:
    """Moves each window input's pointer to its window. ``(off // A) * A``
    tells Triton the shift is a multiple of ``A`` elements, so the pointer
    keeps the alignment the loads were compiled for."""
    a = ir.WINDOW_ALIGN
    for b in self.r.inputs:
      if b.window:
        n = self._sanitize(b.value)
        self.emit(f"{n}_ptr = {n}_ptr + ({n}_off // {a}) * {a}")

  def emit_part_bases(self, outputs: bool = True) -> None:
    """Picks each part buffer's array by the part loop's program id (one
    scalar select per program: a program reads and writes one part).
    ``outputs``: the kernel takes the output pointers."""
    bufs = [(b, f"{self._sanitize(b.value)}_ptr") for b in self.r.inputs if b.part_loop]
    if outputs:
      bufs += [(b, self.out_ptr(b.value)) for b in self.r.outputs if b.part_loop]
    if not bufs:
      return
    p = self.r.part_loop
    if self.kind.get(p) != "grid" or self.T[p] != 1:
      raise CodegenError(f"part loop {p} must be a program id of tile 1")
    n = self.ext[p]
    for i in range(n):
      head = "if" if i == 0 else ("else" if i == n - 1 else "elif")
      self.emit(f"{head} pid_{p} == {i}:" if head != "else" else "else:")
      for _, name in bufs:
        self.emit(f"    {name} = {name}{i}")

  def _ptr_args(self, buf: ir.Buffer, name: str) -> list[str]:
    return [f"{name}{i}" for i in range(buf.parts)] if buf.part_loop else [name]

  def signature(self, extra_ptrs: Sequence[str], outputs: bool = True) -> str:
    """Inputs (a part buffer's arrays one by one), window offsets,
    ``extra_ptrs`` (scratch), outputs (not for a split plan's main kernel,
    which writes only scratch), constexprs."""
    ptrs = [a for b in self.r.inputs for a in self._ptr_args(b, f"{self._sanitize(b.value)}_ptr")]
    ptrs += self.offset_args()
    ptrs += list(extra_ptrs)
    if outputs:
      ptrs += [a for b in self.r.outputs for a in self._ptr_args(b, self.out_ptr(b.value))]
    consts = [f"{self.EXT[l]}: tl.constexpr" for l in self.order]
    consts += [f"{self.BLK[l]}: tl.constexpr" for l in self.order]
    consts.append(f"{PDL_FLAG}: tl.constexpr")
    return ", ".join(ptrs + consts)

  def out_ptr(self, v: str) -> str:
    return (f"{self._sanitize(v)}_out_ptr" if v in self.inputs else f"{self._sanitize(v)}_ptr")

  def constexprs(self) -> tuple[tuple[str, int], ...]:
    return tuple([(self.EXT[l], self.ext[l]) for l in self.order] +
                 [(self.BLK[l], self.T[l]) for l in self.order] + [(PDL_FLAG, 0)])

  def emit_grid_dependency_wait(self) -> None:
    """With ``PDL_FLAG`` set (``codegen.generate(grid_wait=True)`` on Hopper
    and newer, asked for when launches are recorded), the kernel's first instruction
    waits until the grids it depends on have finished and their writes are
    visible. XLA may then start it while the previous kernel still runs
    (programmatic dependent launch), as it does its own kernels; launched
    otherwise the wait returns at once."""
    for line in GRID_WAIT_LINES:
      self.emit(line)

  def grid_axes(self, heavy: Collection[str] = ()) -> tuple[list[list[str]], tuple[int, ...]]:
    """Program-id axes: innermost grid loop on axis 0; extra loops folded.
    With one ``heavy`` loop (``heavy_first_loops``) and other grid
    positions, one axis in chunked longest-first order (``self.lpt``, see
    ``emit_lpt_program_ids``)."""
    loops = list(self.grid_loops)
    counts = {l: _cdiv(self.ext[l], self.T[l]) for l in loops}
    extra = ["__split__"] if self.split else []
    if self.split:
      counts["__split__"] = self.split[1]
    allx = extra + loops     # outermost first; the split axis outermost
    self.grid_counts = counts
    self.lpt = None
    if not allx:
      return [], (1,)
    rev = list(reversed(allx))
    if len(heavy) == 1:
      (h,) = heavy
      others = [l for l in rev if l != h]
      sharing = self._sharing_loops(h, others)
      chunk = math.prod(counts[l] for l in sharing)
      if counts.get(h, 1) > 1 and chunk > 1:
        self.lpt = (h, sharing + [l for l in others if l not in sharing], chunk)
        return [rev], (counts[h] * math.prod(counts[l] for l in others),)
    axes: list[list[str]] = [[rev[0]]]
    rest = rev[1:]
    if rest:
      axes.append([rest[0]])
      rest = rest[1:]
    if rest:
      axes.append(list(rest))
    sizes = tuple(math.prod(counts[l] for l in ax) for ax in axes)
    if any(s > _MAX_AXIS12 for s in sizes[1:]):
      axes, sizes = [rev], (math.prod(counts[l] for l in rev),)
    self.grid_counts = counts
    return axes, sizes

  def _sharing_loops(self, heavy: str, others: Sequence[str]) -> list[str]:
    """Grid loops in ``others`` that index none of the inputs ``heavy``
    does not index: the query heads that read one key/value head (grouped-
    and multi-query attention). Their programs read the same keys and
    values, so they are issued together (``emit_lpt_program_ids``)."""
    shared = [self.vm[b.value].loops for b in self.r.inputs if heavy not in self.vm[b.value].loops]
    return [l for l in others if l != "__split__" and not any(l in ls for ls in shared)]

  @staticmethod
  def _pid_name(l: str) -> str:
    return "part" if l == "__split__" else f"pid_{l}"

  def emit_lpt_program_ids(self) -> None:
    """Program ids in chunked longest-first order (``self.lpt``: the heavy
    loop, the other grid loops innermost first, the chunk: the positions of
    the leading ``_sharing_loops``). Within a chunk the heavy loop counts
    down outermost, so the longest programs of every query head that reads
    one key/value head start first and together, and the chunk ends with
    short ones. Chunks of the heads that share keys and values ran 6-17%
    faster than one head after another (H100, 2026-11-23). Chunks of heads
    that read different ones are not formed: the same probe measured them
    3-11% faster at d=64 but up to 7% slower at d=128, where a chunk's
    heads no longer share L2."""
    h, others, chunk = self.lpt
    counts = self.grid_counts
    mh = counts[h]
    positions = math.prod(counts[l] for l in others)
    self.emit("pid_lpt = tl.program_id(0)")
    if chunk >= positions:
      self.emit(f"{self._pid_name(h)} = {mh - 1} - pid_lpt // {positions}")
      self.emit(f"pid_rest = pid_lpt % {positions}")
    else:
      span = chunk * mh
      self.emit(f"pid_chunk = pid_lpt // {span}")
      self.emit(f"pid_lpt = pid_lpt % {span}")
      self.emit(f"{self._pid_name(h)} = {mh - 1} - pid_lpt // {chunk}")
      self.emit(f"pid_rest = pid_chunk * {chunk} + pid_lpt % {chunk}")
    for j, l in enumerate(others):
      if j == len(others) - 1:
        self.emit(f"{self._pid_name(l)} = pid_rest")
      else:
        self.emit(f"{self._pid_name(l)} = pid_rest % {counts[l]}")
        self.emit(f"pid_rest = pid_rest // {counts[l]}")

  def emit_program_ids(self, axes: list[list[str]], reverse: set[str] = frozenset()) -> None:
    """Program ids per grid loop; loops in ``reverse`` count down."""
    if self.lpt is not None:
      self.emit_lpt_program_ids()
      return
    counts = self.grid_counts

    def order(l, e):
      return f"{counts[l] - 1} - {e}" if l in reverse and counts[l] > 1 else e
    for i, ax in enumerate(axes):
      if len(ax) == 1:
        nm = self._pid_name(ax[0])
        self.emit(f"{nm} = {order(ax[0], f'tl.program_id({i})')}")
        continue
      self.emit(f"pid{i} = tl.program_id({i})")
      rem = f"pid{i}"
      for j, l in enumerate(ax):   # innermost first within the folded axis
        nm = self._pid_name(l)
        if j == len(ax) - 1:
          self.emit(f"{nm} = {order(l, rem)}")
        else:
          self.emit(f"{nm} = {order(l, f'{rem} % {counts[l]}')}")
          self.emit(f"{rem} = {rem} // {counts[l]}")

  def emit_loop_indices(self) -> None:
    for l in self.order:
      k, T = self.kind[l], self.T[l]
      if k == "grid":
        if T > 1:
          self.emit(f"offs_{l} = pid_{l} * {self.BLK[l]} + tl.arange(0, {self.BLK[l]})")
        else:
          self.emit(f"i_{l} = pid_{l}")
      elif k == "single" and l in self.pieces:
        self.emit(f"# {l} in pieces of " + " + ".join(str(n) for _, n in self.pieces[l]))
        for i, (start, size) in enumerate(self.pieces[l]):
          self.piece[l] = i
          self.emit(f"offs_{l}_{i} = " + (f"{start} + " if start else "") + f"tl.arange(0, {size})")
          if self.needs_mask(l):
            self.emit(f"{self.mask_var(l)} = offs_{l}_{i} < {self.EXT[l]}")
        del self.piece[l]
        continue
      elif k == "single":
        if T > 1:
          self.emit(f"offs_{l} = tl.arange(0, {self.BLK[l]})")
        else:
          self.emit(f"i_{l} = 0")
      else:
        continue
      if self.needs_mask(l):
        self.emit(f"mask_{l} = offs_{l} < {self.EXT[l]}")

  # ---------------------------------------------------- loads and stores
  def address(self, buf: ir.Buffer, dims: Sequence[str], big: bool) -> str:
    terms = [str(buf.static_offset)] if buf.static_offset else []
    for l in self.vm[buf.value].loops:
      s = 0 if l == buf.part_loop else buf.stride(l)   # the part picks the array
      if s == 0 and self.T[l] > 1 and l in dims:
        continue   # broadcast: handled by expanding the loaded tile
      if s == 0:
        continue
      ix = self.idx1(l)
      if big:
        ix = f"{ix}.to(tl.int64)"
      e = self.expand(ix, (l,), dims) if self.T[l] > 1 else ix
      terms.append(e if s == 1 else f"{e} * {s}")
    return " + ".join(terms) if terms else "0"

  def emit_load(self, v: str) -> None:
    u, pairs = self.shared.get(v, (None, None))
    t = self.lookup(u) if u else None
    if t is not None and not t.pieces:
      # The same elements of the same array: the kernel holds them already.
      back = {lu: lv for lv, lu in pairs.items()}
      self.bind(v, _Tile(t.var, tuple(back[l] for l in t.order), t.dtype,
                         frozenset(back[l] for l in t.zpad)))
      return
    pl = [l for l in self.bl(v) if l in self.pieces]
    if not pl:
      return self._emit_load(v)
    l, = pl   # pieced loops are the K loop of their dots: one per operand
    tiles = []
    for i in range(len(self.pieces[l])):
      self.piece[l] = i
      self._emit_load(v)
      tiles.append(self.lookup(v))
    del self.piece[l]
    zpad = frozenset().union(*(t.zpad for t in tiles))
    self.bind(v, _Tile(tiles[0].var, tiles[0].order, tiles[0].dtype, zpad,
                       tuple(t.var for t in tiles)))

  def _emit_load(self, v: str) -> None:
    buf = self.inputs.get(v)
    if buf is None:
      raise CodegenError(f"plan loads {v}, which is not a region input")
    dims = self.load_order(v)
    # Load only the dims the buffer varies along; broadcast the rest.
    ld = tuple(l for l in dims if buf.stride(l) != 0)
    big = buf.size >= 2 ** 31
    ptr = f"{self._sanitize(v)}_ptr + {self.address(buf, ld, big)}"
    m = self.mask_expr(ld)
    dtype = self.vm[v].dtype
    var = self.fresh(self._sanitize(v))
    if m:
      other = "0" if dtype in ("bool", "int32", "int64") else "0.0"
      expr = f"tl.load({ptr}, mask={m}, other={other})"
    else:
      expr = f"tl.load({ptr})"
    if dtype == "bool":
      expr = f"{expr} != 0"
    if ld != dims:
      expr = f"tl.broadcast_to({self.expand(f'({expr})', ld, dims)}, {self.shape(dims)})"
    self.emit(f"{var} = {expr}")
    self.bind(v, _Tile(var, dims, dtype, frozenset(l for l in ld if self.needs_mask(l))))

  def load_order(self, v: str) -> tuple[str, ...]:
    """The dim order to load input ``v``'s tile in: its block loops in
    region order (``bl``), or, where that tile is a ``tl.dot`` operand in
    the corner ``TRANSPOSED_OPERAND_MIN_RED`` names, the order the dot reads
    it in, so that no ``tl.trans`` of it is printed. Only when every
    contraction that reads ``v`` as a dot reads it in that one order (other
    readers permute the tile as they would any other)."""
    dims = self.bl(v)
    wants = {self._dot_operand_order(op, v) for op in self.r.consumers(v)
             if isinstance(op, ir.Contraction)}
    if len(wants) != 1:
      return dims
    want, = wants
    if want is None or want[0] == dims or set(want[0]) != set(dims):
      return dims
    order, k = want
    red = math.prod(self.T[l] for l in k)
    other = math.prod(self.T[l] for l in order if l not in k)
    if red >= TRANSPOSED_OPERAND_MIN_RED and other >= TRANSPOSED_OPERAND_MIN_OTHER:
      return order
    return dims

  def _dot_operand_order(self, op: ir.Contraction, v: str
                         ) -> Optional[tuple[tuple[str, ...], frozenset]]:
    """(dim order, K loops) in which ``contraction_expr`` hands operand
    ``v`` of ``op`` to ``tl.dot`` (``dot_layout``), or None where ``op``
    is not one ``tl.dot`` or reads ``v`` twice."""
    if (op.lhs == v) == (op.rhs == v):
      return None
    accumulated = bool(set(op.reduce) & self.seq)   # emit_compute's test
    layout = self.dot_layout(op, self.bl(op.lhs), self.bl(op.rhs), accumulated)
    if layout is None:
      return None
    bat, M, N, K, swapped = layout
    left = (op.lhs == v) != swapped
    return (tuple(bat + M + K) if left else tuple(bat + K + N)), frozenset(K)

  def dot_layout(self, op: ir.Contraction, lhs_loops, rhs_loops, accumulating: bool
                 ) -> Optional[tuple[list, list, list, list, bool]]:
    """``(batch, M, N, K, swapped)``: how ``op`` runs as one ``tl.dot`` on
    operand tiles over ``lhs_loops`` and ``rhs_loops``, each role's loops in
    region order; ``swapped``: the dot computes it as (rhs^T lhs^T)^T
    (``_swap_dot_operands``; never when ``accumulating``), with M and N
    already exchanged. None where ``op`` is not one ``tl.dot``."""
    out_dims = self.bl(op.out)
    red_in = [l for l in op.reduce if self.T[l] > 1]
    dts = (self.vm[op.lhs].dtype, self.vm[op.rhs].dtype)
    roles = tiling.dot_roles(set(lhs_loops), set(rhs_loops), out_dims, red_in, self.T, dts)
    if roles is None:
      return None
    bat, M, N, K = ([l for l in self.order if l in r] for r in roles)
    swapped = (self._swap_accumulated(op) if accumulating
               else self._swap_dot_operands(op, bat + M + N, bat + N + M, out_dims))
    if swapped:
      M, N = N, M
    return bat, M, N, K, swapped

  def emit_store(self, v: str) -> None:
    buf = self.outputs.get(v)
    if buf is None:
      raise CodegenError(f"plan stores {v}, which is not a region output")
    t = self.need(v)
    dims = self.bl(v)
    big = buf.size >= 2 ** 31
    val = self.expand(t.var, t.order, dims)
    dt = self.vm[v].dtype
    cast = f"{val}.to({_TL_DTYPE[dt]})" if dt != "bool" else f"{val}.to(tl.int1)"
    m = self.mask_expr(dims)
    ptr = f"{self.out_ptr(v)} + {self.address(buf, dims, big)}"
    if dims and t.order != dims:
      pass
    self.emit(f"tl.store({ptr}, {cast}" + (f", mask={m})" if m else ")"))

  # ----------------------------------------------------------- values
  def need(self, v: str) -> _Tile:
    """The final tile of ``v``, computing it now when only cheap ops are missing."""
    t = self.lookup(v)
    if t is not None:
      if v in self.acc_loop and self.acc_loop[v] in self.open:
        raise CodegenError(f"{v} is read before its reduction over "
                           f"{self.acc_loop[v].node.loop} is complete")
      return t
    if v in self.inputs and self.lazy_loads:
      self.emit_load(v)
      return self.lookup(v)
    op = self.ops.get(v)
    if isinstance(op, (ir.Elementwise, ir.Iota)):
      self.emit_compute(v)
      t = self.lookup(v)
      if t is not None:
        return t
    raise CodegenError(f"value {v} is used where the plan has not computed or loaded it")

  def operand(self, v: str) -> _Tile:
    """An operand tile inside the current loop nest (running values allowed)."""
    t = self.lookup(v)
    if t is not None:
      return t
    return self.need(v)

  def emit_compute(self, v: str) -> None:
    op = self.ops.get(v)
    if op is None:
      raise CodegenError(f"plan computes {v}, which no op defines")
    # Accumulation in an open loop?
    red = set(op.reduce) if isinstance(op, ir.Contraction) else (
        {op.loop} if isinstance(op, ir.Reduction) else set())
    if red & self.seq:
      outer = next((o for o in self.open if o.node.loop in red), None)
      if outer is None:
        raise CodegenError(f"{v} reduces sequential loop(s) {sorted(red & self.seq)} but is "
                           "computed outside them")
      return self.emit_accumulate(v, op, outer)
    # Reads a value still accumulating in an open loop?
    pending = [self.acc_loop[i] for i in op.inputs
               if i in self.acc_loop and self.acc_loop[i] in self.open]
    pending += [self.scaled[i] for i in op.inputs if i in self.scaled and self.scaled[i] in self.open]
    if pending:
      lp = min(pending, key=self.open.index)
      st = lp.stream
      n = lp.node.loop
      if st is not None and st.scale_of(v) is not None:
        return self.emit_streamed(v, op, lp)
      if n not in self.vm[v].loops:
        lp.after.append(Stmt("C", v))     # needs the finished reduction: after the loop
        return
      raise CodegenError(f"{v} reads a reduction over sequential loop {n} along {n}; "
                         f"not streamable ({self.info.single_tile.get(n, 'unknown')})")
    self.emit_plain(v, op)

  def emit_plain(self, v: str, op) -> None:
    out = self.vm[v]
    dims = self.bl(v)
    var = self.fresh(self._sanitize(v))
    if isinstance(op, ir.Iota):
      l = op.loop
      self.emit(f"{var} = {self.idx1(l)}")
      self.bind(v, _Tile(var, dims, "int32"))
      return
    if isinstance(op, ir.Elementwise):
      expr, dt = self.elementwise(op, dims)
      self.emit(f"{var} = {expr}")
      self.bind(v, _Tile(var, dims, dt))
      return
    if isinstance(op, ir.Reduction):
      a = self.operand(op.arg)
      expr = self.reduce_expr(op, a)
      self.emit(f"{var} = {expr}")
      self.bind(v, _Tile(var, dims, "float32" if out.dtype in _FLOAT else out.dtype))
      return
    expr, order = self.contraction_expr(op, None)
    if order != dims:
      expr = self.permute(expr, order, dims)
    self.emit(f"{var} = {expr}")
    self.bind(v, _Tile(var, dims, "float32"))

  def elementwise(self, op: ir.Elementwise, dims) -> tuple[str, str]:
    out_dt = self.vm[op.out].dtype
    args = []
    kinds = []
    tiles = []
    for a in op.args:
      if isinstance(a, ir.Literal):
        args.append(_lit(a))
        kinds.append(a.dtype)
        tiles.append(None)
      else:
        t = self.operand(a)
        args.append(self.expand(self.f32(t), t.order, dims))
        kinds.append(t.dtype)
        tiles.append(t)
    fn = op.fn
    A = args
    float_out = out_dt in _FLOAT
    if (fn == "div" and float_out and tiles[1] is not None
        and len(tiles[1].order) < len(dims) and op.out not in self.whole_kept):
      # A division by a broadcast row or column: one reciprocal per divisor
      # element and a multiply per result. Each fp32 division is a MUFU.RCP,
      # which the softmax's exp already keeps busy: autodiff's dq kernel ran
      # 491.0 us dividing, 420.8 us multiplying (H100, eightieth session).
      t = tiles[1]
      fn, A = "mul", [A[0], self.expand(f"(1.0 / {self.f32(t)})", t.order, dims)]
    if fn in _HELPERS:
      self.helpers.add(fn)
    if op.out in self.whole_kept:
      expr = A[op.args.index(self.whole_kept[op.out])]
    elif fn == "convert":
      src = kinds[0]
      if float_out:
        expr = A[0] if src in _FLOAT else f"{A[0]}.to(tl.float32)"
      elif out_dt == "bool":
        expr = f"({A[0]} != 0)"
      else:
        expr = f"{A[0]}.to({_TL_DTYPE[out_dt]})"
    elif fn in ELEMENTWISE_SPELLING:
      expr = ELEMENTWISE_SPELLING[fn].format(*A)
    else:
      raise CodegenError(f"no Triton spelling for elementwise fn {fn!r}")
    if float_out:
      dt = "float32"
      # Literal-only or integer results used as floats: make the dtype explicit.
      if not dims and all(isinstance(a, ir.Literal) for a in op.args):
        expr = f"tl.full((), {expr}, tl.float32)"
      elif dims and fn in ("sign", "select") and all(isinstance(a, ir.Literal) for a in op.args[1:]):
        expr = f"tl.broadcast_to({expr}, {self.shape(dims)}).to(tl.float32)"
      elif dims and len(set(self._arg_dims(op))) == 0:
        expr = f"tl.broadcast_to({expr}, {self.shape(dims)})"
      return expr, dt
    if out_dt == "bool":
      return expr, "bool"
    return (f"({expr}).to({_TL_DTYPE[out_dt]})" if fn not in ("convert",) else expr), out_dt

  def _arg_dims(self, op) -> list:
    out = []
    for a in op.args:
      if isinstance(a, str):
        out += list(self.bl(a))
    return out

  def reduce_expr(self, op: ir.Reduction, a: _Tile) -> str:
    l = op.loop
    if self.T[l] == 1:
      return self.f32(a)   # a single element: nothing to reduce
    x = self.f32(a)
    axis = a.order.index(l)
    # max(c*x) == c*max(x) exactly for c > 0 (rounding is monotone): reducing
    # x leaves c*x with a single use, which the compiler fuses into the FMA
    # that consumes it (softmax's c*x - max), one multiply less per element.
    scale = ""
    if op.kind == "max":
      ps = rewrite.positive_scale(self.ops.get(op.arg))
      xt = self.lookup(ps[0]) if ps is not None else None
      if xt is not None and xt.order == a.order:
        x, scale = self.f32(xt), f" * {_lit(ps[1])}"
    if self.needs_mask(l) and (op.kind == "max" or l not in a.zpad):
      fill = 'float("-inf")' if op.kind == "max" else "0.0"
      x = f"tl.where({self.expand(f'mask_{l}', (l,), a.order)}, {x}, {fill})"
    return f"tl.{op.kind}({x}, axis={axis}){scale}"

  def masked_operand(self, t: _Tile, red: Sequence[str]) -> str:
    x = t.var
    for l in red:
      if l in t.order and self.needs_mask(l) and l not in t.zpad:
        x = f"tl.where({self.expand(self.mask_var(l), (l,), t.order)}, {x}, 0.0)"
    return x

  def contraction_expr(self, op: ir.Contraction, acc: Optional[str],
                       acc_order: Optional[tuple] = None,
                       keep: Sequence[str] = ()) -> tuple[str, tuple[str, ...]]:
    """Per-tile ``sum lhs*rhs`` over the in-tile reduced loops.

    Returns the expression and its dim order; with ``acc``, the expression
    accumulates into it (``acc_order`` must then match the returned order).
    ``keep``: in-tile reduced loops left unsummed (a broadcast product whose
    sum ``deferred_sum`` moved past the loop).
    """
    a, b = self.operand(op.lhs), self.operand(op.rhs)
    red_in = [l for l in op.reduce if self.T[l] > 1]
    out_dims = self.bl(op.out)
    A, B = set(a.order), set(b.order)
    dtA, dtB = self.vm[op.lhs].dtype, self.vm[op.rhs].dtype
    layout = self.dot_layout(op, A, B, acc is not None)
    use_dot = layout is not None
    if use_dot:
      bat, M, N, K, swapped = layout
      if swapped:
        # C = A.B as (B^T.A^T)^T: tl.dot yields C in its own order.
        a, b, dtA, dtB = b, a, dtB, dtA
    pk = next((l for l in red_in if l in self.pieces), None)
    if pk is not None and not (use_dot and a.pieces and b.pieces):
      raise CodegenError(f"internal: pieced loop {pk} in {op.out}, which is not one tl.dot")
    if use_dot:
      if dtA == dtB and dtA in ("float16", "bfloat16"):
        ddt, prec = _TL_DTYPE[dtA], ""
      else:
        ddt, prec = "tl.float32", f', input_precision="{_INPUT_PRECISION[op.precision]}"'

      def operands(ta: _Tile, tb: _Tile) -> tuple[str, str]:
        xa, xb = self.masked_operand(ta, red_in), self.masked_operand(tb, red_in)
        ea = self.permute(xa, ta.order, tuple(bat + M + K))
        eb = self.permute(xb, tb.order, tuple(bat + K + N))
        if ddt == "tl.float32":
          ea, eb = self.float32_operand(ea, ta, dtA), self.float32_operand(eb, tb, dtB)
        else:
          ea = f"{ea}.to({ddt})" if not (ta.dtype == dtA and _TL_DTYPE[dtA] == ddt) or xa != ta.var else ea
          eb = f"{eb}.to({ddt})" if not (tb.dtype == dtB and _TL_DTYPE[dtB] == ddt) or xb != tb.var else eb
        if prec and op.precision == "default":
          # 16-bit operands (rounded above) are exact in TF32; only float32 ones need rounding.
          self.helpers.add("tf32")
          ea = f"tf32_({ea})" if dtA == "float32" else ea
          eb = f"tf32_({eb})" if dtB == "float32" else eb
        return ea, eb
      order = tuple(bat + M + N)
      expr = acc
      # A pieced K loop: one dot per piece, chained through the accumulator.
      for i in range(len(self.pieces[pk]) if pk else 1):
        ta, tb = a, b
        if pk:
          self.piece[pk] = i
          ta, tb = (dataclasses.replace(t, var=t.pieces[i]) for t in (a, b))
        ea, eb = operands(ta, tb)
        expr = f"tl.dot({ea}, {eb}, {expr}{prec})" if expr is not None else f"tl.dot({ea}, {eb}{prec})"
      self.piece.pop(pk, None)
      return expr, order
    xa, xb = self.masked_operand(a, red_in), self.masked_operand(b, red_in)
    # Broadcast multiply and sum (tiny tiles, several loops per role).
    U = tuple(l for l in self.order if l in A or l in B)
    numel = math.prod(self.T[l] for l in U)
    if numel > MAX_TENSOR_NUMEL:
      # Refused here, before a compile that can only fail.
      raise CodegenError(f"contraction {op.out}: a broadcast product of {numel} elements "
                         f"exceeds Triton's tensor limit ({MAX_TENSOR_NUMEL})")
    # Rounded only against a float32 operand: a 16-bit product keeps its
    # float32 intermediates, as its elementwise ops do.
    mixed = "float32" in (self.vm[op.lhs].dtype, self.vm[op.rhs].dtype)
    fa = self.float32_operand(xa, a, self.vm[op.lhs].dtype if mixed else "float32")
    fb = self.float32_operand(xb, b, self.vm[op.rhs].dtype if mixed else "float32")
    expr = f"{self.expand(fa, a.order, U)} * {self.expand(fb, b.order, U)}"
    cur = list(U)
    for l in red_in:
      if l in keep:
        continue
      expr = f"tl.sum({expr}, axis={cur.index(l)})"
      cur.remove(l)
    order = tuple(cur)
    if keep:
      out_dims = tuple(l for l in U if l in out_dims or l in keep)
    if order != out_dims:
      raise CodegenError(f"contraction {op.out}: unexpected dims {order} != {out_dims}")
    if not U or not order and not red_in:
      expr = f"({expr})"
    if acc is not None:
      return f"{acc} + {expr}", order
    return expr, order

  def _swap_dot_operands(self, op: ir.Contraction, order, swapped, out_dims) -> bool:
    """Whether to give ``tl.dot`` the operands of ``op`` in the other order.

    Yes when only the other order yields the result in ``out_dims`` (the
    tile order its consumers read), unless that moves a tile computed in
    registers out of tl.dot's left operand (wgmma reads only the left one
    from registers) for a loaded right one. Why: jax traces the
    grouped-query einsum ``bqkgd,bskd->bkgqs`` as K.Q^T; printed as is, the
    score tile was transposed every key step (``tl.trans(tl.dot(k, q^T))``)
    and multi-query attention ran 8.7x slower than cuDNN (H100, 2026-11-23).
    """
    if tuple(order) == tuple(out_dims) or tuple(swapped) != tuple(out_dims):
      return False
    return not (not self._loaded(op.lhs) and self._loaded(op.rhs))

  def _loaded(self, v: str, depth: int = 0) -> bool:
    """Whether ``v`` is a region input, or a cast of one."""
    if v in self.inputs:
      return True
    op = self.ops.get(v)
    return (isinstance(op, ir.Elementwise) and op.fn == "convert" and depth < 8
            and isinstance(op.args[0], str) and self._loaded(op.args[0], depth + 1))

  def _swap_accumulated(self, op: ir.Contraction) -> bool:
    """Whether a contraction accumulated over a sequential loop runs as
    ``(rhs^T lhs^T)^T``, its accumulator in N, M order: when its right
    operand is computed on chip and its left one is loaded. wgmma reads only
    its left operand from registers; on the right, the computed tile goes
    through shared memory every step. (Autodiff's ``dv = do^T @ p``: 750
    against 453 us for ``p^T @ do`` at 8 x 16 x 2048 tokens, H100,
    2026-11-26.) Only for one M and one N loop (``_acc_roles``)."""
    return (self._loaded(op.lhs) and not self._loaded(op.rhs)
            and self._acc_roles(op) is not None)

  # -------------------------------------------------------- accumulation
  def _acc_roles(self, op: ir.Contraction) -> Optional[tuple[list, list, list]]:
    """(batch, M, N) loops of ``op`` in region order, where it has one M
    and one N loop and at most one batch loop; None otherwise."""
    A, B, out = set(self.bl(op.lhs)), set(self.bl(op.rhs)), set(self.bl(op.out))
    bat = [l for l in self.order if l in A and l in B and l in out]
    M = [l for l in self.order if l in A and l in out and l not in B]
    N = [l for l in self.order if l in B and l in out and l not in A]
    return (bat, M, N) if len(M) == 1 and len(N) == 1 and len(bat) <= 1 else None

  def acc_order(self, op) -> tuple[str, ...]:
    if isinstance(op, ir.Contraction) and (roles := self._acc_roles(op)) is not None:
      bat, M, N = roles
      return tuple(bat + N + M) if self._swap_accumulated(op) else tuple(bat + M + N)
    return self.bl(op.out)

  def deferred_sum(self, v: str, lp: _Open) -> Optional[tuple[str, ...]]:
    """The product tile's dims when contraction ``v``, accumulated over loop
    ``lp``, keeps its whole broadcast product in the accumulator and sums
    the in-tile reduced loops once after the loop (see
    ``pruning.deferred_sums``, which the planner prices); None when it sums
    every step: a ``tl.dot``, a loop whose tile is 1, or no room left under
    the register caps (a smaller one where an online softmax rescales the
    accumulator: the whole product is then rescaled every step)."""
    op = self.ops[v]
    if self.deferrable is None:
      rescaled = {a for st in self.info.streamed.values()
                  for a, sc in st.accumulators if sc is not None}
      self.deferrable = deferred_sums(self.r, self.plan.expr, self.plan.tile_map,
                                      self.plan.num_warps, rescaled)
    if (v not in self.deferrable or not isinstance(op, ir.Contraction)
        or lp.node.loop not in op.reduce):
      return None
    a_l, b_l = self.bl(op.lhs), self.bl(op.rhs)
    red_in = [x for x in op.reduce if self.T[x] > 1]
    dts = (self.vm[op.lhs].dtype, self.vm[op.rhs].dtype)
    if tiling.dot_roles(a_l, b_l, self.bl(op.out), red_in, self.T, dts) is not None:
      return None
    return tuple(x for x in self.order if x in a_l or x in b_l)

  def emit_acc_init(self, v: str, lp: _Open, defer: bool = True) -> None:
    op = self.ops[v]
    order = self.acc_order(op)
    self.deferred.pop(v, None)
    if defer and (prod := self.deferred_sum(v, lp)) is not None:
      order = prod
      self.deferred[v] = tuple(x for x in prod if x not in self.bl(v))
    is_max = isinstance(op, ir.Reduction) and op.kind == "max"
    var = self.fresh(f"acc_{self._sanitize(v)}" if not is_max else self._sanitize(v))
    fill = 'float("-inf")' if is_max else "0.0"
    if order:
      self.emit(f"{var} = tl.full({self.shape(order)}, {fill}, tl.float32)")
    else:
      self.emit(f"{var} = {fill}")
    tile = _Tile(var, order, "float32")
    self.acc_tile[v] = tile
    self.acc_loop[v] = lp
    self.bind(v, tile)   # bound in the scope enclosing the loop (loop-carried)

  def emit_accumulate(self, v: str, op, lp: _Open) -> None:
    if v not in lp.accs:
      raise CodegenError(f"internal: {v} accumulates in {lp.node.loop} without an init")
    # Partial tiles of v indexed by a sequential loop nested inside lp cannot stay in registers.
    inner = self.open[self.open.index(lp) + 1:]
    vl = set(self.vm[v].loops)
    for o in inner:
      if o.node.loop in vl:
        raise CodegenError(f"{v} accumulates over {lp.node.loop} but its tiles vary along "
                           f"sequential loop {o.node.loop} inside it (partial tiles would "
                           "have to stay on chip)")
    acc = self.acc_tile[v]
    st = lp.stream
    sc = st.accumulator_scale(v) if st else None
    if isinstance(op, ir.Reduction) and op.kind == "max":
      a = self.operand(op.arg)
      prev = f"{acc.var}_prev"
      self.emit(f"{prev} = {acc.var}")
      self.emit(f"{acc.var} = tl.maximum({acc.var}, {self.reduce_expr(op, a)})")
      if st is not None and st.online and v in st.running_max:
        self.emit(f"{acc.var}_safe = tl.where({acc.var} == float(\"-inf\"), 0.0, {acc.var})"
                  if acc.order else
                  f"{acc.var}_safe = tl.where({acc.var} == float(\"-inf\"), 0.0, {acc.var})")
      return
    target = acc.var
    if sc is not None:
      mt = self.acc_tile[sc.max]
      alpha = self.alpha_expr(sc, mt, acc.order)
      self.emit(f"{acc.var} = {acc.var} * {alpha}")
    if isinstance(op, ir.Reduction):
      a = self.operand(op.arg)
      self.emit(f"{acc.var} = {acc.var} + {self.reduce_expr(op, a)}")
      return
    expr, order = self.contraction_expr(op, target, acc.order,
                                        keep=self.deferred.get(v, ()))
    if order != acc.order:
      raise CodegenError(f"internal: accumulator order {acc.order} != {order}")
    self.emit(f"{acc.var} = {expr}")

  def alpha_expr(self, sc: streaming.Scale, mt: _Tile, dims) -> str:
    fn = "tl.exp" if sc.base == "e" else "tl.exp2"
    c = "" if sc.coef == 1.0 else f"{sc.coef!r} * "
    e = f"{fn}({c}({mt.var}_prev - {mt.var}_safe))"
    if mt.order:
      return self.expand(f"{fn}({c}({mt.var}_prev - {mt.var}_safe))", mt.order, dims)
    return e

  def emit_streamed(self, v: str, op, lp: _Open) -> None:
    st = lp.stream
    dims = self.bl(v)
    if v in dict(st.deferred):
      src = dict(st.deferred)[v]
      t = self.operand(src)
      self.bind(v, t)          # the factor is applied after the loop
      self.scaled[v] = lp
      return
    if v in dict(st.shifted) and isinstance(op, ir.Elementwise) and op.fn == "sub":
      x, m = op.args
      xt = self.operand(x)
      mt = self.acc_tile[m]
      var = self.fresh(self._sanitize(v))
      self.emit(f"{var} = {self.expand(self.f32(xt), xt.order, dims)} - "
                f"{self.expand(mt.var + '_safe', mt.order, dims)}")
      self.bind(v, _Tile(var, dims, "float32"))
      self.scaled[v] = lp
      return
    # Every other op of the algebra prints as itself on the running values.
    var = self.fresh(self._sanitize(v))
    expr, dt = self.elementwise(op, dims)
    self.emit(f"{var} = {expr}")
    self.bind(v, _Tile(var, dims, dt))
    self.scaled[v] = lp

  def finalize(self, v: str, lp: _Open) -> None:
    """After loop ``lp``: the accumulator becomes the value (deferred factors applied)."""
    acc = self.acc_tile[v]
    dims = self.bl(v)
    st = lp.stream
    sc = st.accumulator_scale(v) if st else None
    summed, order = self.sum_deferred(v, acc)
    expr = self.permute(summed, order, dims)
    del self.acc_loop[v]
    if sc is not None:
      for fn, d in sc.deferred:
        dt = self.need(d)
        expr = f"{expr} {'*' if fn == 'mul' else '/'} {self.expand(self.f32(dt), dt.order, dims)}"
    if expr == acc.var:
      self.bind(v, _Tile(acc.var, dims, "float32"))
      return
    var = self.fresh(self._sanitize(v))
    self.emit(f"{var} = {expr}")
    self.bind(v, _Tile(var, dims, "float32"))

  def sum_deferred(self, v: str, acc: _Tile) -> tuple[str, tuple[str, ...]]:
    """``acc`` summed over the loops ``deferred_sum`` kept in it: the
    expression and its dims (``acc`` itself when nothing was kept)."""
    expr, cur = acc.var, list(acc.order)
    for l in self.deferred.get(v, ()):
      expr = f"tl.sum({expr}, axis={cur.index(l)})"
      cur.remove(l)
    return expr, tuple(cur)

  # -------------------------------------------------------------- walking
  def subtree_computes(self, node: LoopNode) -> list[str]:
    out = []

    def walk(nodes):
      for n in nodes:
        if isinstance(n, LoopNode):
          walk(n.body)
        elif n.kind == "C":
          out.append(n.value)
    walk(node.body)
    return out

  def index_span(self, l: str) -> Optional[tuple[str, str]]:
    """(first index, last index + 1) of loop ``l``'s current tile, as
    expressions, when it is fixed here (a grid loop, or an open one)."""
    T = self.T[l]
    if self.kind[l] == "grid" and T > 1:
      return f"pid_{l} * {self.BLK[l]}", f"(pid_{l} + 1) * {self.BLK[l]}"
    if self.kind[l] == "seq" and any(o.node.loop == l for o in self.open):
      if T > 1:
        return f"start_{l}", f"(start_{l} + {self.BLK[l]})"
      return f"i_{l}", f"(i_{l} + 1)"
    if T == 1 and self.kind[l] == "grid":
      return f"i_{l}", f"(i_{l} + 1)"
    return None

  def loop_bounds(self, node: LoopNode, lp: _Open) -> tuple[str, str]:
    """Runtime range of the loop; tiles that a causal mask fully hides are skipped."""
    l = node.loop
    lo, hi = "0", self.EXT[l]
    if self.split and self.split[0] == l and self.in_split_kernel:
      per = _cdiv(_cdiv(self.ext[l], self.T[l]), self.split[1]) * self.T[l]
      lo = f"part * {per}"
      hi = f"tl.minimum({self.EXT[l]}, part * {per} + {per})"
    band = self.causal_skip(l, lp)
    if band is not None:
      if self.index_span(band.other) is None:
        return lo, hi
      lo, hi = self.band_bounds(l, band, lo, hi)
    if lp.stream is not None:
      loaded: dict[str, Optional[str]] = {}
      length = lambda v: loaded[v] if v in loaded else loaded.setdefault(
          v, self.program_length(v, l))
      bound, guard = streaming.length_mask(self.r, lp.stream) or (None, None)
      var = bound and length(bound.length)
      if var:
        # Stop past the length; where it is not positive no row keeps an
        # index, and a finite fill is no -inf: run every tile, as the IR does.
        pos_lo, pos_hi = lo, f"tl.minimum({hi}, {_plus(var, bound.offset)})"
        # The band of a causal mask joined to the length under a finite
        # fill holds likewise only where the length is positive (every row
        # then keeps index 0, so the fill weighs nothing; ``streaming.
        # guarded_band``). A band ``causal_skip`` took holds regardless.
        if band is None and guard is not None and self.index_span(guard.other) is not None:
          pos_lo, pos_hi = self.band_bounds(l, guard, pos_lo, pos_hi)
        if pos_lo != lo:
          lo = f"tl.where({var} > 0, {pos_lo}, {lo})"
        hi = f"tl.where({var} > 0, {pos_hi}, {hi})"
      rows = streaming.output_length_bound(self.r)
      span = rows and rows[0] != l and self.index_span(rows[0])
      var = span and length(rows[1].length)
      if var:
        # Every row of this program's tile lies past the length, where the
        # outputs discard what the loop computes: a select takes no tile, a
        # product with the mask one (0 x a finite value; none would be NaN).
        bl = self.BLK[l] if self.T[l] > 1 else "1"
        past = lo if rows[2] == "select" else f"tl.minimum({hi}, {lo} + {bl})"
        hi = f"tl.where({span[0]} >= {_plus(var, rows[1].offset)}, {past}, {hi})"
    return lo, hi

  def band_bounds(self, l: str, band: streaming.Band, lo: str, hi: str) -> tuple[str, str]:
    """``lo``, ``hi`` of loop ``l`` narrowed to the tiles ``band`` keeps
    against the current tile of ``band.other`` (``index_span``)."""
    first, last1 = self.index_span(band.other)
    bl = self.BLK[l] if self.T[l] > 1 else "1"
    if band.upper is not None:   # l <= other + upper: stop after the other tile's last index
      hi = f"tl.minimum({hi}, {_plus(last1, band.upper)})"
    if band.lower is not None:   # l >= other + lower: start at the tile holding its first
      # A negative start rounds to a tile start <= 0 whether // floors
      # (the interpreter) or truncates (compiled); lo >= 0 takes over.
      lo = f"tl.maximum({lo}, ({_plus(first, band.lower)}) // {bl} * {bl})"
    return lo, hi

  def program_length(self, value: str, l: str) -> Optional[str]:
    """A scalar variable holding input ``value`` (a sequence's length,
    ``streaming.LengthBound``) where it is one value per program: every loop
    of its buffer a grid loop of tile 1. Emits its load; None otherwise."""
    buf = self.inputs.get(value)
    if buf is None:
      return None
    loops = [x for x in self.vm[buf.value].loops if buf.stride(x) != 0 and x != buf.part_loop]
    if any(self.kind.get(x) != "grid" or self.T[x] != 1 for x in loops):
      return None
    var = self.fresh(f"len_{l}")
    big = buf.size >= 2 ** 31
    self.emit(f"{var} = tl.load({self._sanitize(buf.value)}_ptr + {self.address(buf, (), big)})")
    return var

  def iota_relation(self, pred, l: str) -> Optional[streaming.Band]:
    """``streaming.iota_relation`` of this region."""
    return streaming.iota_relation(self.r, pred, l)

  def causal_skip(self, n: str, lp: _Open) -> Optional[streaming.Band]:
    """The ``streaming.Band`` of ``n`` outside which its tiles contribute
    nothing (``streaming.masked_tile_relation``, which
    the cost model prices the same way)."""
    if lp.stream is None:
      return None
    return streaming.masked_tile_relation(self.r, lp.stream)

  def mask_relation(self, node: LoopNode) -> Optional[tuple[streaming.Band, dict[str, str]]]:
    """(the ``streaming.Band`` of loop ``node`` that every masking value of
    its body keeps, {value: kept operand}) when they all keep the same band
    (a causal mask, a sliding window); None when there is none or they
    disagree. A masking value is a select whose predicate compares two
    iotas, ``select(cmp(iota(a), iota(l)), x, kept)``, or any form
    ``streaming.masked_value`` reads (a predicate seen through ``and``,
    ``not`` and two-valued selects, the fill on either side, an added
    mask); where the band holds it equals its kept operand. Selects of
    literals (the masks themselves, before they meet a score) are left as
    they are."""
    l = node.loop
    rel = None
    kept_of: dict[str, str] = {}
    for v in self.subtree_computes(node):
      op = self.ops.get(v)
      if not isinstance(op, ir.Elementwise) or op.fn not in ("select", "add"):
        continue
      r, kept = None, None
      if op.fn == "select" and isinstance(op.args[2], str):
        # Any value where the compare is false, not only a literal fill.
        r, kept = self.iota_relation(op.args[0], l), op.args[2]
      if r is None:
        m = streaming.masked_value(self.r, v)
        if m is not None:
          r, kept = streaming.relation_to(m.keep, l), m.kept
      if r is None or isinstance(kept, ir.Literal):
        continue
      # Printed as its kept operand alone, which must already have the
      # value's shape (a broadcast operand would change later reductions).
      if not set(self.vm[v].loops) <= set(self.vm[kept].loops):
        return None
      if rel is not None and r != rel:
        return None
      rel = r
      kept_of[v] = kept
    if rel is None:
      return None
    return rel, kept_of

  def whole_tiles(self, node: LoopNode) -> Optional[tuple[Optional[str], Optional[str],
                                                           dict[str, str]]]:
    """Where loop ``node`` runs tiles on which every masking value of its
    body (``mask_relation``) keeps every score (a causal mask's tiles below
    the diagonal, the middle of a sliding window): (the first such tile's
    start, None when the band has no lower bound; the start past the last,
    None when it has no upper bound; those values with their kept
    operands). Those tiles print each masking value as its kept operand;
    Triton drops the compares nothing reads then: 2 of the 8-10 ALU ops per
    score of a causal softmax.
    Derived from the IR; None when there is none, the bound is not known, a
    window is too narrow to hold a whole tile, or the plan is predicted to
    run in fewer than ``WHOLE_TILES_MIN_WAVES`` waves (latency-bound: a
    second pipelined loop costs more than it saves)."""
    l = node.loop
    rel = self.mask_relation(node)
    pred = self.plan.predicted
    if rel is None or (pred is not None and pred.waves < WHOLE_TILES_MIN_WAVES):
      return None
    band, kept = rel
    span = self.index_span(band.other)
    if span is None:
      return None
    if (band.lower is not None and band.upper is not None
        and band.upper - band.lower < self.T[l] + self.T[band.other] - 2):
      return None      # no tile of l fits the window beside a whole tile of other
    first, last1 = span
    bl = self.BLK[l] if self.T[l] > 1 else "1"
    # A tile [s, s + bl) of l against the other loop's [first, last1):
    lo = hi = None
    if band.lower is not None:   # s >= last1 - 1 + lower, rounded up to a tile
      lo = f"({_plus(last1, band.lower - 1)} + {bl} - 1) // {bl} * {bl}"
    if band.upper is not None:   # s + bl - 1 <= first + upper
      hi = f"({_plus(first, band.upper + 1)}) // {bl} * {bl}"
    return lo, hi, kept

  def heavy_first_loops(self, body) -> set[str]:
    """Grid loops whose programs run longer as their index grows: a loop
    below them bounded by a causal mask to ``<=``/``<`` their index (the
    tiles it skips, or the masked tiles it runs whole). Their program ids
    are issued in reverse, longest programs first, so that the grid's last
    wave holds short programs (as FlashAttention orders causal blocks): per
    head, or across the query heads that share keys and values
    (``grid_axes``, ``emit_lpt_program_ids``)."""
    out = set()

    def walk(nodes):
      for n in nodes:
        if isinstance(n, LoopNode):
          st = self.info.streamed.get(n.loop)
          mask = self.mask_relation(n)
          for band in (mask and mask[0], st and streaming.masked_tile_relation(self.r, st)):
            if band and band.upper is not None and self.kind.get(band.other) == "grid":
              out.add(band.other)
          walk(n.body)
    walk(body)
    return out

  def walk(self, body) -> None:
    for node in body:
      if isinstance(node, Stmt):
        self.emit_stmt(node)
      else:
        self.emit_loop(node)

  def emit_stmt(self, s: Stmt) -> None:
    if s.kind == "L":
      t = self.lookup(s.value)
      if t is not None and self._invariant_since_bound(s.value):
        return
      self.emit_load(s.value)
    elif s.kind == "C":
      t = self.lookup(s.value)
      if (t is not None and s.value not in self.acc_loop and self._invariant_since_bound(s.value)
          and not any(s.value in o.accs for o in self.open)):
        return
      self.emit_compute(s.value)
    else:
      v = s.value
      pend = [o for o in self.open if (v in self.acc_loop and self.acc_loop[v] is o)
              or (self.lookup(v) is None and any(p.value == v for p in o.after))]
      if pend:
        pend[0].after.append(s)
        return
      if self.split and self.in_split_kernel and self.split_done:
        return
      self.emit_store(v)

  def _invariant_since_bound(self, v: str) -> bool:
    """True when ``v``'s tile was bound outside every loop opened since (reusable)."""
    depth = next(i for i in range(len(self.scopes) - 1, -1, -1) if v in self.scopes[i])
    opened = [o.node.loop for o in self.open[depth:]]
    return not (set(opened) & set(self.vm[v].loops))

  def emit_loop(self, node: LoopNode) -> None:
    l = node.loop
    st = self.info.streamed.get(l)
    lp = _Open(node, [], [], st)
    # Accumulators of this loop: computes below it that reduce it, unless an
    # enclosing open loop already accumulates them.
    for v in self.subtree_computes(node):
      op = self.ops.get(v)
      red = set(op.reduce) if isinstance(op, ir.Contraction) else (
          {op.loop} if isinstance(op, ir.Reduction) else set())
      if l in red and not any(o.node.loop in red for o in self.open) and v not in lp.accs:
        lp.accs.append(v)
    lp.accs.sort(key=self.op_index.get)
    if st is None and lp.accs:
      raise CodegenError(f"internal: no streaming info for reduced loop {l}")
    if l in self.info.single_tile and lp.accs:
      raise CodegenError(f"loop {l} cannot be tiled sequentially: {self.info.single_tile[l]}")
    for v in lp.accs:
      self.emit_acc_init(v, lp)
    lo, hi = self.loop_bounds(node, lp)
    whole = self.whole_tiles(node)
    if whole is None:
      self.emit_loop_range(node, lp, lo, hi, {})
    else:
      w_lo, w_hi, kept = whole
      if w_lo is not None and w_hi is not None:
        # A window: edge tiles on both sides; three loops share the bounds.
        self.emit(f"lo_{l} = {lo}")
        self.emit(f"hi_{l} = {hi}")
        self.emit(f"whole_lo_{l} = tl.maximum(lo_{l}, tl.minimum(hi_{l}, {w_lo}))")
        self.emit(f"whole_hi_{l} = tl.maximum(whole_lo_{l}, tl.minimum(hi_{l}, {w_hi}))")
        parts = [(f"lo_{l}", f"whole_lo_{l}", {}), (f"whole_lo_{l}", f"whole_hi_{l}", kept),
                 (f"whole_hi_{l}", f"hi_{l}", {})]
      elif w_lo is not None:
        cut = f"tl.maximum({lo}, tl.minimum({hi}, {w_lo}))"
        parts = [(lo, cut, {}), (cut, hi, kept)]
      else:
        cut = f"tl.maximum({lo}, tl.minimum({hi}, {w_hi}))"
        parts = [(lo, cut, kept), (cut, hi, {})]
      for a, b, ss in parts:
        self.emit("# tiles the mask keeps whole" if ss else "# tiles on the mask's edge")
        self.emit_loop_range(node, lp, a, b, ss)
      # Both copies of the body defer the same statements past the loop.
      lp.after[:] = list({(st.kind, st.value): st for st in lp.after}.values())
    if self.split and self.in_split_kernel and l == self.split[0]:
      self.split_loop = lp
      self.split_done = True
      return
    self.close_loop(lp)

  def emit_loop_range(self, node: LoopNode, lp: _Open, lo: str, hi: str,
                      whole_kept: dict[str, str]) -> None:
    """One ``for`` over tiles [lo, hi) of ``node``'s loop with its body."""
    l = node.loop
    T = self.T[l]
    if T > 1:
      self.emit(f"for start_{l} in range({lo}, {hi}, {self.BLK[l]}):")
    else:
      self.emit(f"for i_{l} in range({lo}, {hi}):")
    self.ind += 1
    self.open.append(lp)
    self.scopes.append({})
    outer, self.whole_kept = self.whole_kept, whole_kept
    if T > 1:
      self.emit(f"offs_{l} = start_{l} + tl.arange(0, {self.BLK[l]})")
      if self.needs_mask(l):
        self.emit(f"mask_{l} = offs_{l} < {self.EXT[l]}")
    n_lines = len(self.lines)
    self.walk(node.body)
    if len(self.lines) == n_lines:
      self.emit("pass")
    self.whole_kept = outer
    self.scopes.pop()
    self.open.pop()
    self.ind -= 1
    for v in list(self.scaled):
      if self.scaled[v] is lp:
        del self.scaled[v]

  def close_loop(self, lp: _Open) -> None:
    for v in lp.accs:
      self.finalize(v, lp)
    for s in lp.after:
      self.emit_stmt(s)

  # ---------------------------------------------------------------- split
  def scratch_layout(self, lp: _Open) -> list["_Partial"]:
    """fp32 scratch for the split loop's partial accumulators, indexed by
    part and by the global indices of the value's loops (each padded to
    whole tiles of the main kernel), so that the combine pass can tile the
    outputs differently from the main kernel. Programs that differ only in
    a grid loop the value does not vary along write the same values to
    the same place."""
    specs = []
    parts = self.split[1]
    for v in lp.accs:
      dims = tuple(l for l in self.order if l in self.vm[v].loops)
      strides: dict[str, int] = {}
      size = 1
      for l in reversed(dims):
        strides[l] = size
        size *= _cdiv(self.ext[l], self.T[l]) * self.T[l]
      if parts * size >= 2 ** 31:
        raise CodegenError(f"split scratch of {v} has {parts * size} elements (int32 offsets)")
      specs.append(_Partial(v, dims, strides, size,
                            ScratchSpec(f"part_{self._sanitize(v)}", parts * size)))
    return specs

  def partial_address(self, spec: "_Partial", order: Sequence[str]) -> str:
    """Offsets of this program's tile of ``spec`` in its scratch, as a tile
    with dims ``order`` (the accumulator's), under the current tiling."""
    terms = [f"part * {spec.part_size}"]
    for l in spec.dims:
      e = self.expand(f"offs_{l}", (l,), order) if self.T[l] > 1 else f"i_{l}"
      st = spec.strides[l]
      terms.append(e if st == 1 else f"{e} * {st}")
    return " + ".join(terms)

  def emit_partial_stores(self, specs: Sequence["_Partial"]) -> None:
    self.emit("# partial results of this part of the split loop, in fp32 scratch")
    for spec in specs:
      t = self.acc_tile[spec.value]
      expr, order = self.sum_deferred(spec.value, t)
      if order != t.order:
        var = self.fresh(f"{t.var}_sum")
        self.emit(f"{var} = {expr}")
        t = _Tile(var, order, "float32")
      self.emit(f"tl.store({spec.scratch.name}_ptr + {self.partial_address(spec, t.order)}, {t.var})")

  def emit_combine(self, lp: _Open, specs: Sequence["_Partial"]) -> None:
    """Second pass: combine the parts' partial accumulators, then finish the loop."""
    parts = self.split[1]
    st = lp.stream
    self.emit(f"# combine the {parts} partial results of split loop {lp.node.loop}")
    for v in lp.accs:
      self.emit_acc_init(v, lp, defer=False)
    info = {spec.value: spec for spec in specs}

    def load(v):
      spec = info[v]
      t = self.acc_tile[v]
      return f"tl.load({spec.scratch.name}_ptr + {self.partial_address(spec, t.order)})"

    maxes = [v for v in lp.accs if isinstance(self.ops[v], ir.Reduction) and self.ops[v].kind == "max"]
    if maxes:
      self.emit(f"for part in range(0, {parts}):")
      self.ind += 1
      for v in maxes:
        t = self.acc_tile[v]
        self.emit(f"{t.var} = tl.maximum({t.var}, {load(v)})")
      self.ind -= 1
      for v in maxes:
        t = self.acc_tile[v]
        self.emit(f"{t.var}_safe = tl.where({t.var} == float(\"-inf\"), 0.0, {t.var})")
    rest = [v for v in lp.accs if v not in maxes]
    if rest:
      self.emit(f"for part in range(0, {parts}):")
      self.ind += 1
      for v in rest:
        t = self.acc_tile[v]
        sc = st.accumulator_scale(v) if st else None
        if sc is not None:
          mt = self.acc_tile[sc.max]
          self.emit(f"{mt.var}_prev = {load(sc.max)}")
          self.emit(f"{t.var} = {t.var} + {load(v)} * {self.alpha_expr(sc, mt, t.order)}")
        else:
          self.emit(f"{t.var} = {t.var} + {load(v)}")
      self.ind -= 1
    self.close_loop(lp)

  # ------------------------------------------------------------ top level
  def build(self) -> PrintedKernel:
    body = self.plan.expr.body
    heavy = self.heavy = self.heavy_first_loops(body)
    axes, sizes = self.grid_axes(heavy)
    scratch: tuple[ScratchSpec, ...] = ()
    header = [
        "# Generated by jaxfuse.codegen from a Chain IR region and a plan. Do not edit.",
        "#",
    ]
    # Without window offsets: windows at other offsets share this source.
    header += ["# " + line for line in self.r.to_text(offsets=False).splitlines()]
    header += ["#", f"# plan: {self.plan}", ""]
    header += ["import triton", "import triton.language as tl", "", ""]
    self.in_split_kernel = bool(self.split)
    self.split_done = False
    self.split_loop = None
    if self.split:
      sl = self.split[0]
      if not any(isinstance(n, LoopNode) and n.loop == sl for n in body):
        raise CodegenError(f"split loop {sl} must be a top-level loop of the plan's expression")
      idx = self._split_index(body)
      for n in body[:idx + 1]:
        if any(s.kind == "S" for s in _stmts(n)):
          raise CodegenError("a split plan cannot store outputs before or inside the split loop")
    # Main kernel.
    self.lines = []
    self.ind = 1
    main_lines = self._kernel_body(axes, body, with_split=bool(self.split))
    combine_lines: list[str] = []
    combine_name = None
    combine_grid = None
    combine_constexprs: tuple[tuple[str, int], ...] = ()
    if self.split:
      specs = self.scratch_layout(self.split_loop)
      scratch = tuple(spec.scratch for spec in specs)
      # Partial stores go at the end of the main kernel.
      self.lines = []
      self.ind = 1
      self.emit_partial_stores(specs)
      main_lines += self.lines
      combine_lines, combine_grid, combine_constexprs = self._print_combine(body, specs)
      combine_name = self.name + "_combine"
      # Restore grid counts including the split axis for the main grid.
      self.grid_axes(heavy)
    src = list(header)
    extra = [f"{sp.name}_ptr" for sp in scratch]
    for h in sorted(self.helpers):
      src += ["@triton.jit", _HELPERS[h], "", ""]
    src.append(self.decorator())
    sig_main = self.signature(extra, outputs=not self.split)
    src.append(f"def {self.name}({sig_main}):")
    src += main_lines
    if self.split:
      src += ["", "", self.decorator(), f"def {combine_name}({self.signature(extra)}):"]
      src += combine_lines
    return PrintedKernel(source="\n".join(src) + "\n", kernel_name=self.name, grid=sizes,
                         constexprs=self.constexprs(), num_warps=int(self.plan.num_warps),
                         num_stages=int(self.plan.num_stages), combine_name=combine_name,
                         combine_grid=combine_grid, scratch=scratch,
                         combine_constexprs=combine_constexprs)

  def _reset_state(self) -> None:
    self.scopes = [{}]
    self.names_used = set()
    self.open = []
    self.acc_loop = {}
    self.acc_tile = {}
    self.deferred = {}
    self.scaled = {}

  def _kernel_body(self, axes, body, with_split: bool) -> list[str]:
    self._reset_state()
    self.emit_grid_dependency_wait()
    self.emit_program_ids(axes, self.heavy)
    self.emit_window_bases()
    self.emit_part_bases(outputs=not with_split)
    self.emit_loop_indices()
    n0 = len(self.lines)
    if with_split:
      self.walk(body[:self._split_index(body) + 1])    # the rest runs in the combine kernel
    else:
      self.walk(body)
    if len(self.lines) == n0:
      self.emit("pass")
    return self.lines

  def _split_index(self, body) -> int:
    return next(i for i, n in enumerate(body) if isinstance(n, LoopNode) and n.loop == self.split[0])

  def _combine_tiles(self, body, specs: Sequence["_Partial"]) -> dict[str, int]:
    """Tiles of the combine pass: the main kernel's, with the largest output
    tiles halved (down to ``COMBINE_MIN_TILE``) until there are
    ``COMBINE_MIN_PROGRAMS`` programs or tiles of ``COMBINE_MAX_TILE_ELEMS``
    elements. Loops that an op after the split loop reduces or contracts
    keep their tiles."""
    idx = self._split_index(body)
    post = [s.value for n in body[idx + 1:] for s in _stmts(n) if s.kind == "C"]
    post += [s.value for s in self.split_loop.after if s.kind == "C"]
    fixed: set[str] = set()
    for v in post:
      op = self.ops.get(v)
      if isinstance(op, ir.Contraction):
        fixed |= set(self.r.op_loops(op))
      elif isinstance(op, ir.Reduction):
        fixed.add(op.loop)
    out_loops: set[str] = set()
    for spec in specs:
      out_loops |= set(spec.dims)
    for b in self.r.outputs:
      out_loops |= set(self.vm[b.value].loops)
    T = dict(self.T)
    elig = [l for l in self.order
            if l in out_loops and l not in fixed and self.kind[l] in ("grid", "single")]

    def programs() -> int:
      return math.prod(_cdiv(self.ext[l], T[l]) for l in self.order
                       if self.kind[l] == "grid" or (l in elig and T[l] < self.ext[l]))

    def elems() -> int:
      return math.prod(T[l] for l in out_loops if T[l] > 1)

    while programs() < COMBINE_MIN_PROGRAMS and elems() > COMBINE_MAX_TILE_ELEMS:
      cand = [l for l in elig if T[l] > COMBINE_MIN_TILE]
      if not cand:
        break
      T[max(cand, key=lambda l: (T[l], -self.order.index(l)))] //= 2
    return T

  def _use_tiles(self, tiles: dict[str, int]) -> None:
    for l in self.order:
      if self.kind[l] == "single" and tiles[l] < self.ext[l]:
        self.kind[l] = "grid"
    self.T = dict(tiles)
    self.grid_loops = tuple(l for l in self.order if self.kind[l] == "grid")

  def _print_combine(self, body, specs: Sequence["_Partial"]):
    """The combine kernel's lines, grid and constexprs: re-tiled
    (``_combine_tiles``), loading inputs only where the rest of the plan
    needs them; if that cannot be printed, with the main kernel's tiles and
    its statements before the split loop (the compiler drops unused ones)."""
    saved = (dict(self.T), dict(self.kind), self.grid_loops)
    split = self.split
    for retile in (True, False):
      try:
        if retile:
          self._use_tiles(self._combine_tiles(body, specs))
        self.split = None
        axes, sizes = self.grid_axes()
        self.split = split
        self.lines = []
        self.ind = 1
        self._reset_state()
        self.in_split_kernel = False
        self.lazy_loads = retile
        lines = self._combine_body(axes, body, specs, walk_prefix=not retile)
        return lines, sizes, self.constexprs()
      except CodegenError:
        if not retile:
          raise
      finally:
        self.split = split
        self.T, self.kind, self.grid_loops = dict(saved[0]), dict(saved[1]), saved[2]
        self.lazy_loads = False
    raise AssertionError("unreachable")

  def _combine_body(self, axes, body, specs, walk_prefix: bool) -> list[str]:
    self.emit_grid_dependency_wait()
    self.emit_program_ids(axes)
    self.emit_window_bases()
    self.emit_part_bases()
    self.emit_loop_indices()
    sl = self.split[0]
    idx = self._split_index(body)
    if walk_prefix:
      self.walk(body[:idx])
    lp = _Open(body[idx], list(self.split_loop.accs), list(self.split_loop.after),
               self.info.streamed.get(sl))
    self.emit_combine(lp, specs)
    self.walk(body[idx + 1:])
    return self.lines


def _stmts(node):
  if isinstance(node, Stmt):
    yield node
    return
  for n in node.body:
    yield from _stmts(n)


def kernel_name_for(region: ir.Region) -> str:
  """The printed kernel's function name: ``jaxfuse_`` and the region's
  contractions, einsum-style (``jaxfuse_mk_kn_mn__mn_nh_mh`` for a GEMM
  chain), so that a profile says which kernels are jaxfuse's and what each
  computes. The name depends on the contractions alone, so regions that
  share a kernel share its name. Split plans' combine pass adds ``_combine``.

  Example::

      kernel_name_for(region)   # 'jaxfuse_bgmk_bgnk_bgmn__bgmn_bgnh_bgmh'
  """
  parts = [re.sub(r"\W", "_", s.replace("->", "_").replace(",", "_"))
           for s in region.einsum_summary().split(" ; ") if s]
  return ("jaxfuse_" + "__".join(parts))[:200] if parts else "jaxfuse_kernel"


def print_kernel(region: ir.Region, plan: Plan, kernel_name: Optional[str] = None
                 ) -> PrintedKernel:
  """Prints the Triton source of ``plan`` for ``region``. ``kernel_name``:
  the kernel function's name (default ``kernel_name_for(region)``).

  Example::

      pk = print_kernel(region, plan)
      pk.source, pk.grid, pk.constexprs
  """
  if not isinstance(region, ir.Region):
    raise TypeError(f"region must be a jaxfuse.ir.Region, got {type(region).__name__}")
  if not isinstance(plan, Plan):
    raise TypeError(f"plan must be a jaxfuse.planner.plan.Plan, got {type(plan).__name__}")
  return _Printer(rewrite.fold_exp2(region), plan, kernel_name or kernel_name_for(region)).build()
