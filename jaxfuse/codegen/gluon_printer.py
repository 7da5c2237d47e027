"""The warp-specialized attention kernel for Hopper, printed in Gluon.

Why a second printer: Triton's compiler runs softmax attention's two
``tl.dot`` s in one warpgroup, one after the other, with the softmax between
them; at head dimensions of 64-128 that form reached 0.82-0.95x cuDNN's
speed on an H100 whatever its tiles (benchmarks/RESULTS.md, sessions 22, 28
and 65). Gluon, Triton's lower-level dialect, lets the kernel say what
FlashAttention-3 does:

* two consumer warpgroups, each its own partition with 64 query rows, so
  one's softmax runs while the other's tensor-core work does;
* inside each, the next key block's ``Q.K^T`` is issued before this block's
  ``P.V``, and the softmax of the next block runs while ``P.V`` is in flight
  (``warpgroup_mma(..., is_async=True)`` and explicit waits);
* a one-warp loader partition moves K and V through a ring of shared-memory
  stages with TMA, signalled by mbarriers; a K slot is released as soon
  as its ``Q.K^T`` is done, a step before its V slot, so that in a ring of
  two (d=256) each K loads a whole step ahead;
* persistent programs (one per SM) walk the (batch, head, query tile)
  tiles, so each program makes its four tensor descriptors once;
* each warpgroup holds its queries in registers (``queries_in_registers``),
  so the next tile's queries load while this tile runs, and the query
  buffer stages the output when the tile ends.

Under a band mask (causal, a sliding window: ``streaming.Band``) a tile
runs only the key blocks holding a key some row keeps, and masks scores
only in the blocks where a row of its warpgroup drops one. Causal tiles'
work grows with their query index, so programs take them in pairs (tile i
and last - i of one head) of equal work. A soft cap ``b * tanh(a * s)``
(Gemma 2) is applied to each block's scores before the mask.

Measured on an H100: 0.94-1.0x cuDNN at d=128, 0.95-0.98x at d=64, 1.06-1.22x
the Triton form's speed (session 65); causal 0.91-1.10x cuDNN, 1.05-1.35x the
Triton form's speed; capped (Gemma 2) 1.16-1.37x the Triton form's speed
(session 66). With the queries in registers (session 67): 0.78-0.95x the
time with them in shared memory; large attention 1.00x cuDNN per call in
the benchmark, 1.04x causal. d=256 with K slots released early (session
68): 1.01-1.05x cuDNN per call without a mask, 1.08-1.16x causal.

The form is printed only for what it computes exactly: softmax attention
``softmax(mask(cap(c * q.k^T))) . v`` (``attention_form`` recognises it from
the IR and says why not otherwise): at most one band mask and one soft cap,
no bias, 16-bit q/k/v/out of one dtype, head dimensions of 64, 128 or 256,
query and key lengths multiples of its tiles, each operand's head a
[rows, dim] block of a 2-D view with unit inner stride. It runs on the GPU
only: Triton's interpreter has no Gluon, so CPU runs use the Triton form of
the same region.

A training forward (the region capture finds in ``jax.grad`` of attention)
also writes what its backward reads (``RowOutput``): the softmax's row max
and row sum, in float32, and ``rowsum(do * o)`` of the cotangent ``do``
and the float32 output before its rounding to 16 bits (as the Triton form
reads it); ``do``'s tile loads while the tile's last P.V runs.
On an H100 (session 82) that kernel ran 0.63-0.74x the Triton form's time
at 2048-4096 tokens, head dims 64 and 128, causal or not.

Example::

    form = attention_form(region)          # an AttentionForm, or why not (str)
    pk = print_kernel(region, plan, sm_count=132)
    print(pk.source)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import string
from typing import Optional, Union

from jaxfuse import ir
from jaxfuse.codegen import streaming
from jaxfuse.codegen.triton_printer import CodegenError, PrintedKernel

__all__ = ["GLUON_ATTENTION", "AttentionForm", "BandCode", "attention_form", "band_code", "key_blocks",
           "masked_blocks", "print_kernel", "smem_bytes", "tile_sizes", "ROWS_PER_WARPGROUP",
           "SCRATCH_PER_PROGRAM"]

# Plan.form of this kernel.
GLUON_ATTENTION = "gluon-ws"
# Query rows of each of the two consumer warpgroups (one wgmma M atom).
ROWS_PER_WARPGROUP = 64
BLOCK_M = 2 * ROWS_PER_WARPGROUP
# Global scratch of one program: four 128-byte TMA descriptors.
SCRATCH_PER_PROGRAM = 4 * 128
_HEAD_DIMS = (64, 128, 256)
_DTYPES = {"float16": "gl.float16", "bfloat16": "gl.bfloat16"}
_MAX_BATCH_TILES = 1 << 16    # batch index combinations checked one by one
# Registers per thread of the second consumer warpgroup (the first gets what
# is left of 64K after it and the loader's 24): 240 measured 3-4% faster
# than 232 at d=64 and no faster at d=128 (H100, session 65); at d=256 232
# ran 0-2% faster (session 66).
_CONSUMER_REGS = {64: 240, 128: 232, 256: 232}
_SMEM_BYTES = 227 * 1024
# How a causal kernel's programs walk its tiles: "pairs" (each takes query
# tiles i and last - i of a head together, so that every pair holds the same
# number of key blocks) or "rows" (as without a mask: the query tiles of one
# head after another).
CAUSAL_TILE_ORDER = "pairs"
# Head dimensions whose warpgroups hold their queries in registers
# (``_query_code``), and the most kept key blocks (of 128) per tile, on
# average, at which a masked or capped kernel still does: there the mask
# needs registers too. H100, session 67, CUDA-graph µs of the printed
# kernels: in registers 0.78-0.95x the time in shared memory without a
# mask (d=64 and 128, 512-4096 keys; 0.89-0.93x causal d=64); causal
# d=128 0.89x at 4.5 kept blocks, 0.95x at 8.5, but 1.05-1.10x at 16.5.
# At d=256 the queries would take 64 of the 232 registers.
QUERIES_IN_REGISTERS = {64: math.inf, 128: 12.0}


@dataclasses.dataclass(frozen=True)
class Operand:
  """One operand's 2-D view: ``rows`` x ``row_stride`` elements, unit inner
  stride; a head starts at ``sum(index * batch_strides)`` elements."""
  index: int                     # position among the kernel's buffers
  batch_strides: tuple[int, ...]
  row_stride: int
  rows: int
  width: int                     # head dimension (columns of one head)


@dataclasses.dataclass(frozen=True)
class AttentionForm:
  batch: tuple[tuple[str, int], ...]    # batch loops (outermost first), extents
  m: str
  n: str
  d: str                                # the q.k^T contraction's loop
  e: str                                # the output's head dimension
  extents: tuple[int, int, int, int]    # M, N, D, E
  scale: float                          # c of softmax(c * q.k^T)
  dtype: str
  q: Operand
  k: Operand
  v: Operand
  out: Operand
  # The keys each query row keeps (streaming.Band against the row loop m):
  # key i of row o where o + lower <= i <= o + upper; None: every key.
  band: Optional[streaming.Band] = None
  # (a, b): the scaled scores s become b * tanh(a * s) before the mask and
  # the softmax (a soft cap); None: no cap.
  cap: Optional[tuple[float, float]] = None
  # Row statistics written beside the output (``RowOutput``), and the
  # input the row dot reads (None without one).
  rows_out: tuple["RowOutput", ...] = ()
  dout: Optional[Operand] = None


@dataclasses.dataclass(frozen=True)
class RowOutput:
  """A float32 output with one value per query row: ``kind`` "max" (the
  row max of the scaled scores), "sum" (the row sum of their exponentials
  shifted by that max) or "dot" (``rowsum(dout * out)`` of the 16-bit
  output). Row o of a head is at ``sum(index * batch_strides) + o * row_stride``."""
  kind: str
  index: int
  batch_strides: tuple[int, ...]
  row_stride: int


def _literal(a) -> Union[float, None]:
  return float(a.value) if isinstance(a, ir.Literal) else None


def attention_form(region: ir.Region) -> Union[AttentionForm, str]:
  """The region as softmax attention this kernel computes, or why it is not."""
  contractions = region.contractions
  if len(contractions) not in (2, 3) or len(region.inputs) != len(contractions) + 1:
    return ("not two contractions over three inputs (or three, the last a row dot "
            "of the output, over four)")
  if any(b.window or b.part_loop or b.offset for b in (*region.inputs, *region.outputs)):
    return "an operand is a window or a part buffer"
  vm = region.value_map
  ins = {b.value: b for b in region.inputs}
  c0, c1 = contractions[:2]
  if c0.lhs not in ins or c0.rhs not in ins or len(c0.reduce) != 1:
    return "the first contraction does not read two inputs over one loop"
  if len(c1.reduce) != 1:
    return "the second contraction reduces more than one loop"
  n = c1.reduce[0]
  d = c0.reduce[0]
  vname = c1.rhs if c1.rhs in ins else (c1.lhs if c1.lhs in ins else None)
  if vname is None or vname in (c0.lhs, c0.rhs):
    return "the second contraction does not read the third input"
  pname = c1.lhs if vname == c1.rhs else c1.rhs
  row_dot = None
  if len(contractions) == 3:
    row_dot = _row_dot(region, c1, contractions[2], set(ins) - {c0.lhs, c0.rhs, vname})
    if isinstance(row_dot, str):
      return row_dot
  info = streaming.analyze(region)
  if info.single_tile or n not in info.streamed:
    return "its softmax does not stream over the key loop"
  # A mask the kernel applies: a band of keys per query (causal, a sliding
  # window) that the running max and the shift read, whose masked tiles
  # contribute nothing (streaming.masked_tile_relation). Its predicate is
  # computed from indices alone; the one op that applies it is the masked
  # score. Any other use of an index is not this kernel's.
  band = streaming.masked_tile_relations(region).get(n)
  masked = None
  if band is not None:
    mx = next((op for op in region.ops if isinstance(op, ir.Reduction) and op.kind == "max"), None)
    # The max may read the masked scores through a cast (autodiff's softmax
    # in float32 of 16-bit scores).
    masked = mx and region.producer(_through_converts(region, mx.arg))
    if masked is None or streaming.masked_value(region, mx.arg) is None:
      return "a mask the kernel does not apply"
  pure: set[str] = set()      # values of indices and literals only (the mask's predicate)
  for op in region.ops:
    if isinstance(op, ir.Iota) or (isinstance(op, ir.Elementwise) and op is not masked and all(
        isinstance(a, ir.Literal) or a in pure for a in op.args)):
      pure.add(op.out)
  if pure and band is None:
    return "it reads an index other than as a band mask"
  cap = _soft_cap(region)
  if isinstance(cap, str):
    return cap
  cap_ops = cap[2] if cap else ()
  # Every op between the contractions must be one of softmax's, each once;
  # anything else (a bias, another mask) is printed by the Triton form.
  scale = 1.0
  saw: dict[str, ir.Op] = {}
  for op in region.ops:
    if isinstance(op, ir.Contraction) or op.out in pure or op is masked or op in cap_ops:
      continue
    if any(a in pure for a in getattr(op, "args", ())):
      return f"an op {op.fn} reads an index"
    if isinstance(op, ir.Reduction):
      if op.loop != n or op.kind not in ("max", "sum") or op.kind in saw:
        return f"a reduction {op.kind} over {op.loop}"
      saw[op.kind] = op
      continue
    fn, args = op.fn, op.args
    lits = [_literal(a) for a in args]
    if fn == "convert":
      continue
    if fn in ("mul", "div") and any(l is not None for l in lits):
      c = next(l for l in lits if l is not None)
      if c <= 0 or (fn == "div" and _literal(args[1]) is None) or "scale" in saw:
        return f"a {fn} by {c}"
      # A positive literal on the scores is the softmax scale; on the
      # output it would be one too many factors, which the kernel lacks.
      src = next(a for a in args if isinstance(a, str))
      if not region.computed_from(src, c0.out) or _after_reduction(region, src):
        return f"a {fn} by a literal off the scores"
      scale = c if fn == "mul" else 1.0 / c
      saw["scale"] = op
      continue
    if fn in ("sub", "exp", "div") and fn in saw:
      return f"a second {fn}"
    if fn == "sub" and all(isinstance(a, str) for a in args):
      saw["sub"] = op
      continue
    if fn == "exp" and len(args) == 1:
      saw["exp"] = op
      continue
    if fn == "div" and all(isinstance(a, str) for a in args):
      # Only by the softmax's denominator (a row sum), never by the scores.
      if not _is_row_sum(region, args[1], n) or region.computed_from(args[1], c1.out):
        return "a division by something other than the softmax's sum"
      saw["div"] = op
      continue
    return f"an op {fn} the kernel does not compute"
  if set(saw) - {"scale"} != {"max", "sum", "sub", "exp", "div"}:
    return "not a softmax (max, sub, exp, sum, div)"
  # One softmax of one scaled score: the shift's scores carry the scale
  # (the row max it subtracts cancels in the division whatever it is),
  # and the sum and the second contraction read the one exponential.
  sub, exp = saw["sub"], saw["exp"]
  scores = saw["scale"].out if "scale" in saw else c0.out
  if cap:
    # The cap reads the (scaled) scores, and nothing scales its result.
    pre = cap_ops[0]
    src = next(a for a in pre.args if isinstance(a, str))
    if _through_converts(region, src) != scores:
      return "the cap does not read the (scaled) scores"
    scores = cap_ops[2].out
  if not region.computed_from(sub.args[0], scores):
    return "the shift does not read the (scaled) scores"
  if masked is not None:
    # The mask applies to the scaled scores themselves (a positive scale
    # keeps -inf where the kernel applies it, before scaling), and the
    # max and the shift both read the masked scores.
    mv = streaming.masked_value(region, masked.out)
    if (_through_converts(region, mv.kept) != scores
        or _through_converts(region, saw["max"].arg) != masked.out
        or _through_converts(region, sub.args[0]) != masked.out):
      return "the mask is not applied to the scores the softmax reads"
  if not all(region.computed_from(v, exp.out) for v in (saw["sum"].arg, pname)) or \
      not region.computed_from(exp.args[0], sub.out):
    return "the sum or the second contraction does not read the softmax's exponential"
  # Row statistics the kernel writes beside the output (a training
  # forward's, for the backward): the row max, the row sum and the row dot.
  stats = {saw["max"].out: "max", saw["sum"].out: "sum"}
  if row_dot is not None:
    stats[row_dot[1].out] = "dot"
  kinds = {b.value: stats[b.value] for b in region.outputs if b.value in stats}
  results = [b for b in region.outputs if b.value not in stats]
  if len(results) != 1:
    return (f"outputs {', '.join(b.value for b in results)}: beside its result the kernel writes "
            "only the softmax's row max and sum and a row dot, in float32")
  out = results[0]
  if row_dot is not None and row_dot[2] != out.value:
    return "a row dot of another value than the output"
  if row_dot is not None and "dot" not in kinds.values():
    return "a row dot that is not an output"
  if any(vm[v].dtype != "float32" for v in kinds):
    return "a row statistic written in another type than float32"
  if "max" in kinds.values() or "sum" in kinds.values():
    # The kernel's running max is of the scores it exponentiates, and its
    # sum is of their exponentials shifted by that max: the outputs must
    # be exactly those (a softmax may shift by any max, not so its output).
    mx = saw["max"]
    if (masked is None and _through_converts(region, mx.arg) != scores) or sub.args[1] != mx.out \
        or _through_converts(region, saw["sum"].arg) != exp.out \
        or _through_converts(region, exp.args[0]) != sub.out \
        or (masked is None and _through_converts(region, sub.args[0]) != scores):
      return "row statistics of another max or sum than the softmax's own"
  dout_name = row_dot[0] if row_dot is not None else None
  sixteen = [b for b in (*region.inputs, *region.outputs) if b.value not in kinds]
  dtypes = {vm[b.value].dtype for b in sixteen}
  if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
    return f"operand dtypes {sorted(dtypes)}: one 16-bit float type is needed"
  # The key is the first contraction's operand indexed by the key loop
  # (capture may write the scores as k.q^T).
  if (n in vm[c0.lhs].loops) == (n in vm[c0.rhs].loops):
    return "the first contraction's operands are not a query and a key"
  kname, qname = (c0.lhs, c0.rhs) if n in vm[c0.lhs].loops else (c0.rhs, c0.lhs)
  ext = region.loop_extents
  # The query's own loops are its rows and, under grouped-query attention,
  # the heads that share a key (a loop the key does not have): the longest
  # is the rows, the others are heads.
  qloops = [l for l in vm[qname].loops if l != d and l not in vm[kname].loops]
  if not qloops:
    return "the query has no row loop"
  m = max(qloops, key=lambda l: (ext[l], l))
  if band is not None and band.other != m:
    return f"the mask relates the keys to loop {band.other}, not the query rows"
  if band is not None and not band.keeps_some(ext[n], ext[m]):
    return "the mask leaves a query row no key"
  # The value's head dimension: its loop the query lacks and the output has.
  e_loops = [l for l in vm[vname].loops
             if l != n and l not in vm[qname].loops and l in vm[out.value].loops and ext[l] > 1]
  if len(e_loops) != 1:
    return "the value has no single head-dimension loop"
  e = e_loops[0]
  batch = [l.name for l in region.loops if l.name not in (m, n, d, e)]
  M, N, D, E = ext[m], ext[n], ext[d], ext[e]
  if D != E or D not in _HEAD_DIMS:
    return f"head dimensions {D}, {E}: the kernel takes one of {_HEAD_DIMS} for both"
  if M % BLOCK_M or N % 64:
    return f"lengths {M} x {N}: queries must be a multiple of {BLOCK_M}, keys of 64"
  order = [b.value for b in (*region.inputs, *region.outputs)]
  ops = {}
  roles = [("q", qname, m, d), ("k", kname, n, d), ("v", vname, n, e), ("out", out.value, m, e)]
  if dout_name is not None:
    if set(vm[row_dot[1].out].loops) != set(batch) | {m}:
      return "the row dot is not one value per query row"
    roles.append(("dout", dout_name, m, e))
  for role, name, row, col in roles:
    buf = next(b for b in (*region.inputs, *region.outputs) if b.value == name)
    if set(buf.loops) - set(batch) - {row, col}:
      return f"{role} is indexed by another loop"
    if buf.stride(col) != 1:
      return f"{role}'s head dimension is not contiguous"
    r = buf.stride(row)
    width = ext[col]
    size = buf.size
    if r < width or size % r or (r * 2) % 16:
      return f"{role} has no 2-D view of unit inner stride"
    strides = tuple(buf.stride(l) for l in batch)
    if math.prod(ext[l] for l in batch) > _MAX_BATCH_TILES:
      return "too many heads to check"
    for idx in itertools.product(*(range(ext[l]) for l in batch)):
      base = sum(i * s for i, s in zip(idx, strides))
      if base % r + width > r or base // r + ext[row] > size // r:
        return f"{role}'s heads do not lie in rows of one 2-D view"
    if role == "dout" and size >= 2**31:
      return "dout is too large for 32-bit offsets"
    ops[role] = Operand(order.index(name), strides, r, size // r, width)
  rows_out = []
  for b in region.outputs:
    if b.value not in kinds:
      continue
    if set(b.loops) - set(batch) - {m} or set(vm[b.value].loops) != set(batch) | {m}:
      return f"the row {kinds[b.value]} is not one value per query row"
    if b.size >= 2**31:
      return f"the row {kinds[b.value]} is too large for 32-bit offsets"
    rows_out.append(RowOutput(kinds[b.value], order.index(b.value),
                              tuple(b.stride(l) for l in batch), b.stride(m)))
  return AttentionForm(tuple((l, ext[l]) for l in batch), m, n, d, e, (M, N, D, E), scale,
                       next(iter(dtypes)), ops["q"], ops["k"], ops["v"], ops["out"], band,
                       (cap[0], cap[1]) if cap else None, tuple(rows_out), ops.get("dout"))


def _row_dot(region: ir.Region, c1: ir.Contraction, c2: ir.Contraction, others: set[str]):
  """(the input ``dout``, ``c2``, the output it reads) where ``c2`` is
  ``rowsum(dout * out)`` over the output's head dimension, in float32, of
  an output computed from ``c1``'s result and an input no other op reads
  (FlashAttention-2's D, which a training forward computes for its
  backward), or why not (a str)."""
  vm = region.value_map
  if len(c2.reduce) != 1 or c2.reduce[0] not in vm[c1.out].loops:
    return "a third contraction that is not a row dot of the output"
  outs = {b.value for b in region.outputs}
  a, b = (_through_converts(region, x) for x in (c2.lhs, c2.rhs))
  if a not in outs:
    a, b = b, a
  if a not in outs or not region.computed_from(a, c1.out) or b not in others:
    return "a third contraction that is not a row dot of the output and an input"
  # The input is read by the row dot only (through its converts).
  chain = {b}
  for op in region.ops:
    if op is not c2 and any(x in chain for x in getattr(op, "inputs", ())):
      if not (isinstance(op, ir.Elementwise) and op.fn == "convert"):
        return "the row dot's input is read by another op"
      chain.add(op.out)
  if region.consumers(c2.out):
    return "an op reads the row dot"
  if vm[c2.out].dtype != "float32" or any(vm[x].dtype != "float32" for x in (c2.lhs, c2.rhs)):
    return "a row dot of other than float32 products"
  return b, c2, a


def _soft_cap(region: ir.Region):
  """A soft cap of the scores, ``b * tanh(a * s)`` (Gemma 2's
  ``cap * tanh(s / cap)``): (a, b, (the op of a, the tanh, the op of b));
  None where no op is a tanh; why not (a str) where one is but not so."""
  tanhs = [op for op in region.ops if isinstance(op, ir.Elementwise) and op.fn == "tanh"]
  if not tanhs:
    return None
  if len(tanhs) > 1:
    return "more than one tanh"
  th = tanhs[0]
  pre = region.producer(_through_converts(region, th.args[0]))
  a = None
  if isinstance(pre, ir.Elementwise) and pre.fn in ("mul", "div") and len(pre.args) == 2:
    lits = [_literal(x) for x in pre.args]
    if pre.fn == "mul" and sum(l is not None for l in lits) == 1:
      a = next(l for l in lits if l is not None)
    elif pre.fn == "div" and lits[1] is not None and lits[0] is None and lits[1] != 0:
      a = 1.0 / lits[1]
  users = [op for op in region.ops if th.out in getattr(op, "args", ())]
  while len(users) == 1 and isinstance(users[0], ir.Elementwise) and users[0].fn == "convert":
    users = [op for op in region.ops if users[0].out in getattr(op, "args", ())]
  post = users[0] if len(users) == 1 else None
  b = None
  if isinstance(post, ir.Elementwise) and post.fn == "mul" and len(post.args) == 2:
    lits = [_literal(x) for x in post.args]
    if sum(l is not None for l in lits) == 1:
      b = next(l for l in lits if l is not None)
  if not a or not b or not (math.isfinite(a) and math.isfinite(b)):
    return "a tanh that is not a soft cap b * tanh(a * s) of literals a, b"
  return a, b, (pre, th, post)


def _through_converts(region: ir.Region, name: str) -> str:
  """The value ``name`` converts, seen through any chain of converts."""
  op = region.producer(name)
  while isinstance(op, ir.Elementwise) and op.fn == "convert" and isinstance(op.args[0], str):
    name = op.args[0]
    op = region.producer(name)
  return name


def _is_row_sum(region: ir.Region, name: str, loop: str) -> bool:
  """Whether ``name`` is a sum over ``loop``, possibly converted."""
  op = region.producer(name)
  while isinstance(op, ir.Elementwise) and op.fn == "convert":
    op = region.producer(op.args[0])
  return isinstance(op, ir.Reduction) and op.kind == "sum" and op.loop == loop


def _after_reduction(region: ir.Region, name: str) -> bool:
  """Whether value ``name`` is computed from a reduction's result."""
  return any(isinstance(op, ir.Reduction) and region.computed_from(name, op.out) for op in region.ops)


def tile_sizes(form: AttentionForm) -> tuple[int, int]:
  """(key tile, pipeline stages): the widest key tile and the deepest ring
  of K/V stages that fit shared memory (measured best at d=64-128; at
  d=256 two stages of 64 keys fit beside the 64 KB query tile)."""
  M, N, D, E = form.extents
  bn = 128 if N % 128 == 0 and max(D, E) <= 128 else 64
  item = 2
  fixed = BLOCK_M * max(D, E) * item + 1024
  stages = 3
  while stages > 2 and fixed + stages * bn * (D + E) * item > _SMEM_BYTES:
    stages -= 1
  return bn, stages


def smem_bytes(form: AttentionForm, bn: int, stages: int) -> int:
  """Shared memory of the kernel: the query/output tile, ``stages`` K/V
  slots of ``bn`` keys, and 1 KB of barriers."""
  _, _, D, E = form.extents
  return BLOCK_M * max(D, E) * 2 + stages * bn * (D + E) * 2 + 1024


_TEMPLATE = string.Template('''\
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

# Triton 3.9 renamed the TMA copies; 3.6 has only the old names.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global


@gluon.jit
def _${name}_coords(t, X_ROWS: gl.constexpr, Y_ROWS: gl.constexpr):
    # Tile t: query tile mt of head bi (tile_order). Returns each operand's
    # first row and column in its 2-D view, and the tile's first query.
${tile_order}
${batch_code}
    q_base = ${q_base}
    k_base = ${k_base}
    v_base = ${v_base}
    o_base = ${o_base}${row_bases}
    return (q_base // ${q_r} + mt * X_ROWS, q_base % ${q_r}, k_base // ${k_r}, k_base % ${k_r},
            v_base // ${v_r}, v_base % ${v_r}, o_base // ${o_r} + mt * X_ROWS, o_base % ${o_r},
            mt * X_ROWS${row_returns})
${mask_helpers}


@gluon.jit
def _${name}_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty,
                    v_empty, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    it = 0
    tc = 0
    for t in ${tile_loop}:
        q_row, q_col, k_row, k_col, v_row, v_col, o_row, o_col, m0${row_returns} = _${name}_coords(
            t, BM, BN)
        blk_lo = ${blk_lo}
        blk_hi = ${blk_hi}
${q_empty_why}
        mbarrier.wait(q_empty, (tc & 1) ^ 1)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, q_col], q_bar, q_smem)
        for j in range(blk_lo, blk_hi):
            # K and V slots come free apart: a K slot as soon as its Q.K^T is
            # done, a step before its V slot (after P.V). In a ring of two (d=256)
            # each K then loads a whole step ahead, not just before its Q.K^T.
            idx = it % STAGES
            mbarrier.wait(k_empty.index(idx), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(k_bar.index(idx), k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_row + j * BN, k_col], k_bar.index(idx), k_smem.index(idx))
            mbarrier.wait(v_empty.index(idx), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(v_bar.index(idx), v_desc.block_type.nbytes)
            _tma_load(v_desc, [v_row + j * BN, v_col], v_bar.index(idx), v_smem.index(idx))
            it += 1
        tc += 1


@gluon.jit
def _${name}_compute(o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty, v_empty,${row_params}
                     WG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                     E: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = ${dtype}
    RM: gl.constexpr = ${rows_per_wg}
    qk_scale: gl.constexpr = ${qk_scale}
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, E, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_part = q_smem.slice(WG * RM, RM, dim=0)
    o_part = q_part      # the output tile is staged where this warpgroup's queries were
    zero_s = gl.zeros([RM, BN], gl.float32, s_layout)
${q_prologue}
    it = 0
    tc = 0
    for t in ${tile_loop}:
        q_row, q_col, k_row, k_col, v_row, v_col, o_row, o_col, m0${row_returns} = _${name}_coords(
            t, BM, BN)
        blk_lo = ${blk_lo}
        blk_hi = ${blk_hi}
        r0 = m0 + WG * RM
        acc = gl.zeros([RM, E], gl.float32, o_layout)
${q_wait}
        idx = it % STAGES
        mbarrier.wait(k_bar.index(idx), (it // STAGES) & 1)
        s_tok = warpgroup_mma(q_op, k_smem.index(idx).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
${q_release}
        sc = warpgroup_mma_wait(0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(idx), count=1)
${cap_first}
${mask_first}
        # The row max of the unscaled scores: the scale is positive.
        m_i = gl.max(sc, 1) * qk_scale
${shift_first}
        p = gl.exp2(sc * qk_scale - m_s[:, None])
        l_i = gl.sum(p, 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, blk_hi - blk_lo):
            cur = (it + j) % STAGES
            prev = (it + j - 1) % STAGES
            mbarrier.wait(k_bar.index(cur), ((it + j) // STAGES) & 1)
            s_tok = warpgroup_mma(q_op, k_smem.index(cur).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_bar.index(prev), ((it + j - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            # Block j's scores are ready while the previous block's P.V runs.
            sc = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(cur), count=1)
${cap_loop}
${mask_loop}
            m_new = gl.maximum(m_i, gl.max(sc, 1) * qk_scale)
${shift_loop}
            alpha = gl.exp2(m_i - m_s)
            p = gl.exp2(sc * qk_scale - m_s[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p16 = gl.convert_layout(p.to(dtype), p_layout)
        last = (it + blk_hi - blk_lo - 1) % STAGES
        mbarrier.wait(v_bar.index(last), ((it + blk_hi - blk_lo - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)${dout_load}
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(v_empty.index(last), count=1)
        acc = acc / gl.convert_layout(l_i, row_o)[:, None]
${q_next}
        o16 = acc.to(dtype)
        o_part.store(o16)
        fence_async_shared()
        _tma_store(o_desc, [o_row + WG * RM, o_col], o_part)${row_stores}
${o_release}
        it += blk_hi - blk_lo
        tc += 1
${q_epilogue}


@gluon.jit
def _${name}_part(ROLE: gl.constexpr, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar,${row_params}
                  q_empty, k_bar, v_bar, k_empty, v_empty, BM: gl.constexpr, BN: gl.constexpr,
                  D: gl.constexpr, E: gl.constexpr, STAGES: gl.constexpr):
    if ROLE == 2:
        _${name}_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar,
                        k_empty, v_empty, BM, BN, STAGES)
    else:
        _${name}_compute(o_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_bar, v_bar, k_empty, v_empty,${row_params}
                         ROLE, BM, BN, D, E, STAGES)


@gluon.jit
def ${name}(${params}, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, E: gl.constexpr,
            STAGES: gl.constexpr, REGS: gl.constexpr):
    dtype: gl.constexpr = ${dtype}
    lq: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
    lk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
    lv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, E], dtype)
    lo: gl.constexpr = gl.NVMMASharedLayout.get_default_for([${rows_per_wg}, E], dtype)
    q_desc = tma.make_tensor_descriptor(${q_ptr}, [${q_rows}, ${q_r}], [${q_r}, 1], [BM, D], lq)
    k_desc = tma.make_tensor_descriptor(${k_ptr}, [${k_rows}, ${k_r}], [${k_r}, 1], [BN, D], lk)
    v_desc = tma.make_tensor_descriptor(${v_ptr}, [${v_rows}, ${v_r}], [${v_r}, 1], [BN, E], lv)
    o_desc = tma.make_tensor_descriptor(${o_ptr}, [${o_rows}, ${o_r}], [${o_r}, 1],
                                        [${rows_per_wg}, E], lo)
    q_smem = gl.allocate_shared_memory(dtype, [BM, D], lq)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], lk)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, E], lv)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(s), count=1)
        mbarrier.init(v_bar.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_${name}_part, (0, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar,${row_params} q_empty, k_bar,
                         v_bar, k_empty, v_empty, BM, BN, D, E, STAGES)),
        (_${name}_part, (1, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar,${row_params} q_empty, k_bar,
                         v_bar, k_empty, v_empty, BM, BN, D, E, STAGES)),
        (_${name}_part, (2, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar,${row_params} q_empty, k_bar,
                         v_bar, k_empty, v_empty, BM, BN, D, E, STAGES)),
    ], [4, 1], [REGS, 24])
''')


def _base_expr(op: Operand, batch: tuple[tuple[str, int], ...]) -> str:
  terms = [f"i_{l} * {s}" for (l, _), s in zip(batch, op.batch_strides) if s]
  return " + ".join(terms) if terms else "0"


def key_blocks(form: AttentionForm, bn: int) -> list[tuple[int, int]]:
  """[first, end) of the key blocks (of ``bn`` keys) each query tile runs:
  all of them, or under ``form.band`` those holding a key some row keeps
  (the printed ``blk_lo`` / ``blk_hi``)."""
  M, N = form.extents[:2]
  out = []
  for m0 in range(0, M, BLOCK_M):
    lo, hi = 0, N // bn
    if form.band is not None and form.band.upper is not None:
      hi = min(hi, (m0 + BLOCK_M - 1 + form.band.upper) // bn + 1)
    if form.band is not None and form.band.lower is not None:
      lo = max(lo, (m0 + form.band.lower) // bn)
    out.append((lo, hi))
  return out


def masked_blocks(form: AttentionForm, bn: int) -> list[float]:
  """Per query tile, the key blocks (of ``bn``) in which the kernel applies
  ``form.band``'s mask, counted in halves: each warpgroup masks a block
  where one of its rows drops a key (``band_code``'s ``need``)."""
  band = form.band
  out = []
  for m0, (lo, hi) in zip(range(0, form.extents[0], BLOCK_M), key_blocks(form, bn)):
    halves = 0
    if band is not None:
      for r0 in range(m0, m0 + BLOCK_M, ROWS_PER_WARPGROUP):
        halves += sum(1 for j in range(lo, hi)
                      if (band.upper is not None and j * bn + bn - 1 - r0 > band.upper)
                      or (band.lower is not None and j * bn - r0 - (ROWS_PER_WARPGROUP - 1) < band.lower))
    out.append(halves / (BLOCK_M // ROWS_PER_WARPGROUP))
  return out


_CAP_HELPER = string.Template('''

@gluon.jit
def _${name}_cap(sc):
    # b * tanh(a * s) as b - 2b / (1 + e^(2as)): one exp2 and one fast
    # division (2 ulp); saturates to +-b without overflow.
    e = gl.exp2(sc * ${two_a_log2e})
    return ${b} - gl.fdiv(gl.full_like(e, ${two_b}), e + 1.0)
''')


_MASK_HELPER = string.Template('''

@gluon.jit
def _${name}_mask(sc, kb, r0, RM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    # Scores of keys outside row o's band (o + lower <= key <= o + upper)
    # become -inf: exp2 makes them 0 and a row max never picks them.
    rows = r0 + gl.arange(0, RM, layout=gl.SliceLayout(1, layout))
    cols = kb + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    rel = cols[None, :] - rows[:, None]
    return gl.where(${keep}, sc, float("-inf"))
''')


@dataclasses.dataclass(frozen=True)
class BandCode:
  """How the kernel applies a band, as expressions it prints: the key
  blocks a tile runs, ``blk_lo`` to ``blk_hi`` (of ``m0``, its first query,
  and ``BN``); ``need``: whether block ``kb`` (its first key) drops a key
  of the warpgroup rows from ``r0``; ``keep``: whether key - query ``rel``
  is in the band."""
  blk_lo: str
  blk_hi: str
  need: str
  keep: str


def band_code(band: streaming.Band, bn: int, n_blocks: int) -> BandCode:
  """The ``BandCode`` of ``band`` for key blocks of ``bn`` (``n_blocks`` in all)."""
  lo, hi = band.lower, band.upper
  keep, need = [], []
  blk_lo, blk_hi = "0", str(n_blocks)
  if hi is not None:
    # The tile's last row keeps keys up to m0 + BM - 1 + hi (>= 0: every
    # row keeps some key, attention_form).
    blk_hi = f"gl.minimum((m0 + {BLOCK_M - 1 + hi}) // BN + 1, {n_blocks})"
    keep.append(f"(rel <= {hi})")
    need.append(f"(kb + {bn - 1} - r0 > {hi})")
  if lo is not None:
    # Clamped: // truncates a negative start to a block <= 0.
    blk_lo = f"gl.maximum((m0 + {lo}) // BN, 0)"
    keep.append(f"(rel >= {lo})")
    need.append(f"(kb - r0 - {ROWS_PER_WARPGROUP - 1} < {lo})")
  return BandCode(blk_lo, blk_hi, " | ".join(need), " & ".join(keep))


def _mask_code(form: AttentionForm, name: str, bn: int, n_blocks: int) -> dict[str, str]:
  """The template's pieces that apply ``form.band`` (``band_code``): each
  tile's range of key blocks, the mask on the blocks where a row of a
  warpgroup drops a key, and the shift's guard against rows whose first
  block keeps nothing (a window: -inf - -inf would be NaN)."""
  band = form.band
  if band is None:
    return dict(blk_lo="0", blk_hi=str(n_blocks), mask_helpers="", mask_first="", mask_loop="",
                shift_first="        m_s = m_i", shift_loop="            m_s = m_new")
  code = band_code(band, bn, n_blocks)
  helper = _MASK_HELPER.substitute(name=name, keep=code.keep)

  def apply(indent: str, first: str) -> str:
    return (f"{indent}kb = {first} * BN\n"
            f"{indent}if {code.need}:\n"
            f"{indent}    sc = _{name}_mask(sc, kb, r0, RM, BN, s_layout)")

  if band.lower is None:      # every row keeps key 0, in its first block
    shift_first, shift_loop = "        m_s = m_i", "            m_s = m_new"
  else:
    shift_first = '        m_s = gl.where(m_i == float("-inf"), 0.0, m_i)'
    shift_loop = '            m_s = gl.where(m_new == float("-inf"), 0.0, m_new)'
  return dict(blk_lo=code.blk_lo, blk_hi=code.blk_hi, mask_helpers=helper,
              mask_first=apply("        ", "blk_lo"), mask_loop=apply("            ", "(blk_lo + j)"),
              shift_first=shift_first, shift_loop=shift_loop)


def queries_in_registers(form: AttentionForm) -> bool:
  """Whether the printed kernel's warpgroups hold their queries in
  registers (``QUERIES_IN_REGISTERS``) rather than in shared memory."""
  d = form.extents[2]
  if d not in QUERIES_IN_REGISTERS:
    return False
  if form.band is None and form.cap is None:
    return True
  spans = key_blocks(form, 128)
  return sum(hi - lo for lo, hi in spans) / len(spans) <= QUERIES_IN_REGISTERS[d]


def _query_code(registers: bool, n_mine: str) -> dict[str, str]:
  """The template's pieces that hold a warpgroup's queries: in shared
  memory, or (``registers``) in registers, taken from the buffer when the
  tile starts (``n_mine``: the tiles this program runs). In shared memory
  the buffer holds the queries for the whole tile and then stages its
  output, so the next tile's queries load only once that output has left:
  a bubble per tile. In registers the next tile's queries load while this
  tile runs; the buffer is read into registers before this tile's output
  is staged there, and that store is waited for under the next tile's
  first Q.K^T."""
  if not registers:
    return dict(
        q_empty_why=("        # Q's buffer also stages the output: wait until both warpgroups\n"
                     "        # have stored the previous tile's."),
        q_prologue="    q_op = q_part", q_wait="        mbarrier.wait(q_bar, tc & 1)",
        q_release="", q_next="",
        o_release="        tma.store_wait(pendings=0)\n        mbarrier.arrive(q_empty, count=1)",
        q_epilogue="")
  return dict(
      q_empty_why=("        # Q's buffer also stages the output: wait until both warpgroups\n"
                   "        # have taken their queries into registers and stored their\n"
                   "        # previous output from it."),
      q_prologue=("    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,\n"
                  "                                                 k_width=2)\n"
                  f"    n_mine = {n_mine}\n"
                  "    q_op = gl.zeros([RM, D], dtype, q_layout)\n"
                  "    if n_mine > 0:\n"
                  "        mbarrier.wait(q_bar, 0)\n"
                  "        q_op = q_part.load(q_layout)"),
      q_wait="",
      q_release=("        # The previous output has left the buffer: the next queries may load.\n"
                 "        tma.store_wait(pendings=0)\n"
                 "        mbarrier.arrive(q_empty, count=1)"),
      q_next=("        if tc + 1 < n_mine:\n"
              "            mbarrier.wait(q_bar, (tc + 1) & 1)\n"
              "            q_op = q_part.load(q_layout)"),
      o_release="",
      q_epilogue="    tma.store_wait(pendings=0)")


def _tile_order(form: AttentionForm, n_tiles: int) -> tuple[str, str, str]:
  """(the persistent loop's range, the code mapping its index ``t`` to
  query tile ``mt`` of head ``bi``, the number of tiles a program runs). Programs take tiles round-robin, the
  query tiles of a head in a row, so that programs running together read
  the same heads' keys and values (L2). Under a causal mask a tile's work
  grows with its index: there each program takes tiles i and last - i of
  one head in turn, the longer first, and every pair holds the same work."""
  m_tiles = form.extents[0] // BLOCK_M
  causal = form.band is not None and form.band.upper is not None and form.band.lower is None
  if causal and CAUSAL_TILE_ORDER == "pairs" and m_tiles % 2 == 0:
    units, half = n_tiles // 2, m_tiles // 2
    count = (f"2 * (({units} - gl.program_id(0) + gl.num_programs(0) - 1) // "
             f"gl.num_programs(0))")
    order = (f"    u = gl.program_id(0) + (t // 2) * gl.num_programs(0)\n"
             f"    pi = u % {half}\n"
             f"    mt = gl.where(t % 2 == 0, {m_tiles - 1} - pi, pi)\n"
             f"    bi = u // {half}")
    return f"range(0, {count})", order, count
  return (f"range(gl.program_id(0), {n_tiles}, gl.num_programs(0))",
          f"    mt = t % {m_tiles}\n    bi = t // {m_tiles}",
          f"({n_tiles} - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)")


def _row_code(form: AttentionForm) -> dict[str, str]:
  """The template's pieces that write ``form.rows_out``: each tile's row
  statistics (the running max, in natural units, and sum, both final when
  the key loop ends) and the row dot ``rowsum(dout * out)`` of the 16-bit
  output. The dout tile is loaded while the last P.V runs."""
  if not form.rows_out:
    return dict(row_bases="", row_returns="", row_params="", dout_load="", row_stores="")
  names = [f"{r.kind}_base" for r in form.rows_out] + (["dout_base"] if form.dout else [])
  bases = "".join(f"\n    {r.kind}_base = {_base_expr(r, form.batch)}" for r in form.rows_out)
  if form.dout is not None:
    bases += f"\n    dout_base = {_base_expr(form.dout, form.batch)}"
  params = ["dout_ptr"] if form.dout is not None else []
  params += [f"{r.kind}_ptr" for r in form.rows_out]
  stats = {r.kind: r for r in form.rows_out}
  stores = ["        rows_s = r0 + gl.arange(0, RM, layout=gl.SliceLayout(1, s_layout))"]
  if "max" in stats:
    # m_i is the max of the scores times log2(e) (exp2's units).
    stores.append(f"        gl.store(max_ptr + max_base + rows_s * {stats['max'].row_stride}, "
                  f"m_i * {math.log(2.0)!r})")
  if "sum" in stats:
    stores.append(f"        gl.store(sum_ptr + sum_base + rows_s * {stats['sum'].row_stride}, l_i)")
  load = ""
  if "dot" in stats:
    load = ("\n        # The row dot's dout tile loads while the last P.V runs.\n"
            "        rows_o = r0 + gl.arange(0, RM, layout=row_o)\n"
            "        cols_o = gl.arange(0, E, layout=gl.SliceLayout(0, o_layout))\n"
            f"        do_t = gl.load(dout_ptr + dout_base + rows_o[:, None] * {form.dout.row_stride} "
            "+ cols_o[None, :])")
    # From the float32 accumulator, as the Triton form's row dot reads it:
    # under peaked attention D = rowsum(do * o) cancels against dp, and
    # the 16-bit output's rounding raised dq's error by 1.3-1.5x.
    stores.append("        d_row = gl.sum(do_t.to(gl.float32) * acc, 1)")
    stores.append(f"        gl.store(dot_ptr + dot_base + rows_o * {stats['dot'].row_stride}, d_row)")
  return dict(row_bases=bases, row_returns="".join(", " + n for n in names),
              row_params="".join(f" {p}," for p in params), dout_load=load,
              row_stores="\n" + "\n".join(stores))


def print_kernel(region: ir.Region, plan, *, sm_count: int) -> PrintedKernel:
  """The Gluon source of ``plan`` (``plan.form == GLUON_ATTENTION``) for
  ``region``; ``sm_count``: programs to run (one per SM, at most one per
  tile). Raises CodegenError where the region is not this kernel's."""
  form = attention_form(region)
  if isinstance(form, str):
    raise CodegenError(f"the Gluon attention kernel does not fit: {form}")
  if plan.form != GLUON_ATTENTION:
    raise CodegenError(f"plan form {plan.form!r} is not {GLUON_ATTENTION!r}")
  M, N, D, E = form.extents
  bn, stages = plan.tile(form.n), plan.num_stages
  if plan.tile(form.m) != BLOCK_M or N % bn or bn not in (64, 128):
    raise CodegenError(f"tiles m={plan.tile(form.m)}, n={bn}: the kernel takes m={BLOCK_M}, "
                       f"n=64 or 128 dividing {N}")
  smem = smem_bytes(form, bn, stages)
  if smem > _SMEM_BYTES:
    raise CodegenError(f"{stages} stages of {bn}-key tiles need {smem} bytes of shared memory")
  name = "jaxfuse_gluon_attention_" + region.signature()[:12].replace("-", "_")
  name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
  n_tiles = (M // BLOCK_M) * math.prod(x for _, x in form.batch)
  batch_code = []
  for l, x in reversed(form.batch):
    batch_code.append(f"    i_{l} = bi % {x}")
    batch_code.append(f"    bi = bi // {x}")
  roles = {"q": form.q, "k": form.k, "v": form.v, "out": form.out}
  if form.dout is not None:
    roles["dout"] = form.dout
  roles.update({r.kind: r for r in form.rows_out})
  params = [None] * len(roles)
  for role, op in roles.items():
    params[op.index] = f"{role}_ptr"
  scale = form.scale * math.log2(math.e)
  masks = _mask_code(form, name, bn, N // bn)
  cap = dict(cap_first="", cap_loop="")
  if form.cap is not None:
    # The cap reads the scaled scores; the softmax then has no scale.
    a, b = form.cap
    masks["mask_helpers"] += _CAP_HELPER.substitute(
        name=name, two_a_log2e=repr(2.0 * a * form.scale * math.log2(math.e)), b=repr(float(b)),
        two_b=repr(2.0 * b))
    cap = dict(cap_first=f"        sc = _{name}_cap(sc)", cap_loop=f"            sc = _{name}_cap(sc)")
    scale = math.log2(math.e)
  tile_loop, tile_order, n_mine = _tile_order(form, n_tiles)
  src = _TEMPLATE.substitute(
      **masks, **cap, **_query_code(queries_in_registers(form), n_mine), **_row_code(form),
      tile_loop=tile_loop, tile_order=tile_order,
      name=name, m_tiles=M // BLOCK_M, n_tiles=n_tiles,
      batch_code="\n".join(batch_code) or "    pass",
      q_base=_base_expr(form.q, form.batch), k_base=_base_expr(form.k, form.batch),
      v_base=_base_expr(form.v, form.batch), o_base=_base_expr(form.out, form.batch),
      q_r=form.q.row_stride, k_r=form.k.row_stride, v_r=form.v.row_stride, o_r=form.out.row_stride,
      q_rows=form.q.rows, k_rows=form.k.rows, v_rows=form.v.rows, o_rows=form.out.rows,
      q_ptr="q_ptr", k_ptr="k_ptr", v_ptr="v_ptr", o_ptr="out_ptr",
      params=", ".join(params), dtype=_DTYPES[form.dtype], rows_per_wg=ROWS_PER_WARPGROUP,
      qk_scale=repr(float(scale)))
  constexprs = (("BM", BLOCK_M), ("BN", bn), ("D", D), ("E", E), ("STAGES", stages),
                ("REGS", _CONSUMER_REGS[D]))
  # num_warps: the default partition's (the kernel runs 12: two consumer
  # warpgroups and the loader's, rounded up to a warpgroup).
  return PrintedKernel(source=src, kernel_name=name, grid=(max(1, min(sm_count, n_tiles)),),
                       constexprs=constexprs, num_warps=4, num_stages=stages,
                       global_scratch=SCRATCH_PER_PROGRAM)
