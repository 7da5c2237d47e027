"""Launching generated kernels: jax-triton on the GPU, Triton's interpreter on the CPU.

``fused_call(region, args, backend=...)`` plans the region (unless a plan is
given), generates the kernel and runs it:

* ``backend='triton'``: ``jax_triton.triton_call`` (imported lazily) with the
  plan's grid, ``num_warps`` and ``num_stages``, lowered to jaxfuse's own
  FFI launcher (``jaxfuse.runtime.direct_launch``) or jaxlib's typed FFI
  Triton target (``config.launch``; ``jaxfuse.runtime.triton_call``); usable inside a lowering
  (``mlir.lower_fun``) and inside ``jax.jit``.
* ``backend='interpret'``: a host callback (``host_call``) that runs the same
  kernel in Triton's interpreter on torch CPU tensors.

Plans are tried best first: a plan that fails to generate, to compile, to fit
in shared memory, or to pass a numerical self-check against the IR evaluator
is dropped for the next; when none works ``CodegenError`` is raised and the
caller runs the original ops.

Example::

    outs = fused_call(region, [q, k, v], backend="interpret")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
from absl import logging

from jaxfuse import ir
from jaxfuse.codegen import CodegenError, GeneratedKernel, generate
from jaxfuse.codegen.compile import interpret_env
from jaxfuse.runtime import compile_pool
from jaxfuse.runtime import device_clock
from jaxfuse.runtime import direct_launch
from jaxfuse.runtime import timing
from jaxfuse.runtime import triton_call


class LeftToXLA(CodegenError):
  """A decision, not a failure: the region runs as XLA's own ops because it
  is compute-bound, no plan fits on chip, or the model or a measurement
  says XLA is faster."""


__all__ = ["fused_call", "run_interpreted", "select_kernel", "measure_plans", "self_check",
           "LeftToXLA", "Outcome", "outcome"]

_lock = threading.Lock()
_interpreter_lock = threading.Lock()
# (region signature, plan str, backend) -> GeneratedKernel, or the error that dropped it.
_kernels: dict[tuple, Any] = {}
# (region signature, backend) -> the kernel chosen by the fallback chain.
_chosen: dict[tuple, GeneratedKernel] = {}
MEASURE_SEED = 7   # random inputs of measured tuning's self-check


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How ``fused_call`` settled a region in this process: its kernel's plan
  when fused, else why XLA's ops run; with the keep-or-drop timing when one
  was taken (per-call seconds, ``tune='measure'`` on the GPU).
  ``measured_xla_s`` is the fallback's time: XLA's ops, with
  ``fallback_parts`` parts of a chain fused (``_fallback_name``)."""
  fused: bool
  plan: Optional[str] = None
  reason: Optional[str] = None
  measured_fused_s: Optional[float] = None
  measured_xla_s: Optional[float] = None
  fallback_parts: int = 0

  def __str__(self) -> str:
    timed = ""
    if self.measured_fused_s is not None and self.measured_xla_s is not None:
      timed = (f" (measured {self.measured_fused_s * 1e6:.1f} us fused vs "
               f"{self.measured_xla_s * 1e6:.1f} us {_fallback_name(self.fallback_parts)})")
    return (f"fused{timed}: {self.plan}" if self.fused
            else f"XLA's ops{timed}: {self.reason}")


# (region signature, backend) -> Outcome of fused_call's own planning.
_outcomes: dict[tuple[str, str], Outcome] = {}


def outcome(region: ir.Region, backend: Optional[str] = None) -> Optional[Outcome]:
  """How this process lowered ``region`` through ``fused_call`` (backend
  'triton' or 'interpret'; None: whichever did, the GPU's first), or None
  when it has not. ``jaxfuse.inspect`` reports it after a compile."""
  sig = region.signature()
  with _lock:
    for b in ((backend,) if backend else ("triton", "interpret")):
      if (sig, b) in _outcomes:
        return _outcomes[(sig, b)]
  return None


# ------------------------------------------------------------------ CPU path
def _to_torch(a: np.ndarray):
  import torch  # pylint: disable=g-import-not-at-top
  a = np.ascontiguousarray(a)
  if a.dtype.name == "bfloat16":
    return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
  return torch.from_numpy(a.copy())


def _from_torch(t, dtype: str) -> np.ndarray:
  import torch  # pylint: disable=g-import-not-at-top
  if dtype == "bfloat16":
    return t.view(torch.uint16).numpy().view(ir.np_dtype("bfloat16")) if hasattr(torch, "uint16") \
        else t.view(torch.int16).numpy().view(ir.np_dtype("bfloat16"))
  return t.numpy()


def _torch_dtype(name: str):
  import torch  # pylint: disable=g-import-not-at-top
  return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "bool": torch.bool}[name]


_bf16_patched = False


def _patch_interpreter_bf16_dot() -> None:
  """Triton's interpreter multiplies bfloat16 dot operands as raw uint16 bits
  (seen in 3.9); widen them to float32 first. GPU compilation is unaffected."""
  global _bf16_patched
  if _bf16_patched:
    return
  _bf16_patched = True
  try:
    from triton.runtime import interpreter as interp  # pylint: disable=g-import-not-at-top
    import triton.language as tl  # pylint: disable=g-import-not-at-top
    builder_cls = type(interp.interpreter_builder)
    orig = builder_cls.create_dot
  except Exception:  # pylint: disable=broad-except
    return

  def widen(h):
    if h.dtype.scalar == tl.bfloat16 or getattr(h.dtype, "name", "") == "bf16":
      bits = h.data.astype(np.uint32) << 16
      return interp.TensorHandle(bits.view(np.float32), tl.float32)
    return h

  def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return orig(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

  builder_cls.create_dot = create_dot


def run_interpreted(kernel: GeneratedKernel, arrays: Sequence[np.ndarray],
                    offsets: Optional[Sequence[int]] = None) -> list[np.ndarray]:
  """Runs ``kernel`` in Triton's interpreter on NumPy inputs; returns outputs.

  Float outputs start as NaN, so elements the kernel does not write show up.
  ``offsets``: the window inputs' launch offsets (``Region.launch_offsets``)
  of the region being run; default: those of ``kernel.region``. A kernel is
  shared by regions that differ only in them.

  Example::

      k = generate(region, plan, interpret=True)
      (e,) = run_interpreted(k, [a, b, d])
  """
  import torch  # pylint: disable=g-import-not-at-top
  if not kernel.interpret:
    raise ValueError("kernel was not generated for the interpreter (interpret=False)")
  r = kernel.region
  in_bufs, out_bufs = ir.operand_buffers(r.inputs), ir.operand_buffers(r.outputs)
  if len(arrays) != len(in_bufs):
    raise ValueError(f"region takes {len(in_bufs)} inputs, got {len(arrays)}")
  offs = _launch_offsets(kernel, offsets)
  vm = r.value_map
  ins = []
  for b, a in zip(in_bufs, arrays):
    a = np.asarray(a)
    want = ir.np_dtype(vm[b.value].dtype)
    if tuple(a.shape) != b.operand_shape:
      raise ValueError(f"input {b.value}: shape {a.shape} != {b.operand_shape}")
    ins.append(_to_torch(a.astype(want, copy=False)))
  outs = []
  for b in out_bufs:
    dt = vm[b.value].dtype
    fill = float("nan") if dt in ir.FLOAT_DTYPES else 0
    outs.append(torch.full(b.operand_shape, fill, dtype=_torch_dtype(dt)))
  values: dict = {("in", i): t for i, t in enumerate(ins)}
  values.update({("off", i): o for i, o in enumerate(offs)})
  values.update({("out", j): o for j, o in enumerate(outs)})
  values.update({name: torch.full(s.shape, float("nan"), dtype=torch.float32)
                 for name, s in _launch_buffers(kernel).items() if name[0] == "tmp"})
  _patch_interpreter_bf16_dot()
  # One launch at a time: the interpreter patches triton.language's
  # functions for the length of a launch, and a sharded program calls this
  # from one XLA thread per device (concurrent launches failed mid-kernel).
  with _interpreter_lock, interpret_env(True):
    for fn, grid, constexprs, operands, results in _launch_steps(kernel):
      fn[grid](*[values[n] for n in (*operands, *results)], **constexprs)
  return [_from_torch(o, vm[b.value].dtype) for o, b in zip(outs, out_bufs)]


# ------------------------------------------------------------ self-check
# float16: DESIGN.md (measuring section) asks < 2e-3 relative error against a float32
# reference; bfloat16 has 3 fewer mantissa bits (8x coarser); float32 in IEEE.
_TOL = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-9}
# Dots on float32 operands by ir.PRECISIONS: TF32 rounds them to float16's
# 10 mantissa bits; three TF32 passes recover about 21.
_DOT_TOL = {"default": 2e-3, "tf32x3": 1e-4, "ieee": 0.0}


def tolerance(region: ir.Region) -> float:
  """Relative tolerance (``compare``'s error) for a region's kernel against
  the IR evaluated with each value rounded to its IR dtype (``self_check``):
  loose enough for rounding differences of float16 / bfloat16 intermediates
  and of float32 dot operands to TF32, tight enough to catch a wrong
  kernel. Every value's dtype counts, not just the inputs' and outputs':
  the kernel keeps float intermediates in float32 where the IR rounds them
  (a bfloat16 ``w.astype`` inside a float32 program is a bfloat16 value's
  rounding, and Triton's interpreter truncates where the GPU rounds)."""
  vm = region.value_map
  dts = [v.dtype for v in vm.values()]
  tol = max((_TOL.get(d, 0.0) for d in dts), default=1e-4)
  for op in region.contractions:
    if "float32" in (vm[op.lhs].dtype, vm[op.rhs].dtype):
      tol = max(tol, _DOT_TOL[op.precision])
  # exp(x) of a 16-bit x: the IR rounds x to an absolute error of |x| ulps,
  # which exp turns into that relative error, while the kernel keeps x in
  # float32. Unscaled float16 scores over an 80-wide head (std ~9) read
  # 3.2e-3 against the IR, 2.1e-3 for jax.jit against float32, and the
  # correct kernel fell back (sixty-third session's fuzzing).
  # One standard deviation of the argument (``_typical_stds``, at the
  # inputs' scale ``random_inputs`` uses) times the unit roundoff.
  stds = None
  for op in region.ops:
    if isinstance(op, ir.Elementwise) and op.fn in ("exp", "exp2") and isinstance(op.args[0], str):
      u = _UNIT_ROUNDOFF.get(vm[op.args[0]].dtype)
      if u:
        stds = stds if stds is not None else _typical_stds(region, input_scale(region))
        tol = max(tol, u * stds.get(op.args[0], 1.0))
  return tol


# Unit roundoff of the 16-bit float types.
_UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


# Values per random stream of ``random_inputs``.
_RANDOM_CHUNK = 1 << 20


# The largest typical magnitude (one standard deviation) a half-precision
# value of the region may reach under ``random_inputs``: 6 sigma stays
# below float16's largest finite value, 65504.
_HALF_STD_LIMIT = 4096.0
# Elementwise functions whose result stays O(1) whatever their input.
_BOUNDED_FNS = frozenset({"exp", "exp2", "logistic", "tanh", "erf", "sin", "cos",
                          "sign", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"})


def _typical_std(region: ir.Region, input_std: float) -> float:
  """The largest standard deviation a float16/bfloat16 value of ``region``
  reaches, estimated op by op when every float input has ``input_std``
  (a contraction multiplies its operands' by sqrt(reduced extent), a
  product multiplies, a sum reduction by sqrt(extent))."""
  vm, stds = region.value_map, _typical_stds(region, input_std)
  return max((stds[op.out] for op in region.ops
              if vm[op.out].dtype in ("float16", "bfloat16")), default=0.0)


def _typical_stds(region: ir.Region, input_std: float) -> dict[str, float]:
  """``_typical_std``'s estimate for every value of ``region``, by name."""
  vm, ext = region.value_map, region.loop_extents
  std = {b.value: (input_std if vm[b.value].dtype in ir.FLOAT_DTYPES else 1.0)
         for b in region.inputs}
  for op in region.ops:
    if isinstance(op, ir.Contraction):
      red = math.prod(ext[l] for l in op.reduce)
      v = std.get(op.lhs, 1.0) * std.get(op.rhs, 1.0) * math.sqrt(red)
    elif isinstance(op, ir.Reduction):
      v = std.get(op.inputs[0], 1.0) * (math.sqrt(ext[op.loop]) if op.kind == "sum" else 1.0)
    elif isinstance(op, ir.Elementwise):
      # A literal counts by its size; -inf (a mask) and 0 count as 1.
      args = [std.get(a, 1.0) if isinstance(a, str)
              else (abs(float(a.value)) if math.isfinite(float(a.value)) else 0.0) or 1.0
              for a in op.args]
      if op.fn in _BOUNDED_FNS:
        v = 1.0
      elif op.fn == "mul":
        v = math.prod(args)
      elif op.fn == "square":
        v = args[0] ** 2
      elif op.fn == "select":
        v = max(args[1:])
      elif op.fn == "div":
        v = args[0]
      else:
        v = max(args, default=1.0)
    else:
      v = 1.0
    std[op.out] = v
  return std


def input_scale(region: ir.Region) -> float:
  """The standard deviation of ``random_inputs``' floats: 1, or a power of
  two below it where unit inputs would take a half-precision value past
  float16's range (a gated MLP's product of two GEMMs summed again by the
  down projection: overflowed outputs would leave the check comparing
  infinities, not values)."""
  scale = 1.0
  while scale > 2.0 ** -8 and _typical_std(region, scale) > _HALF_STD_LIMIT:
    scale /= 2
  return scale


def _row_statistics(region: ir.Region) -> dict[str, float]:
  """Float inputs that stand for a row statistic, and the offset their
  random values get: a divisor (``div``'s right operand: a softmax's sum)
  is drawn from 1 + |N(0, 1)|, and a value subtracted before ``exp`` (its
  row max) from T + |N(0, 1)|, T one standard deviation over the typical
  row max of what it is subtracted from, at least 3. Why: a
  FlashAttention-style backward recomputes ``exp(s - m) / l`` from the
  forward's m and l; with unit normal m and l its probabilities reach 1e4
  and more, and its float16 gradients overflowed on every plan at 2048
  tokens (H100, seventy-seventh session), where the real ones are at most 1."""
  vm, ext = region.value_map, region.loop_extents
  ins = {b.value for b in region.inputs if vm[b.value].dtype in ir.FLOAT_DTYPES}
  exps = {a for op in region.ops if isinstance(op, ir.Elementwise) and op.fn == "exp"
          for a in op.inputs}
  out: dict[str, float] = {}
  stds = None
  for op in region.ops:
    if isinstance(op, ir.Elementwise) and len(op.args) == 2 and op.args[1] in ins:
      if op.fn == "div":
        out[op.args[1]] = 1.0
      elif op.fn == "sub" and op.out in exps:
        # One standard deviation over the typical largest value per row of
        # what it is subtracted from (std * sqrt(2 ln N) over the N values
        # each row stat stands for), so that few rows' exp(s - m) pass 1 by
        # much: with logits of std 4-8, an offset of 3 overflowed the
        # reference's float16 gradients.
        top, left = 3.0, op.args[0]
        if isinstance(left, str):
          stds = stds if stds is not None else _typical_stds(region, input_scale(region))
          n = math.prod(ext[l] for l in vm[left].loops if l not in vm[op.args[1]].loops)
          top = max(top, stds.get(left, 1.0) * (math.sqrt(2.0 * math.log(max(n, 2))) + 1.0))
        out[op.args[1]] = top
  return out


def random_inputs(region: ir.Region, seed: int = 0) -> list[np.ndarray]:
  """Fresh random inputs for a region (normal floats, booleans mostly True,
  small integers; floats scaled by ``input_scale``). An integer that bounds
  a loop from above (a sequence's length, ``streaming.length_inputs``) keeps
  every index: measured tuning times the whole work on these inputs. A
  float input that stands for a row statistic (``_row_statistics``) is
  drawn positive and away from zero. Inputs that receive one array
  (``ir.Region.same_array``) get the same ndarray.

  Each input is drawn in chunks of ``_RANDOM_CHUNK`` values, each chunk from
  its own child stream of ``seed``, in threads for large inputs: NumPy
  releases the GIL while it fills, and an attention's 100M input values
  took 3.3 s on one core against 0.8 s in threads on two (2026-11-22). The
  values depend on ``seed`` only, not on the number of threads."""
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  vm = region.value_map
  lengths = streaming.length_inputs(region)
  stats = _row_statistics(region)
  outs, jobs = [], []
  bufs = ir.operand_buffers(region.inputs)   # a part buffer: one array per part
  again = region.same_array()   # inputs that receive an earlier one's array
  drawn: dict[str, np.ndarray] = {}
  for b, stream in zip(bufs, np.random.SeedSequence(seed).spawn(len(bufs))):
    if b.value in again:
      outs.append(drawn[again[b.value]])
      continue
    dt = vm[b.value].dtype
    size = math.prod(b.operand_shape)
    flat = np.empty(size, dtype=ir.np_dtype(dt))
    n_chunks = max(1, -(-size // _RANDOM_CHUNK))
    outs.append(flat.reshape(b.operand_shape))
    drawn[b.value] = outs[-1]
    if b.value in lengths:
      flat[:] = lengths[b.value]
      continue
    jobs += [(flat, dt, i, child, stats.get(b.value))
             for i, child in enumerate(stream.spawn(n_chunks))]

  def fill(job) -> None:
    flat, dt, i, child, offset = job
    rng = np.random.default_rng(child)
    lo = i * _RANDOM_CHUNK
    n = min(flat.size, lo + _RANDOM_CHUNK) - lo
    if dt == "bool":
      flat[lo:lo + n] = rng.random(n, dtype=np.float32) > 0.2
    elif dt in ("int32", "int64"):
      flat[lo:lo + n] = rng.integers(-4, 5, size=n)
    else:
      # float32 draws: half the time and memory of float64 ones.
      x = rng.standard_normal(n, dtype=np.float32)
      flat[lo:lo + n] = x if offset is None else offset + np.abs(x)
  workers = min(len(jobs), os.cpu_count() or 1, 16)
  if workers > 1 and len(jobs) > len(bufs):
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
      list(ex.map(fill, jobs))
  else:
    for job in jobs:
      fill(job)
  scale = input_scale(region)
  if scale != 1.0:
    for o, b in zip(outs, bufs):
      if (vm[b.value].dtype in ir.FLOAT_DTYPES and b.value not in stats
          and b.value not in again):
        o *= np.asarray(scale, o.dtype)   # a power of two: exact
  return outs


def _one_entry(cache: dict, key) -> tuple[concurrent.futures.Future, bool]:
  """The future cached under ``key`` in a one-entry ``cache`` (its value can
  be large), or a new one that replaces the entry (also one that failed);
  ``mine`` says the caller must compute it."""
  with _lock:
    fut = cache.get(key)
    if fut is not None and not (fut.done() and fut.exception() is not None):
      return fut, False
    fut = concurrent.futures.Future()
    cache.clear()
    cache[key] = fut
    return fut, True


def _settle(fut: concurrent.futures.Future, compute: Callable[[], Any]) -> None:
  try:
    fut.set_result(compute())
  except BaseException as e:  # pylint: disable=broad-except  (re-raised by result())
    fut.set_exception(e)


# The random inputs of the last region checked or measured on the GPU, keyed
# by region signature and seed: the background reference, the measurer and
# the chosen kernel's self-check use the same arrays (a large attention's
# took seconds to make, twice, before; 2026-11-21).
_last_inputs: dict[tuple[str, int], concurrent.futures.Future] = {}


def _release_check_data(region: ir.Region) -> None:
  """Drops the region's shared inputs and reference once its kernel is
  chosen: for a large attention they hold hundreds of MB of host and
  device memory that nothing reads again."""
  sig = region.signature()
  with _lock:
    for cache in (_last_inputs, _last_reference, _last_exact_reference):
      for key in [k for k in cache if k[0] == sig]:
        del cache[key]


def shared_inputs(region: ir.Region, seed: int) -> list[np.ndarray]:
  """``random_inputs(region, seed)``, made once for the last region asked
  about (waits for a caller in another thread that is making them). Callers
  must not write to them."""
  fut, mine = _one_entry(_last_inputs, (region.signature(), seed))
  if mine:
    def make():
      xs = random_inputs(region, seed)
      for x in xs:
        x.flags.writeable = False
      return xs
    _settle(fut, make)
  return fut.result()


# How far one element may miss, relative to the reference's largest value,
# as a multiple of the tolerance that the normwise error must meet.
OUTLIER_SLACK = 8.0


def _worst_error(o, r, xp) -> float:
  """``compare``'s error of one output ``o`` against its reference ``r``:
  float arrays of the array module ``xp`` (NumPy or torch), same shape.

  The normwise relative error ||o - r|| / ||r|| (what the benchmarks check
  and report), or the largest elementwise error over the reference's largest
  magnitude divided by ``OUTLIER_SLACK``, whichever is larger. Why not the
  elementwise error alone: both sides round to float16 and the kernel's
  softmax rounds its weights against a running maximum, so among 33M outputs
  some elements differ by a few ulps of the largest value; every plan of a
  correct [8, 16, 2048, 128] attention read 2.15e-3 that way and was refused
  at 2e-3 (normwise: 3e-4; H100, 2026-11-22). A wrong tile, row or block
  still misses by far more: normwise for anything widespread, elementwise
  for a few elements."""
  nan = xp.isnan(r)
  if bool((xp.isnan(o) != nan).any()):
    return float("inf")
  fin = xp.isfinite(r)
  # An infinity on either side must be the same infinity on the other.
  if bool((~nan & (o != r) & (~fin | ~xp.isfinite(o))).any()):
    return float("inf")
  if not bool(fin.any()):
    return 0.0
  r = xp.where(fin, r, 0.0)
  d = xp.where(fin, o, 0.0) - r
  worst = float(abs(d).max())
  if worst == 0.0:
    return 0.0
  normwise = float((d * d).sum()) ** 0.5 / max(float((r * r).sum()) ** 0.5, 1e-6)
  return max(normwise, worst / max(float(abs(r).max()), 1e-6) / OUTLIER_SLACK)


def compare(region: ir.Region, outs: Sequence[np.ndarray], refs: Sequence[np.ndarray]) -> float:
  """Largest error over the outputs (``_worst_error``: normwise, elementwise
  outliers up to ``OUTLIER_SLACK`` times looser; inf when NaNs differ).
  Equal values (same-sign infinities included) count as exact; an infinity
  against anything else is an infinite error, and an infinity in the
  reference does not scale away the errors elsewhere."""
  worst = 0.0
  for o, r in zip(outs, refs):
    o = np.asarray(o).astype(np.float64)
    r = np.asarray(r).astype(np.float64)
    if o.shape != r.shape:
      return float("inf")
    worst = max(worst, _worst_error(o, r, np))
  return worst


def compare_tensors(outs: Sequence[Any], refs: Sequence[Any]) -> float:
  """``compare`` on torch tensors where they live (the GPU when measuring).

  Why: on NumPy the self-check of one large candidate (an [8, 16, 2048, 128]
  attention output) copied it to the host and made float64 copies of it and
  its reference, seconds per candidate on the H100 host, which put the large
  attention cases' tuning over the 5 s target (thirteenth session).
  """
  import torch  # pylint: disable=g-import-not-at-top
  worst = 0.0
  for o, r in zip(outs, refs):
    if tuple(o.shape) != tuple(r.shape):
      return float("inf")
    worst = max(worst, _worst_error(o.double(), r.double(), torch))
  return worst


def self_check(kernel: GeneratedKernel, runner: Callable[[GeneratedKernel, list], list],
               seed: Optional[int] = None) -> None:
  """Runs the kernel on random inputs against the IR evaluator (each value
  rounded to its IR dtype, as XLA computes it; ``reference.evaluate`` on
  the GPU); raises CodegenError. A kernel outside ``tolerance`` of that
  reference still passes when it is within tolerance of the exact result
  (the region in float64 on the CPU; in float32 without rounding on the
  GPU or past ``EXACT_RECHECK_MAX_FLOPS``), or no farther from it than the
  reference is (see the body). The default seed is measured tuning's, so
  that on the GPU the chosen kernel is checked against the reference
  tuning computed."""
  seed = MEASURE_SEED if seed is None else seed
  xs = shared_inputs(kernel.region, seed)
  if runner is _run_on_gpu:
    # The reference's XLA compile runs without the GIL while the kernel's
    # program compiles: one after another they were 0.5 + 0.5 s per region
    # of a cold first call (H100, session 32).
    start_reference(kernel.region, seed, xs)
  outs = runner(kernel, xs)
  if runner is _run_on_gpu:
    refs = _device_reference(kernel.region, seed, xs)
  else:
    # The same semantics as the device reference (reference.evaluate): each
    # value rounded to its IR dtype, as XLA's ops and the kernel round it.
    # Against float64, a correct float16 kernel whose output squashes its
    # rounding error (tanh) or overflows where XLA's does too (x**3) failed.
    refs = ir.evaluate(kernel.region, xs, precision="native")
  err = compare(kernel.region, outs, refs)
  tol = tolerance(kernel.region)
  if not err <= tol:
    # The kernel keeps intermediates in float32 where the reference rounds
    # them, so it can sit farther from the reference than the reference sits
    # from the exact result, and be right: bfloat16 one-query attention over
    # 200 keys with unscaled scores and a bias read 0.023 against the
    # reference, whose own error was 0.020 (sixty-fourth session's fuzzing).
    # Such a kernel passes when it is within tolerance of the exact result,
    # or no farther from it than the reference is (at most
    # CLOSER_THAN_REFERENCE_SLACK tolerances). A wrong kernel is far from both.
    # The exact result is float64 NumPy on the CPU up to
    # EXACT_RECHECK_MAX_FLOPS; on the GPU and past it, the region in float32
    # without rounding on the device, which takes seconds at most. Before,
    # such regions had no recheck: under peaked attention (logit std 4-8,
    # scores rounded to float16 move the softmax's largest weights) every
    # kernel of a training step sat 1.5-5x the tolerance from the reference
    # and fell back, each within 3.7e-4 of float64 (eighty-ninth session).
    exact_name = "float64"
    if runner is _run_on_gpu or kernel.region.flops() > EXACT_RECHECK_MAX_FLOPS:
      exact_name = "float32 unrounded"
      exact = _device_reference(kernel.region, seed, xs, rounded=False)
    else:
      exact = ir.evaluate(kernel.region, xs, precision="float64")
    err_exact = compare(kernel.region, outs, exact)
    ref_exact = compare(kernel.region, refs, exact)
    bound = _exact_bound(tol, ref_exact)
    if not err_exact <= bound:
      exact_part = f"{err_exact:.3g} > {bound:.3g} against {exact_name}"
      raise CodegenError(f"self-check failed: relative error {err:.3g} > {tol:g} against the "
                         f"reference, {exact_part}, for plan {kernel.plan}")
    logging.info("jaxfuse: self-check of %s: %.3g against the reference (over %g), %.3g against "
                 "%s (the reference's own: %.3g); passed", kernel.plan, err, tol, err_exact,
                 exact_name, ref_exact)


def _exact_bound(tol: float, ref_exact: float) -> float:
  """How far from the exact result a kernel outside ``tol`` of the rounded
  reference may sit and pass: ``tol``, or as far as the reference itself
  sits (``ref_exact``), up to ``CLOSER_THAN_REFERENCE_SLACK`` tolerances."""
  if not math.isfinite(ref_exact):
    return tol
  return max(tol, min(ref_exact, CLOSER_THAN_REFERENCE_SLACK * tol))


# How far beyond ``tolerance`` a kernel may sit from the exact result when
# the rounded reference sits at least as far (see ``self_check``).
CLOSER_THAN_REFERENCE_SLACK = 4.0
# The largest region (in FLOPs) the self-check re-evaluates in float64 on
# the CPU; larger ones, and all on the GPU, in float32 without rounding.
EXACT_RECHECK_MAX_FLOPS = 2e9


# ------------------------------------------------------------ GPU path
def _out_shapes(region: ir.Region):
  import jax  # pylint: disable=g-import-not-at-top
  vm = region.value_map
  return [jax.ShapeDtypeStruct(b.operand_shape, ir.np_dtype(vm[b.value].dtype))
          for b in ir.operand_buffers(region.outputs)]


def _launch_offsets(kernel: GeneratedKernel, offsets: Optional[Sequence[int]]) -> list[int]:
  """The window offsets to pass ``kernel`` (see ``run_interpreted``)."""
  want = len(kernel.region.launch_offsets())
  offs = kernel.region.launch_offsets() if offsets is None else tuple(offsets)
  if len(offs) != want:
    raise ValueError(f"offsets: the kernel takes {want} window offsets, got {len(offs)}")
  if any(int(o) % ir.WINDOW_ALIGN or o < 0 for o in offs):
    raise ValueError(f"offsets: {offs} are not non-negative multiples of {ir.WINDOW_ALIGN}")
  return [int(o) for o in offs]


def _launch_steps(kernel: GeneratedKernel) -> list[tuple]:
  """The kernel calls of one launch of ``kernel``, in order, as ``(fn, grid,
  constexprs, operands, results)``. Operands and results are named: ``('in',
  i)`` the region's inputs, ``('off', i)`` its window offsets (scalars),
  ``('tmp', j)`` a split plan's partials, ``('out', j)`` its outputs.
  ``triton_launch``, ``run_interpreted`` and the torch measurer run them,
  and the checking process binds its buffers by these names
  (``_sandbox_program``): one description of a launch, so that the four
  cannot bind a split plan's partials differently."""
  region = kernel.region
  ins = [("in", i) for i in range(len(ir.operand_buffers(region.inputs)))]
  ins += [("off", i) for i in range(len(region.launch_offsets()))]
  outs = [("out", j) for j in range(len(ir.operand_buffers(region.outputs)))]
  if kernel.combine_fn is None:
    return [(kernel.fn, kernel.grid, kernel.constexprs, ins, outs)]
  tmps = [("tmp", j) for j in range(len(kernel.scratch))]
  return [(kernel.fn, kernel.grid, kernel.constexprs, ins, tmps),
          (kernel.combine_fn, kernel.combine_grid, kernel.combine_constexprs, ins + tmps, outs)]


def _launch_buffers(kernel: GeneratedKernel) -> dict:
  """``ShapeDtypeStruct``s of the buffers ``_launch_steps`` makes: ``tmp``, ``out``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  specs = {("tmp", j): jax.ShapeDtypeStruct((max(s.numel, 1),), jnp.float32)
           for j, s in enumerate(kernel.scratch if kernel.combine_fn is not None else ())}
  specs.update({("out", j): s for j, s in enumerate(_out_shapes(kernel.region))})
  return specs


def triton_launch(kernel: GeneratedKernel, args: Sequence[Any],
                  offsets: Optional[Sequence[int]] = None) -> list[Any]:
  """``jax_triton.triton_call`` of a generated kernel (plus its combine pass).
  ``offsets``: as in ``run_interpreted``."""
  if kernel.plan.form:
    from jaxfuse.runtime import gluon_launch  # pylint: disable=g-import-not-at-top
    return gluon_launch.launch(kernel, args)
  values: dict = {("in", i): a for i, a in enumerate(args)}
  values.update({("off", i): o for i, o in enumerate(_launch_offsets(kernel, offsets))})
  specs = _launch_buffers(kernel)
  jt = triton_call.jax_triton_module()
  kw = dict(kernel.launch_options, custom_call_target_name=triton_call.call_target(
      jt, record=recorded_launch(kernel.region, kernel.plan)))
  for fn, grid, constexprs, operands, results in _launch_steps(kernel):
    res = jt.triton_call(*[values[o] for o in operands], kernel=fn,
                         out_shape=[specs[r] for r in results], grid=grid, **kw, **constexprs)
    values.update(zip(results, res if isinstance(res, (list, tuple)) else [res]))
  return [values[("out", j)] for j in range(len(ir.operand_buffers(kernel.region.outputs)))]


def _on_device(xs: Sequence[Any]) -> list[Any]:
  """``xs`` as concrete device arrays. Measuring runs while a region is
  being lowered, i.e. inside a trace: evaluate eagerly, not staged out."""
  import jax  # pylint: disable=g-import-not-at-top
  with jax.ensure_compile_time_eval():
    return [jax.device_put(x) for x in xs]


def _compile(fn: Callable, args: Sequence[Any], **compiler_options) -> Any:
  """``jax.jit(fn)`` lowered and compiled for ``args``, traced *outside*
  ``jax.ensure_compile_time_eval``: that context folds every op whose inputs
  are constants, so a causal mask's iotas and their broadcasts to the scores'
  shape became constants of the program (12.9 GB for L-T2048-d64-causal; the
  H100 ran out of memory, 2026-11-22). Run the result inside the context."""
  import jax  # pylint: disable=g-import-not-at-top
  lowered = jax.jit(fn).lower(*args)
  if compiler_options:
    try:
      return lowered.compile(compiler_options=compiler_options)
    except Exception:  # pylint: disable=broad-except  (an option unknown to this XLA)
      pass
  return lowered.compile()


def _run_on_gpu(kernel: GeneratedKernel, xs: list) -> list[np.ndarray]:
  """The kernel's outputs on ``xs`` (NumPy arrays), run in the checking
  process (``kernel_sandbox``) where ``config.check_isolate`` asks for it
  and it can, else in this one. Raises ``kernel_sandbox.KernelFault`` when
  the kernel fails there."""
  import jax  # pylint: disable=g-import-not-at-top
  if _check_isolated():
    outs = _run_in_sandbox(kernel, xs)
    if outs is not None:
      return outs
  args = _on_device(xs)
  fn = _compile(lambda *a: triton_launch(kernel, a), args)
  with jax.ensure_compile_time_eval():
    outs = jax.block_until_ready(fn(*args))
  return [np.asarray(o) for o in outs]


def _check_isolated() -> bool:
  """Whether a kernel's self-check runs in the checking process: asked for,
  and not already in measured tuning's child (itself isolated)."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  return config.check_isolate and not _IN_MEASURE_WORKER


def _device_ordinal() -> int:
  """The CUDA ordinal of the device this process's checks run on."""
  import jax  # pylint: disable=g-import-not-at-top
  return int(getattr(jax.local_devices()[0], "local_hardware_id", 0) or 0)


def _sandbox_program(kernel: GeneratedKernel, xs: Sequence[np.ndarray]):
  """The ``kernel_sandbox.Program`` of one launch of ``kernel`` on arrays
  like ``xs``: the kernel is compiled as the user's program will run it
  (lowering its call; the compiled call is kept for that program), its
  buffers named by ``_launch_steps``. None where a call's attributes cannot
  be read (a launch the checking process does not take)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import kernel_sandbox  # pylint: disable=g-import-not-at-top
  structs = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in xs]
  if kernel.plan.form:
    # One launch of attributes made without jax-triton: the region's
    # inputs, its outputs, then the kernel's global scratch.
    from jaxfuse.runtime import gluon_launch  # pylint: disable=g-import-not-at-top
    attrs = gluon_launch.attributes(kernel)
    outs = _out_shapes(kernel.region)
    buffers = [(tuple(s.shape), np.dtype(s.dtype)) for s in (*structs, *outs)]
    buffers.append(((gluon_launch.scratch_bytes(kernel, attrs),), np.dtype(np.uint8)))
    n_in = len(structs)
    return kernel_sandbox.Program(
        buffers=buffers, steps=[(attrs, list(range(len(buffers))))],
        inputs=list(range(n_in)), outputs=list(range(n_in, n_in + len(outs))))
  with triton_call.collect_calls() as calls:
    jax.jit(lambda *a: triton_launch(kernel, a), keep_unused=True).lower(*structs)
  steps = _launch_steps(kernel)
  if len(calls) != len(steps) or any(c is None for c in calls):
    return None
  ids: dict = {}
  buffers: list = []
  named = [(("in", i), s) for i, s in enumerate(structs)] + list(_launch_buffers(kernel).items())
  for name, s in named:
    ids[name] = len(buffers)
    buffers.append((tuple(s.shape), np.dtype(s.dtype)))
  bound = [(attrs, [ids[b] for b in (*operands, *results) if b[0] != "off"])
           for attrs, (_, _, _, operands, results) in zip(calls, steps)]
  return kernel_sandbox.Program(
      buffers=buffers, steps=bound, inputs=[ids[("in", i)] for i in range(len(xs))],
      outputs=[ids[("out", j)] for j in range(len(ir.operand_buffers(kernel.region.outputs)))])


def _run_in_sandbox(kernel: GeneratedKernel, xs: Sequence[np.ndarray]) -> Optional[list]:
  """The kernel's outputs from the checking process, or None where it
  cannot run them (then this process runs the kernel)."""
  from jaxfuse.runtime import kernel_sandbox  # pylint: disable=g-import-not-at-top
  device = _device_ordinal()
  kernel_sandbox.prestart(device)   # its start overlaps the kernel's compile below
  program = _sandbox_program(kernel, xs)
  if program is None:
    logging.info("jaxfuse: plan %s self-checked in this process: its launch cannot be read "
                 "for the checking process", kernel.plan)
    return None
  return kernel_sandbox.run(program, [np.asarray(x) for x in xs], device=device)


# ------------------------------------------------------------ selection
def _reference_on_gpu(region: ir.Region, xs: list, *, rounded: bool = True) -> list[Any]:
  """The IR in float32 on the device (jaxfuse.runtime.reference): at full
  size, NumPy's float64 evaluator would take seconds per candidate. Returns
  the outputs as device arrays: the measurer compares on the device, and
  a large attention's output took a host round trip per region before."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import reference  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  args = _on_device(xs)
  t1 = time.perf_counter()
  # GEMM autotuning took most of the 2-8 s this compile cost per region on
  # an H200 (2026-11-21); the reference needs no fast GEMMs.
  compiled = _compile(lambda *a: reference.evaluate(region, a, rounded=rounded), args,
                      xla_gpu_autotune_level=0)
  t2 = time.perf_counter()
  with jax.ensure_compile_time_eval():
    outs = jax.block_until_ready(compiled(*args))
  logging.info("jaxfuse: reference computed in %.2f s (inputs %.2f, lowering and compile %.2f, "
               "run %.2f)", time.perf_counter() - t0, t1 - t0, t2 - t1, time.perf_counter() - t2)
  return list(outs)


def ranked_plans(region: ir.Region, *, measured: bool = False) -> list:
  """The planner's plans for ``region``, best first (``measured``: with
  measured tuning); raises LeftToXLA where no plan fits on chip."""
  return _planned(region, measured)[0]


def _planned(region: ir.Region, measured: bool) -> tuple[list, Any]:
  """``ranked_plans`` and the planner's result they came from."""
  try:
    from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CodegenError(f"no planner available: {e}") from e
  res = plan_region(region, measure=make_measure(region) if measured else None)
  if not measured:
    with _lock:
      _alternatives[region.signature()] = tuple(getattr(res, "alternatives", ()) or ())
  ranked = list(getattr(res, "ranked", ()) or ())
  if not ranked and getattr(res, "best", None) is not None:
    ranked = [res.best]
  if not ranked:
    # Nothing fits on chip at any tile size: a decision, as the README's
    # Fallback says, not a fault (one INFO line; its parts are tried).
    raise LeftToXLA(f"planner found no plan: {getattr(res, 'why_not', None)}")
  return ranked, res


def _candidate_plans(region: ir.Region, plan, *, backend: str = "interpret",
                     timing: bool = True, measured: Optional[bool] = None) -> list:
  """The plans to try for ``region``, best first; raises LeftToXLA where it
  runs XLA's ops. ``timing``: whether a keep-or-drop timing follows (the
  caller has the original ops); without one, the model's verdict stands
  even where ``keep_or_drop_timed`` would time the region. ``measured``:
  measured tuning or not (None: as ``config.tune`` says)."""
  if plan is not None:
    return list(plan) if isinstance(plan, (list, tuple)) else [plan]
  try:
    from jaxfuse.devices import get_device, is_mbci  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise CodegenError(f"no planner available: {e}") from e
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  if measured is None:
    measured = backend == "triton" and config.tune == "measure"
  ranked, res = _planned(region, measured)
  if backend != "triton" or not config.kernel_forms:
    # Other kernel forms (Plan.form) run on the GPU only, and only where
    # config.kernel_forms lets them.
    ranked = [p for p in ranked if not p.form] or ranked
  if backend == "triton":
    # MCFuser fuses chains that are memory-bound (intensity below the ridge
    # point); a compute-bound chain is left to XLA's library GEMMs. Under
    # tune='model' a plan the model predicts to lose to the separate
    # kernels is left to XLA too; under tune='measure', and under
    # tune='auto' where the model's verdict is uncertain, measurement
    # decides (_keep_fused). The interpreter path is for testing kernels,
    # so it always runs them.
    dev = get_device(res.device or None)
    mbci, ai, ridge = is_mbci(region, dev)
    # A single contraction is fused for its epilogue (capture takes one only
    # when XLA would run part of it apart), not because it is memory-bound:
    # the model or the measurement decides it alone.
    if not mbci and len(region.contractions) > 1:
      raise LeftToXLA(f"not memory-bound: intensity {ai:.0f} FLOP/B >= ridge "
                      f"{ridge:.0f}; left to XLA")
    from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
    if not measured:
      # Before any timing: timed alone, its ops write the same arrays.
      why = cost_model.writes_its_intermediates(region)
      if why:
        raise LeftToXLA(f"{why}; left to XLA")
    if not measured and not (timing and keep_or_drop_timed(region, ranked)):
      why = cost_model.slower_than_unfused(region, ranked[0], dev)
      if why:
        raise LeftToXLA(f"{why}; left to XLA")
  return ranked


def keep_or_drop_timed(region: ir.Region, plans: Sequence[Any]) -> bool:
  """Whether the region's kernel is timed on the GPU against what would run
  instead (``_keep_fused``) rather than kept or dropped on the model's word: always
  under ``tune='measure'``; under ``tune='auto'`` where the model's verdict
  on its best plan is uncertain (``cost_model.verdict_uncertain``, told of
  the model's best unsplit plan, ``search.unsplit_rival``); never under
  ``tune='model'``."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  if config.tune == "measure":
    return True
  if config.tune != "auto" or not plans:
    return False
  from jaxfuse.devices import get_device  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import search  # pylint: disable=g-import-not-at-top
  best = _best_predicted(plans) or plans[0]
  with _lock:
    alternatives = _alternatives.get(region.signature(), ())
  return cost_model.verdict_uncertain(
      region, best, get_device(None),
      rival=search.unsplit_rival(region, best, alternatives)) is not None


# region signature -> ((fused s, spread), (fallback s, spread), parts fused in
# the fallback) per call.
_xla_decisions: dict[str, tuple[tuple[float, float], tuple[float, float], int]] = {}
# region signature -> the model's best plan of each other structure, from
# the model-only planning that gave its candidates (PlanningResult.alternatives).
_alternatives: dict[str, tuple] = {}
# region signature -> the kernel a keep-or-drop timing kept where a rival
# plan was timed beside the model's pick (_keep_fused).
_kept: dict[str, GeneratedKernel] = {}


def rival_plan(region: ir.Region, chosen) -> Any:
  """The plan timed beside ``chosen`` (the model's pick) where
  ``tune='auto'`` times ``region`` against XLA's ops anyway, or None.

  Where the pick splits a streamed (online-softmax) loop across programs,
  the rival is the model's best plan that does not split it
  (``search.unsplit_rival`` over ``PlanningResult.alternatives``, predicted
  within ``search.DIVERSE_MAX_RATIO`` of the pick). Why: that choice is
  what the model is least sure of (``cost_model.verdict_uncertain``). At batch 8 of
  a Llama-3-8B decoding step the model's pick (8-way split) ran 55.5 us
  and its best unsplit plan, predicted 1.08x slower, 46.5 us (H100,
  sixty-eighth session: model-only regret 17.6%); MCFuser S7-S9's
  split picks lost to unsplit plans too (ninth and thirty-sixth sessions).
  Where no unsplit plan is in reach, the rival is the model's best plan of
  another structure predicted within ``search.TIED_RIVAL_RATIO`` of the
  pick (``search.tied_rival``): a tie the model cannot break (a
  one-sequence step's 16-way and 8-way split plans, both predicted at 36.7
  us, ran 35.6 and 29.6 us; seventieth session).
  Measured tuning (``tune='measure'``) measures every structure's leader
  already, and ``tune='model'`` times nothing.

  Example::

      with config.override(tune="auto"):
        rival_plan(region, kernel.plan)   # a Plan, or None
  """
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  if config.tune != "auto":
    return None
  from jaxfuse.planner import search  # pylint: disable=g-import-not-at-top
  with _lock:
    alternatives = _alternatives.get(region.signature(), ())
  return (search.unsplit_rival(region, chosen, alternatives)
          or search.tied_rival(region, chosen, alternatives))


def _rival_kernel(region: ir.Region, chosen: GeneratedKernel,
                  check: bool) -> Optional[GeneratedKernel]:
  """The kernel of ``rival_plan(region, chosen.plan)``, self-checked as the
  pick was; None where there is no rival or its kernel fails (logged)."""
  p = rival_plan(region, chosen.plan)
  if p is None:
    return None
  try:
    return select_kernel(region, [p], backend="triton", check=check)
  except CodegenError as e:
    logging.info("jaxfuse: rival plan %s not timed: %s", p, str(e)[:300])
    return None


def _fallback_name(parts: int) -> str:
  """What a region's keep-or-drop timing ran against: XLA's plain ops, or
  (``parts`` > 0) XLA's ops with that many parts of the chain fused
  (``primitive._fallback``)."""
  return "XLA" if not parts else f"XLA with {parts} part{'s' if parts > 1 else ''} fused"


class TimingCompileError(CodegenError):
  """Implementation ``index`` of a timing's ``fns`` (``_per_call_times``)
  did not lower or compile."""

  def __init__(self, index: int, error: BaseException):
    super().__init__(f"implementation {index} does not compile: "
                     f"{type(error).__name__}: {str(error)[:300]}")
    self.index = index


def _per_call_times(fns: Sequence[Callable], region: ir.Region, lo: int = 4, hi: int = 16,
                    reps: int = 7) -> list[tuple[float, float]]:
  """Seconds per call on the device of each of ``fns`` (implementations of
  ``region``) and the spread of its repetitions, all timed alike on the same
  distinct random inputs, the calls' outputs consumed on the device
  (``timing.consume_outputs``).

  On a GPU with jax-triton: the slope of device spans between GPU clock
  stamps (``device_clock``). Elsewhere, or when a stamp fails: the host
  slope method (``timing.slope``), which on the H100 host measured host
  work for calls of a few us (spreads 0.7-8, twentieth session).

  ``lo``, ``hi``: calls per timed program. Two programs per function are
  compiled for each decision, in parallel (XLA's compile leaves the GIL):
  one after another they were most of a decision's 3-7 s (H100, session
  21). On the clock, spans of 4 and 16 calls agreed within 3% between
  repetitions."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  # Distinct inputs per call from one base set, made on the device: NumPy
  # normals for 16 sets of large attention took seconds on the host.
  sets = _shifted_sets(_on_device(random_inputs(region, seed=7)), hi)
  t_inputs = time.perf_counter() - t0

  def timed(body: Callable[[Callable, int], Callable], measure: Callable, how: str):
    t1 = time.perf_counter()
    # Traced outside jax.ensure_compile_time_eval (see _compile).
    lowered = {}
    for i, fn in enumerate(fns):
      for n in (lo, hi):
        try:
          lowered[(i, n)] = jax.jit(body(fn, n)).lower(sets)
        except Exception as e:  # pylint: disable=broad-except
          raise TimingCompileError(i, e) from e
    t2 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
      futures = {key: pool.submit(l.compile) for key, l in lowered.items()}
      progs = {}
      for (i, n), f in futures.items():
        try:
          progs[(i, n)] = f.result()
        except Exception as e:  # pylint: disable=broad-except
          raise TimingCompileError(i, e) from e
    t3 = time.perf_counter()
    with jax.ensure_compile_time_eval():
      res = [measure(lambda n, i=i: progs[(i, n)](sets)) for i in range(len(fns))]
    # Where a decision's seconds go (the first compile of jaxfuse.jit pays them).
    logging.info("jaxfuse: timed %s us per call (%s) in %.2f s: inputs %.2f, lowering %.2f, "
                 "compile %.2f, run %.2f", ", ".join(f"{r['per_call_s'] * 1e6:.2f}" for r in res),
                 how, time.perf_counter() - t0, t_inputs, t2 - t1, t3 - t2,
                 time.perf_counter() - t3)
    return [(r["per_call_s"], r["per_call_spread"]) for r in res]

  if device_clock.available():
    try:
      return timed(lambda fn, n: lambda s: device_clock.stamped(
          lambda a: [fn(*x) for x in a[:n]], s),
                   lambda run: device_clock.span_slope(run, lo=lo, hi=hi, reps=reps),
                   "device clock")
    except TimingCompileError as e:
      if e.index > 0:
        raise   # the first implementation compiled with its stamps: this one fails itself
      logging.info("jaxfuse: device clock failed (%s); timing from the host", e)
    except Exception as e:  # pylint: disable=broad-except  (a stamp that does not build or run)
      logging.info("jaxfuse: device clock failed (%s: %s); timing from the host",
                   type(e).__name__, str(e)[:300])
  # The median slope: the minimum of 7 slopes read 0.0-1.0 us for XLA
  # chains whose per-call time is 5-6 us (H200, 2026-11-21) and dropped
  # fused kernels twice as fast. The spread says whether to believe it.
  return timed(lambda fn, n: lambda s: timing.consume_outputs([fn(*a) for a in s[:n]]),
               lambda run: timing.slope(run, jax.block_until_ready, lo=lo, hi=hi, reps=reps),
               "host slope")


# Keep-or-drop believes a per-call time only when its repetitions agree
# within this fraction of their median. Inside a lowering, slopes of 2-10 us
# calls read -4 to 15 us and XLA's 2-kernel chains 0.7-1.1 us per call
# against 9 us of kernels (H200, fifth session): no evidence either way.
MAX_TIMING_SPREAD = 0.5
# Per-call times within this fraction of each other are a tie.
TIMING_TIE = 0.05


def _shifted_sets(xs: Sequence[Any], n: int) -> list[list[Any]]:
  """``n`` distinct copies of the device arrays ``xs``: set ``i`` rolls each
  array by ``i`` along its last axis (same values, other addresses and
  order). One compiled program makes them all: eager rolls compiled one
  program per shift and input, 1-3 s per keep-or-drop decision (H100,
  session 21)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def copies(xs):
    return [[jnp.roll(x, i, axis=-1) if x.ndim else x + 0 for x in xs] for i in range(n)]
  prog = _compile(copies, [list(xs)])
  with jax.ensure_compile_time_eval():
    return [list(s) for s in prog(list(xs))]


def _keep_fused(k: GeneratedKernel, original: Callable, model_plan=None,
                parts: int = 0, rival: Optional[GeneratedKernel] = None) -> GeneratedKernel:
  """Measured refinement's last step: the chosen kernel against what would
  run instead (``original``: XLA's own ops, or with ``parts`` > 0 a chain's
  parts, that many of them fused: ``primitive._fallback``), timed the same
  way; returns the kernel kept, raises CodegenError when the fallback is
  faster. Why the parts: a chain kept because it beat XLA's plain ops may
  still lose to its own GEMM + GELU part fused, which is what a dropped
  chain runs.

  ``rival``: another plan's kernel (``rival_plan``), timed in the same run;
  it replaces ``k`` when it ran faster by more than ``TIMING_TIE`` with
  both timings' repetitions agreeing, and is then what the fallback is
  judged against.

  ``model_plan``: the plan whose prediction stands for the region when the
  timing cannot decide (default ``k.plan``). Measured tuning times the
  model's best plans too and keeps a plan only when it ran faster, so the
  model's best prediction bounds its time: MCFuser G5's tuned plan was predicted at
  9.3 us against 8.2 us for the model's pick, and measured faster (H100,
  twentieth session)."""
  sig = k.region.signature()
  # Logged when measured only: a region lowered again (each call of an
  # unrolled program, each retrace) reuses the decision; a call-9 float32 run
  # logged one region's timings 40 times (H100, 2026-11-22).
  first = sig not in _xla_decisions
  if first:
    key = _timing_key(k, parts)
    stored = _load_timing(key)
    rival_key = None if rival is None else _timing_key(rival, parts)
    stored_rival = None if rival is None else _load_timing(rival_key)
    if stored is None or (rival is not None and stored_rival is None):
      kernels = [k] if rival is None else [k, rival]
      try:
        times = _per_call_times([(lambda *a, g=g: triton_launch(g, a)) for g in kernels]
                                + [original], k.region)
      except TimingCompileError as e:
        if e.index == len(kernels):
          # What would run instead does not compile (jax.nn.dot_product_attention's
          # F16_F16_F32 dot in a one-row multi-head step, jax 0.11.2 on the H100):
          # the kernel, which passed its self-check, is all that runs.
          logging.warning("jaxfuse: region %s: %s does not compile, the fused kernel is "
                          "kept untimed (%s)", k.region.einsum_summary(),
                          _fallback_name(parts), e)
          return k
        if e.index == 1:
          logging.info("jaxfuse: rival plan %s not timed: %s", rival.plan, e)
          return _keep_fused(k, original, model_plan=model_plan, parts=parts)
        raise
      fused, xla = times[0], times[-1]
      _store_timing(key, fused, xla)
      if rival is not None:
        stored_rival = (times[1], xla)
        _store_timing(rival_key, *stored_rival)
      how = "measured"
    else:
      fused, xla = stored
      how = "timed in an earlier process (plan cache)"
    if rival is not None:
      k, fused = _faster_of(k, fused, rival, stored_rival[0], how)
      _kept[sig] = k
    _xla_decisions[sig] = (fused, xla, parts)
  k = _kept.get(sig, k)
  (t_fused, s_fused), (t_xla, s_xla), timed_parts = _xla_decisions[sig]
  other = _fallback_name(timed_parts)
  if first:
    # The plan too: a part's kernel is timed with no other record of which
    # plan ran (LLaMA-2-7B's 61 us down projection, sixty-second session).
    logging.info("jaxfuse: region %s %s fused %.1f us (spread %.2f), %s %.1f us "
                 "(spread %.2f); plan %s", k.region.einsum_summary(), how, t_fused * 1e6,
                 s_fused, other, t_xla * 1e6, s_xla, k.plan)
  noise = min(t_fused, t_xla) <= 0 or max(s_fused, s_xla) > MAX_TIMING_SPREAD
  if not noise and t_fused > (1 + TIMING_TIE) * t_xla:
    raise LeftToXLA(f"measured slower than {other}: fused {t_fused * 1e6:.1f} us vs "
                    f"{t_xla * 1e6:.1f} us")
  if noise or t_fused > (1 - TIMING_TIE) * t_xla:
    # Noise or a tie, not a verdict: the cost model decides, as under
    # tune='model'. A tie went to the fused kernel until BERT-Small's FFN
    # (24.4 us fused vs 23.2 us) stayed fused; its device span was 0.73x
    # XLA's (H100, twentieth session), as the model's 1.4x ratio says.
    from jaxfuse.devices import get_device  # pylint: disable=g-import-not-at-top
    from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
    why = cost_model.slower_than_unfused(k.region, model_plan or k.plan, get_device(None))
    if first:
      logging.info("jaxfuse: keep-or-drop timing %s; the model says %s",
                   "inconclusive" if noise else "a tie", why or "fused")
    if why:
      raise LeftToXLA(f"{why}; left to XLA (measurement "
                      f"{'inconclusive' if noise else 'a tie'})")
  return k


def _faster_of(k: GeneratedKernel, t_k: tuple[float, float], rival: GeneratedKernel,
               t_rival: tuple[float, float], how: str
               ) -> tuple[GeneratedKernel, tuple[float, float]]:
  """``(kernel, its (time, spread))``: ``rival`` where it ran faster than
  ``k`` by more than ``TIMING_TIE``, both timings' repetitions agreeing;
  else ``k`` (the model's pick keeps a tie or noise)."""
  (a, sa), (b, sb) = t_k, t_rival
  won = (min(a, b) > 0 and max(sa, sb) <= MAX_TIMING_SPREAD and b < (1 - TIMING_TIE) * a)
  logging.info("jaxfuse: region %s %s the model's pick %.1f us (spread %.2f) and its rival "
               "%.1f us (spread %.2f, plan %s); kept the %s", k.region.einsum_summary(), how,
               a * 1e6, sa, b * 1e6, sb, rival.plan, "rival" if won else "pick")
  return (rival, t_rival) if won else (k, t_k)


# The caller's GPU, as the measuring child process (whose jax has no GPU)
# is told it: its passed self-checks are keyed by it.
_gpu_name_override: Optional[str] = None


def _gpu_name() -> Optional[str]:
  """The GPU keep-or-drop timings ran on (jax's first device), or None
  without one."""
  return _gpu_name_override or triton_call.gpu_name()


def _gpu_key(k: GeneratedKernel, *parts: str) -> Optional[str]:
  """A plan cache key for what was found out about kernel ``k`` on this GPU,
  or None where nothing is kept (no GPU). It hashes what such a finding
  depends on: the region, the kernel's plan, the GPU, how the kernel is
  launched, the versions of jaxfuse (the cache's own check), jax, jaxlib
  (XLA's side), Triton and jax-triton, and ``parts``."""
  gpu = _gpu_name()
  if gpu is None:
    return None
  import hashlib  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  text = "|".join([k.region.signature(), str(k.plan), gpu, str(config.launch),
                   triton_call.versions(), *parts])
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def _timing_key(k: GeneratedKernel, parts: int = 0) -> Optional[str]:
  """The key of ``k``'s keep-or-drop timing against a fallback with
  ``parts`` parts fused (their plans follow ``config.tune``). Why keep it:
  the measured plan is cached on disk, but each new process timed the
  decision again, 2-3 s per region (H100, twenty-first session)."""
  if not parts:
    return _gpu_key(k)
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  return _gpu_key(k, f"fallback with {parts} part(s) fused", f"tune={config.tune}")


def _check_key(k: GeneratedKernel) -> Optional[str]:
  """The key of ``k``'s passed self-check on the GPU: the printed source and
  launch parameters too, since the check guards against Triton miscompiling
  them (eleventh session); a compile is deterministic for those."""
  return _gpu_key(k, "self-check", k.source, repr(sorted(k.constexprs.items())),
                  repr(sorted((k.combine_constexprs or {}).items())), repr(k.grid),
                  repr(k.combine_grid), str(k.num_warps), str(k.num_stages))


_CHECKS = "checks"     # the plan cache's folder of passed self-checks


# ``_check_key``s of kernels that passed the self-check in the measuring
# child process (``measure_worker``): the same check, not run again here.
_passed_checks: set[str] = set()


def _checked(k: GeneratedKernel, runner: Callable[[GeneratedKernel, list], list]) -> None:
  """``self_check(k, runner)``, skipped for a kernel that passed it on this
  GPU in the measuring process or in an earlier process (plan cache)."""
  key = _check_key(k) if runner is _run_on_gpu else None
  if key is not None and key in _passed_checks:
    return
  if key is not None:
    from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
    if cache.load_entry(_CHECKS, key) is not None:
      return
  self_check(k, runner)
  _remember_check(key)


def _remember_check(key: Optional[str]) -> None:
  """Records a passed GPU self-check (``_check_key``; None: not kept)."""
  if key is not None:
    from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
    cache.store_entry(_CHECKS, key, {"passed": True})


_TIMINGS = "timings"   # the plan cache's folder of keep-or-drop timings


def _load_timing(key: Optional[str]):
  """``((fused s, spread), (XLA s, spread))`` stored under ``key``, or None."""
  if key is None:
    return None
  from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
  value = cache.load_entry(_TIMINGS, key)
  try:
    if value is not None:
      return tuple((float(value[s][0]), float(value[s][1])) for s in ("fused", "xla"))
  except (KeyError, IndexError, TypeError, ValueError) as e:
    logging.warning("jaxfuse: malformed keep-or-drop timing %s ignored (%s)", key, e)
  return None


def _store_timing(key: Optional[str], fused: tuple[float, float],
                  xla: tuple[float, float]) -> None:
  if key is None:
    return
  from jaxfuse.planner import cache  # pylint: disable=g-import-not-at-top
  if all(math.isfinite(v) for v in (*fused, *xla)):
    cache.store_entry(_TIMINGS, key, {"fused": list(fused), "xla": list(xla)})


def _record_outcome(region: ir.Region, backend: str, out: Outcome) -> None:
  sig = region.signature()
  with _lock:
    timed = _xla_decisions.get(sig)
    if timed is not None:
      out = dataclasses.replace(out, measured_fused_s=timed[0][0], measured_xla_s=timed[1][0],
                                fallback_parts=timed[2])
    _outcomes[(sig, backend)] = out


def _best_predicted(plans: Sequence[Any]):
  """The plan of ``plans`` with the lowest predicted time (None if none is predicted)."""
  timed = [p for p in plans if getattr(p, "predicted", None) is not None]
  return min(timed, key=lambda p: p.predicted.time_s) if timed else None


def recorded_launch(region: ir.Region, plan) -> bool:
  """Whether ``plan``'s kernel launches may be recorded as kernel nodes of
  XLA's command buffers (``direct_launch.records``) rather than captured
  from a stream. Not for one-row streams (``cost_model.is_unpipelined``):
  recorded, they ran up to 1.5x slower in kernel time, LLaMA-2-7B's
  one-token down projection at n=16 61 us against 41 us captured,
  TinyLlama's gate/up part at n=32 28.3 against 18.9 us, with or without
  the grid-dependency wait (H100, sixty-second session; the cause inside
  XLA's kernel nodes was not found; 64-wide split plans ran alike). The
  GEMM chains recording was measured on gained 2-12% of device time
  (fifty-fifth session)."""
  from jaxfuse.planner import cost_model  # pylint: disable=g-import-not-at-top
  return not cost_model.is_unpipelined(region, plan.tile_map)


def grid_wait_pays(region: ir.Region, plan) -> bool:
  """Whether ``plan``'s kernel is generated to wait on its grid dependency,
  so that XLA may start it while the kernel before it finishes: where
  launches are direct and recorded (``direct_launch.grid_waits``) and this
  kernel's are (``recorded_launch``); a captured launch never starts early."""
  return direct_launch.grid_waits() and recorded_launch(region, plan)


def select_kernel(region: ir.Region, plans: Sequence[Any], *, backend: str,
                  check: bool = True) -> GeneratedKernel:
  """The first plan (best first) whose kernel generates, compiles and passes
  the numerical self-check; CodegenError with every reason when none does."""
  if backend not in ("triton", "interpret"):
    raise ValueError(f"backend must be 'triton' or 'interpret', got {backend!r}")
  interpret = backend == "interpret"
  runner = run_interpreted if interpret else _run_on_gpu
  reasons = []
  for p in plans:
    key = (region.signature(), str(p), backend)
    with _lock:
      hit = _kernels.get(key)
    if isinstance(hit, GeneratedKernel):
      return hit
    if isinstance(hit, Exception):
      reasons.append(f"{p}: {hit}")
      continue
    try:
      k = generate(region, p, interpret=interpret,
                   grid_wait=not interpret and grid_wait_pays(region, p))
      if check:
        _checked(k, runner)
    except Exception as e:  # pylint: disable=broad-except  (compile errors, smem overflow, ...)
      err = e if isinstance(e, CodegenError) else CodegenError(f"{type(e).__name__}: {str(e)[:500]}")
      logging.info("jaxfuse: plan dropped (%s): %s", p, err)
      with _lock:
        _kernels[key] = err
      reasons.append(f"{p}: {err}")
      continue
    with _lock:
      _kernels[key] = k
    return k
  raise CodegenError("no plan produced a working kernel: " + " | ".join(reasons)[:2000])


def fused_call(region: ir.Region, args: Sequence[Any], *, backend: str = "triton",
               plan=None, check: bool = True,
               original: Optional[Callable] = None, original_parts: int = 0) -> list[Any]:
  """Runs ``region`` on ``args`` (jax arrays or tracers) through a generated kernel.

  ``plan``: a Plan (or a ranked list) to use instead of the planner's. The
  kernel that survives the fallback chain is cached per region and backend.
  ``original``: what the caller runs instead of the kernel, as a function
  (the region's original ops; ``original_parts``: how many regions of
  their own it lowers, a chain's parts); on the GPU, where
  ``keep_or_drop_timed`` (``config.tune`` 'measure', or 'auto' and the
  model unsure), the chosen kernel is timed against it and dropped when
  that is faster. Raises CodegenError (the caller then runs ``original``).

  Example::

      f = jax.jit(lambda q, k, v: fused_call(region, [q, k, v], backend="interpret"))
  """
  if not isinstance(region, ir.Region):
    raise TypeError(f"region must be a jaxfuse.ir.Region, got {type(region).__name__}")
  n_in = len(ir.operand_buffers(region.inputs))
  if len(args) != n_in:
    raise ValueError(f"args: region takes {n_in} inputs, got {len(args)}")
  key = (region.signature(), backend, None if plan is None else str(plan))
  with _lock:
    k = _chosen.get(key)
  if k is None:
    try:
      candidates = _candidate_plans(region, plan, backend=backend, timing=original is not None)
      k = select_kernel(region, candidates, backend=backend, check=check)
      if (backend == "triton" and original is not None and plan is None
          and keep_or_drop_timed(region, candidates)):
        k = _keep_fused(k, original, model_plan=_best_predicted(candidates),
                        parts=original_parts, rival=_rival_kernel(region, k, check))
    except CodegenError as e:
      if plan is None:
        _record_outcome(region, backend, Outcome(False, reason=str(e)[:500]))
      raise
    finally:
      _release_check_data(region)
    with _lock:
      _chosen[key] = k
    if plan is None:
      _record_outcome(region, backend, Outcome(True, plan=str(k.plan)))
  # ``k`` may be another region's (same signature): launch at this one's offsets.
  offsets = region.launch_offsets()
  if backend == "triton":
    return triton_launch(k, args, offsets)
  shapes = _out_shapes(region)

  def host(*xs):
    return tuple(run_interpreted(k, [np.asarray(x) for x in xs], offsets))

  return host_call(host, shapes, args)


# ------------------------------------------------------------ host calls
def _host_call_abstract(*avals, host, shapes):
  del avals, host
  import jax  # pylint: disable=g-import-not-at-top
  return [jax.core.ShapedArray(s.shape, s.dtype) for s in shapes]


def _host_call_impl(*args, host, shapes):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  outs = host(*[np.asarray(a) for a in args])
  return [jnp.asarray(o, s.dtype) for o, s in zip(outs, shapes)]


def _host_call_lowering(ctx, *args, host, shapes):
  del shapes
  from jax._src import callback as jax_callback  # pylint: disable=g-import-not-at-top
  # As jax.pure_callback lowers, without its impl's device_put of the
  # arguments: XLA's host buffers reach ``host`` as NumPy arrays.
  sharding = jax_callback._callback_op_sharding(  # pylint: disable=protected-access
      ctx.module_context.axis_context, None, ctx.avals_out)

  def call(*xs):
    return tuple(np.asarray(o) for o in host(*xs))

  result, _, _ = jax_callback.emit_python_callback(
      ctx, call, None, list(args), ctx.avals_in, ctx.avals_out,
      has_side_effect=False, returns_token=False, sharding=sharding)
  return result


_host_call_p = None


def _host_call_primitive():
  """The primitive of ``host_call``, made on first use (jax imported lazily)."""
  global _host_call_p
  with _lock:
    if _host_call_p is None:
      from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top
      try:
        from jax.extend.core import Primitive  # pylint: disable=g-import-not-at-top
      except ImportError:  # pragma: no cover - older jax
        from jax.core import Primitive  # type: ignore  # pylint: disable=g-import-not-at-top
      p = Primitive("jaxfuse_host_call")
      p.multiple_results = True
      p.def_impl(_host_call_impl)
      p.def_abstract_eval(_host_call_abstract)
      # The callback is a parameter: a cached lowering would reuse another's.
      mlir.register_lowering(p, _host_call_lowering, cacheable=False)
      _host_call_p = p
  return _host_call_p


def host_call(host: Callable[..., Sequence[np.ndarray]], shapes: Sequence[Any],
              args: Sequence[Any]) -> list[Any]:
  """``host(*numpy arrays)`` run inside the program, as ``jax.pure_callback``
  runs a function, for the interpreted kernels (``shapes``: the results'
  ``ShapeDtypeStruct``s).

  Why not ``jax.pure_callback``: its callback first puts the arguments on
  CPU device 0 and waits for them. With 4 CPU devices on a 2-core host,
  each device's thread in its own callback, those copies waited for
  threads the callbacks held, and the program stalled (``np.asarray`` in
  all four callbacks; tests/test_sharding.py, 2026-11-24). Falls back to
  ``jax.pure_callback`` where jax's callback internals differ."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import callback as jax_callback  # pylint: disable=g-import-not-at-top
  if hasattr(jax_callback, "emit_python_callback") and hasattr(
      jax_callback, "_callback_op_sharding"):
    return list(_host_call_primitive().bind(*args, host=host, shapes=tuple(shapes)))
  try:
    res = jax.pure_callback(host, tuple(shapes), *args, vmap_method="sequential")
  except TypeError:  # older jax: no vmap_method
    res = jax.pure_callback(host, tuple(shapes), *args)
  return list(res)


# ------------------------------------------------------------ measurement
def _torch_cuda() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top
    return bool(torch.cuda.is_available())
  except ImportError:
    return False


_BUDGET_SPENT = "measuring budget spent"


class _BudgetSpent(Exception):
  """The budget ran out while a measurement waited (for the reference)."""


def _float_tensor(a: Any, device: str):
  """``a`` (a NumPy or device array) as a float32 torch tensor on ``device``;
  a device array moves through DLPack, without a host round trip."""
  import torch  # pylint: disable=g-import-not-at-top
  if not isinstance(a, np.ndarray):
    try:
      return torch.from_dlpack(a).to(device=device, dtype=torch.float32)
    except Exception:  # pylint: disable=broad-except  (no DLPack for this array)
      pass
  return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(device)


def measure_plans(region: ir.Region, plans: Sequence[Any], *, budget_s: Optional[float] = None,
                  reps: int = 20, errors: Optional[list] = None) -> list[float]:
  """Seconds per launch of each plan's kernel on the GPU (MCFuser Alg. 1's
  measured top-n step). Plans that fail to compile, launch or pass the
  self-check, and plans left when the budget runs out, get ``inf``; when
  ``errors`` is a list, the reason (or None) is appended to it per plan.

  With torch CUDA: the kernels compile in parallel processes, each is
  checked against one float32 reference of the region and timed from a
  short CUDA graph (``timing.graph_time``; a split plan's two launches
  together), all in a child process (``measure_worker``) unless
  ``config.tune_isolate`` is off: a candidate that faults on the GPU then
  costs that process, not the caller's. Otherwise: the self-check and wall
  time of the jitted jax-triton call, one plan at a time.
  """
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  if budget_s is None:
    budget_s = config.tune_budget_s
  t0 = time.perf_counter()
  t_end = t0 + budget_s
  plans = list(plans)
  info: dict = {}
  res = None
  if _isolated():
    from jaxfuse.runtime import measure_worker  # pylint: disable=g-import-not-at-top
    res = measure_worker.measure(region, plans, seed=MEASURE_SEED, reps=reps, t_end=t_end)
  if res is not None:
    times, why, info = res
  else:
    times, why, info = measure_here(region, plans, seed=MEASURE_SEED, reps=reps, t_end=t_end,
                                    device="cuda" if _torch_cuda() else None)
  for i, t in enumerate(times):
    if why[i] is None and not math.isfinite(t):
      why[i] = _BUDGET_SPENT
  if errors is not None:
    errors.extend(why)
  for p, t, w in zip(plans, times, why):
    logging.vlog(1, "jaxfuse: measured %s: %s", p, f"{t * 1e6:.2f} us" if w is None else w)
  logging.info("jaxfuse: measured %d of %d plans in %.2f s%s (%s; reference wait %.2f s%s)",
               sum(math.isfinite(t) for t in times), len(plans), time.perf_counter() - t0,
               " in the measuring process" if res is not None else "",
               ", ".join(f"{k} {v:.2f}" for k, v in info.get("phases", {}).items()),
               info.get("ref_s", 0.0),
               f"; {info['dropped']} not compiled by the deadline" if info.get("dropped") else "")
  return times


# Set in the measuring child process (``measure_worker``): it measures here.
_IN_MEASURE_WORKER = False


def _isolated() -> bool:
  """Whether measured tuning runs in the child process (``measure_worker``):
  ``config.tune_isolate`` and a GPU under jax. This process then never
  imports torch; the child says whether it has torch CUDA (else measuring
  falls back to this process)."""
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  return config.tune_isolate and not _IN_MEASURE_WORKER and _gpu_name() is not None


def _no_hook(*_: Any) -> None:
  """``measure_here``'s callbacks by default."""


def measure_here(region: ir.Region, plans: Sequence[Any], *, seed: int, reps: int,
                 t_end: float, device: Optional[str],
                 on_start: Callable[[int], None] = _no_hook,
                 on_result: Callable[[int, float, Optional[str], Any], None] = _no_hook
                 ) -> tuple[list[float], list[Optional[str]], dict]:
  """``measure_plans``'s work in this process, until ``t_end`` (a
  ``time.perf_counter()`` value): ``(times, reasons, info)``. ``device``:
  ``cuda`` (torch tensors, Triton's launcher, CUDA-graph timing), ``cpu``
  (the same on interpreted kernels, wall-clock timed: tests), or None (the
  jitted jax-triton call). ``on_start(i)`` is called before plan ``i``'s
  kernel first runs, ``on_result(i, seconds, reason, kernel)`` after."""
  xs: Optional[list[np.ndarray]] = None   # made on first use by the slow path
  times: list[float] = [float("inf")] * len(plans)
  why: list[Optional[str]] = [None] * len(plans)
  fast = _TorchMeasurer(region, seed, device) if device is not None else None
  # Each kernel is checked and timed as soon as it is compiled, while the
  # compile workers build the rest.
  ready = (fast.compiled(plans, why, t_end) if fast is not None
           else ((i, None) for i in range(len(plans))))
  for i, k in ready:
    if time.perf_counter() > t_end:
      why[i] = _BUDGET_SPENT
      break
    on_start(i)
    try:
      if k is not None:
        times[i] = fast.check_and_time(k, reps, deadline=t_end)
      else:
        k = select_kernel(region, [plans[i]], backend="triton", check=True)
        xs = xs or shared_inputs(region, seed)
        times[i] = _time_kernel(k, xs, reps)
    except _BudgetSpent:
      why[i] = _BUDGET_SPENT
    except Exception as e:  # pylint: disable=broad-except
      logging.info("jaxfuse: measuring %s failed: %s", plans[i], e)
      why[i] = f"{type(e).__name__}: {e}"[:500]
    on_result(i, times[i], why[i], k)
  if hasattr(ready, "close"):
    ready.close()   # past the deadline: what still compiles is abandoned
  info = ({"phases": fast.phases, "ref_s": fast.ref_s, "dropped": fast.dropped}
          if fast is not None else {})
  return times, why, info


# The float32 device reference last computed (or being computed), keyed by
# region signature and input seed: the search measures one region in
# several batches, and the self-check of the chosen kernel checks it again.
_last_reference: dict[tuple[str, int], concurrent.futures.Future] = {}
# The same without rounding (``reference.evaluate(rounded=False)``): the
# self-checks' stand-in for the exact result, computed only when a kernel
# misses the rounded reference.
_last_exact_reference: dict[tuple[str, int], concurrent.futures.Future] = {}


def _device_reference(region: ir.Region, seed: int, xs: Optional[list[np.ndarray]] = None,
                      timeout: Optional[float] = None, *, rounded: bool = True) -> list[Any]:
  """``_reference_on_gpu`` of ``random_inputs(region, seed)`` (pass them as
  ``xs`` when already made), computed once per region and seed; waits (at
  most ``timeout`` seconds: ``concurrent.futures.TimeoutError``) for one
  that ``start_reference`` began. ``rounded=False``: the stand-in for the
  exact result instead (``reference.evaluate``)."""
  fut = start_reference(region, seed, xs, background=False, rounded=rounded)
  return fut.result(timeout=timeout)


def start_reference(region: ir.Region, seed: int, xs: Optional[list[np.ndarray]] = None, *,
                    background: bool = True, rounded: bool = True) -> concurrent.futures.Future:
  """Starts (in a thread, or here when not ``background``) the reference
  that ``_device_reference`` returns, unless it is already known or under
  way. Why a thread: its XLA compile took 1.0-1.5 s per region, a quarter
  of the tuning budget (H100, 2026-11-21); it runs without the GIL while
  the model searches and the candidates compile."""
  # The reference depends on where the windows lie, which the signature omits.
  fut, mine = _one_entry(_last_reference if rounded else _last_exact_reference,
                         (region.signature(), seed, region.launch_offsets()))
  if not mine:
    return fut

  def compute():
    _settle(fut, lambda: _reference_on_gpu(
        region, shared_inputs(region, seed) if xs is None else xs, rounded=rounded))
  if background:
    threading.Thread(target=compute, name="jaxfuse-reference", daemon=True).start()
  else:
    compute()
  return fut


# Timed launches cycle through input copies filling ROTATE_L2_MULTIPLE x
# the L2 (an H100's 50 MB), at most ROTATE_MAX_COPIES copies (so at most
# ~100 MB besides the one set a large region has anyway).
ROTATE_L2_BYTES = 50 * 2**20
ROTATE_L2_MULTIPLE = 2
ROTATE_MAX_COPIES = 64


def rotation_copies(nbytes: int) -> int:
  """Input sets the measurer's timed launches cycle through, for inputs of
  ``nbytes`` in all (see ``ROTATE_L2_BYTES``)."""
  nbytes = max(int(nbytes), 1)
  want = math.ceil(ROTATE_L2_MULTIPLE * ROTATE_L2_BYTES / nbytes)
  return max(1, min(ROTATE_MAX_COPIES, want))


class _TorchMeasurer:
  """Compiles, checks and times a batch of plans' kernels through Triton's
  own launcher on torch CUDA tensors (no XLA compile per candidate).
  ``device``: where its tensors live (``cpu`` for interpreted kernels in
  tests)."""

  def __init__(self, region: ir.Region, seed: int, device: str = "cuda"):
    import torch  # pylint: disable=g-import-not-at-top
    _ensure_triton_cache_dir()
    self.region = region
    self.seed = seed
    self.device = device
    xs = shared_inputs(region, seed)
    self.ins = [_to_torch(x).to(device) for x in xs]
    vm = region.value_map
    self.outs = [torch.empty(b.operand_shape, dtype=_torch_dtype(vm[b.value].dtype),
                             device=device) for b in ir.operand_buffers(region.outputs)]
    self.xs = xs
    self._refs: Optional[list] = None   # float32 tensors on ``device``
    self._exact: Optional[list] = None  # the same without rounding, when asked
    self._ref_exact = math.inf          # the reference's error against it
    self.ref_s = 0.0   # waiting for the reference
    self.phases: dict[str, float] = {}   # seconds of ``compiled``'s steps
    self.dropped = 0   # kernels whose compile ``compiled`` abandoned
    # Copies of the inputs that timed launches cycle through, enough to
    # hold twice the L2 cache: a fused call reads fresh activations, and
    # with one input set every launch found it in L2, which favoured plans
    # that re-read their operands (Chimera G2/G3: picks measured that way
    # ran 13-18% slower in the benchmark than the model's plan had; with the
    # copies the picks ran 1-5% faster than it, H100 2026-11-21).
    nbytes = sum(int(t.numel()) * t.element_size() for t in self.ins)
    copies = 1 if device == "cpu" else rotation_copies(nbytes)
    self.in_sets = [self.ins] + [[t.clone() for t in self.ins] for _ in range(copies - 1)]

  def _launches(self, k: GeneratedKernel, in_sets: Optional[list] = None
                ) -> list[list[tuple[Any, tuple, list, dict]]]:
    """For each input set of ``in_sets`` (default: the checked one), the
    ``(fn, grid, args, kwargs)`` of each launch of ``k``: one, or for a
    split plan the main kernel into fp32 scratch and then its combine pass
    (one scratch for all sets: their launches run one after another)."""
    import torch  # pylint: disable=g-import-not-at-top
    in_sets = [self.ins] if in_sets is None else in_sets
    shared: dict = {("off", i): o for i, o in
                    enumerate(_launch_offsets(k, self.region.launch_offsets()))}
    shared.update({("out", j): o for j, o in enumerate(self.outs)})
    shared.update({name: torch.empty(s.shape, dtype=torch.float32, device=self.device)
                   for name, s in _launch_buffers(k).items() if name[0] == "tmp"})
    # Triton's interpreter takes no launch options.
    kw = {} if self.device == "cpu" else k.launch_options
    steps = _launch_steps(k)
    out = []
    for ins in in_sets:
      values = {**shared, **{("in", i): t for i, t in enumerate(ins)}}
      out.append([(fn, grid, [values[n] for n in (*operands, *results)], {**kw, **constexprs})
                  for fn, grid, constexprs, operands, results in steps])
    return out

  def compiled(self, plans: Sequence[Any], why: list, t_end: float
               ) -> Iterator[tuple[int, GeneratedKernel]]:
    """Yields ``(i, kernel)`` for each plan whose kernel is compiled and
    loaded, as soon as it is, while the compile workers build the rest;
    every other plan gets its reason in ``why`` (``_BUDGET_SPENT`` for a
    kernel not compiled by ``t_end``, a ``time.perf_counter()`` value).
    Why stream: the first batch's kernels compile for 1-3 s, and one slow
    compile (13 s, float32 S7) held back the measurement of all of them."""
    t0 = time.perf_counter()
    sig = self.region.signature()
    kernels: list = [None] * len(plans)
    for i, p in enumerate(plans):
      with _lock:
        hit = _kernels.get((sig, str(p), "triton"))
      if isinstance(hit, Exception):
        why[i] = f"{type(hit).__name__}: {hit}"[:500]
        continue
      try:
        on_cpu = self.device == "cpu"
        kernels[i] = hit if isinstance(hit, GeneratedKernel) else generate(
            self.region, p, interpret=on_cpu,
            grid_wait=not on_cpu and grid_wait_pays(self.region, p))
      except Exception as e:  # pylint: disable=broad-except
        why[i] = f"{type(e).__name__}: {e}"[:500]
    # The same source imports as the same function: one compile per module.
    users: dict[str, list[int]] = {}
    for i, k in enumerate(kernels):
      if k is not None:
        users.setdefault(k.module_path, []).append(i)
    first = {path: kernels[ix[0]] for path, ix in users.items()}
    self.phases = {"generate": time.perf_counter() - t0, "wait": 0.0, "load": 0.0,
                   "first launch": 0.0}
    self.dropped = 0

    def fail(path: str, err: Exception) -> None:
      for i in users[path]:   # every plan that prints this kernel
        with _lock:
          _kernels[(sig, str(plans[i]), "triton")] = err
        why[i] = f"CodegenError: {err}"[:500]

    def load(path: str) -> bool:
      t = time.perf_counter()
      try:
        self._load(first[path])
        return True
      except Exception as e:  # pylint: disable=broad-except
        fail(path, CodegenError(f"{type(e).__name__}: {str(e)[:400]}"))
        return False
      finally:
        self.phases["load"] += time.perf_counter() - t

    futures = self._submit(first, t_end)
    if futures is None:
      # No workers: compile on threads (Triton's MLIR passes, LLVM and
      # ptxas mostly run without the GIL: 4 kernels compiled 1.6x faster on
      # 2 threads than on one, 2-core host, 2026-11-21). A compile in this
      # process cannot be abandoned, so these are waited for.
      workers = max(1, min(len(first), os.cpu_count() or 1, 16))
      with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
        ok = dict(zip(first, ex.map(load, first)))
      for path, ix in users.items():
        if ok[path]:
          yield from ((i, kernels[i]) for i in ix)
      return
    t = time.perf_counter()
    ready = [path for path, f in futures.items() if f is None]
    pending = {f: path for path, f in futures.items() if f is not None}
    abandoned: list[str] = []
    try:
      while ready or pending:
        if not ready:
          done, _ = concurrent.futures.wait(
              pending, timeout=max(0.0, t_end - time.perf_counter()) + 1.0,
              return_when=concurrent.futures.FIRST_COMPLETED)
          # Each wait counted once: several waits can pass with nothing to
          # load (compiles abandoned at the deadline).
          now = time.perf_counter()
          self.phases["wait"] += now - t
          t = now
          if not done:
            break
          for f in done:
            path = pending.pop(f)
            if isinstance(f.result(), compile_pool.CompileTimeout):
              abandoned.append(path)
            else:   # compiled, or the worker failed: then it compiles here
              ready.append(path)
          continue
        path = ready.pop(0)
        if load(path):
          for i in users[path]:
            yield i, kernels[i]
        t = time.perf_counter()
    finally:
      # Not compiled by the deadline, or no longer wanted (the caller
      # stopped at its deadline): the plans read "budget spent", so the
      # model ranks them. Their compiles are abandoned.
      self.dropped += len(abandoned) + len(pending)
      for path in [*abandoned, *pending.values(), *ready]:
        for i in users[path]:
          if why[i] is None:
            why[i] = _BUDGET_SPENT

  def _load(self, k: GeneratedKernel) -> None:
    """Loads ``k``'s launches into Triton (from the cache the workers
    filled; compiled here when they did not)."""
    for fn, grid, args, kw in self._launches(k)[0]:
      fn.warmup(*args, grid=grid, **kw)

  def _submit(self, kernels: dict[str, GeneratedKernel], t_end: float
              ) -> Optional[dict[str, Optional[concurrent.futures.Future]]]:
    """Starts the compile workers (``compile_pool``) on ``kernels`` (by
    module path), to be done by ``t_end``; None when this process compiles
    them itself (no workers, a CPU device, interpreted kernels)."""
    if self.device == "cpu" or not kernels or any(k.interpret for k in kernels.values()):
      return None
    pool = compile_pool.get()
    if pool is None:
      return None
    try:
      from triton.runtime.driver import driver  # pylint: disable=g-import-not-at-top
      futs = pool.submit([self._launches(k)[0] for k in kernels.values()],
                         driver.active.get_current_target(), t_end)
    except Exception as e:  # pylint: disable=broad-except
      logging.info("jaxfuse: compile workers failed (%s); compiling in-process", e)
      return None
    return dict(zip(kernels, futs))

  def check_and_time(self, k: GeneratedKernel, reps: int, deadline: Optional[float] = None) -> float:
    """Seconds per launch of ``k`` (CUDA-graph replay), after its self-check
    against the region's reference (waited for until ``deadline``, a
    ``time.perf_counter()`` value: ``_BudgetSpent`` after it)."""
    if not k.global_scratch:
      return self._check_and_time(k, reps, deadline)
    with _scratch_allocator(self.device):
      return self._check_and_time(k, reps, deadline)

  def _reference(self, deadline: Optional[float], *, rounded: bool = True) -> list:
    """The region's device reference (``_device_reference``) as float32
    tensors on ``device``, waited for until ``deadline`` at most (then
    ``_BudgetSpent``); the wait counts in ``ref_s``."""
    t0 = time.perf_counter()
    try:
      refs = _device_reference(self.region, self.seed, self.xs, rounded=rounded,
                               timeout=None if deadline is None else max(0.0, deadline - t0))
    except concurrent.futures.TimeoutError:
      raise _BudgetSpent() from None
    finally:
      self.ref_s += time.perf_counter() - t0
    return [_float_tensor(r, self.device) for r in refs]

  def _within_exact(self, tol: float, deadline: Optional[float]) -> bool:
    """Whether the outputs, outside ``tol`` of the rounded reference, are
    within ``_exact_bound`` of the region in float32 without rounding: the
    recheck ``self_check`` passes a kernel by."""
    if self._exact is None:
      self._exact = self._reference(deadline, rounded=False)
      self._ref_exact = compare_tensors(self._refs, self._exact)
    return compare_tensors(self.outs, self._exact) <= _exact_bound(tol, self._ref_exact)

  def _check_and_time(self, k: GeneratedKernel, reps: int, deadline: Optional[float]) -> float:
    import torch  # pylint: disable=g-import-not-at-top
    import triton  # pylint: disable=g-import-not-at-top
    key = (self.region.signature(), str(k.plan), "triton")
    rotation = self._launches(k, self.in_sets)
    launches = rotation[0]

    def fn():
      for f, grid, args, kw in launches:
        f[grid](*args, **kw)
    # Run and synchronize before any graph capture: a plan that cannot
    # launch must fail here, as a failure under capture left the CUDA
    # context unusable for every later plan (model_fidelity, 2026-11-21).
    for o in self.outs:
      o.fill_(float("nan") if o.dtype.is_floating_point else 0)
    # Timed as a phase: a kernel's first launch loads it onto the GPU and,
    # on a cold cache, builds its host launcher (Triton 3.6 compiles one
    # per kernel signature with the host's C compiler): 0.2-0.8 s of a
    # region's budget on the H100 host (2026-11-26).
    t_first = time.perf_counter()
    if self.device == "cpu":
      with interpret_env(True):
        fn()
    else:
      fn()
      torch.cuda.synchronize()
    self.phases["first launch"] = (self.phases.get("first launch", 0.0)
                                   + time.perf_counter() - t_first)
    with _lock:
      checked = isinstance(_kernels.get(key), GeneratedKernel)
    if not checked:
      if self._refs is None:
        self._refs = self._reference(deadline)
      err = compare_tensors(self.outs, self._refs)
      tol = tolerance(self.region)
      if not (err <= tol or self._within_exact(tol, deadline)):
        e = CodegenError(f"self-check failed: relative error {err:.3g} > {tol:g} for plan {k.plan}")
        with _lock:
          _kernels[key] = e
        raise e
      with _lock:
        _kernels[key] = k
      # The same check as select_kernel's, which then takes this kernel as
      # checked: kept on disk alike (a later process does not tune).
      _remember_check(_check_key(k) if self.device != "cpu" else None)
    if self.device == "cpu":   # interpreted (tests): wall time stands in
      t = time.perf_counter()
      with interpret_env(True):
        fn()
      return time.perf_counter() - t
    # Replayed from a CUDA graph: the model predicts kernel time, and in a
    # compiled program (XLA command buffers) the per-launch host cost of
    # Triton's Python launcher (~5 us, measured 2026-11-21 on an H200,
    # which flattened every small plan to the same time) is not paid.
    turn = [0]

    def fn_rotating():
      for f, grid, args, kw in rotation[turn[0] % len(rotation)]:
        f[grid](*args, **kw)
      turn[0] += 1
    try:
      return timing.graph_time(fn_rotating, reps=max(3, reps // 4))
    except Exception as e:  # pylint: disable=broad-except
      logging.info("jaxfuse: CUDA-graph timing failed (%s); timing launches", e)
      return float(triton.testing.do_bench(fn, warmup=5, rep=max(reps, 5))) * 1e-3


@contextlib.contextmanager
def _scratch_allocator(device: str) -> Iterator[None]:
  """Triton's launcher allocates a kernel's global scratch (a Gluon
  kernel's TMA descriptors, ``GeneratedKernel.global_scratch``) through
  ``triton.set_allocator``, unset by default: torch's allocator on
  ``device`` within, the caller's (this context's) restored after."""
  import torch  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  try:
    from triton.runtime import _allocation  # pylint: disable=g-import-not-at-top
    before = _allocation._allocator.get()  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    before = None
  triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                               device=device))
  try:
    yield
  finally:
    if before is not None:
      triton.set_allocator(before)


def make_measure(region: ir.Region, budget_s: Optional[float] = None) -> Callable[[Sequence[Any]], list[float]]:
  """A ``measure(plans) -> seconds`` callable for ``plan_region(..., measure=)``.

  The budget (default ``config.tune_budget_s``) is for the whole search of
  this region, from ``measure.begin()`` (which ``plan_region`` calls before
  it searches; else the first measurement), not per call: once it is spent, or when what is left is
  shorter than the last batch's time scaled to this batch's size, every
  later plan reads None (the model alone ranks what is left). Why the
  estimate: a batch's kernels compile before any is timed and cannot be
  cut short, and a launch-knob batch started with 0.5 s left took tuning
  to 5.3-6.0 s per region (H100, 2026-11-21, twelfth session).
  """
  if budget_s is None:
    from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
    budget_s = config.tune_budget_s
  t_end = [time.perf_counter() + budget_s]
  begun = [False]
  last: list[tuple[float, int]] = []   # (seconds, plans) of the last batch

  def begin():
    """Called by ``plan_region`` when it will search (not on a cache hit):
    the budget starts now, and the measuring process (or the compile
    workers) and the reference start here, so that they proceed while the
    model's search runs."""
    if begun[0]:
      return
    begun[0] = True
    t_end[0] = time.perf_counter() + budget_s
    if _isolated():
      from jaxfuse.runtime import measure_worker  # pylint: disable=g-import-not-at-top
      measure_worker.start()   # it starts its own compile workers
      start_reference(region, MEASURE_SEED)
    elif _torch_cuda():
      _ensure_triton_cache_dir()
      compile_pool.get()
      start_reference(region, MEASURE_SEED)

  def measure(plans):
    begin()
    if _isolated():
      # The child's start (once per process) is not this region's tuning:
      # the budget starts over from when it can measure.
      from jaxfuse.runtime import measure_worker  # pylint: disable=g-import-not-at-top
      t_end[0] += measure_worker.wait_until_ready()
    left = t_end[0] - time.perf_counter()
    if left <= 0:
      return [None] * len(plans)
    if last and last[-1][0] * max(len(plans) / last[-1][1], 0.5) > left:
      return [None] * len(plans)
    why: list = []
    t0 = time.perf_counter()
    times = measure_plans(region, plans, budget_s=left, errors=why)
    last.append((time.perf_counter() - t0, max(len(plans), 1)))
    # None = not measured (budget spent): the search ranks those by the model;
    # inf = failed (compile error, wrong answer).
    return [None if w == _BUDGET_SPENT else t for t, w in zip(times, why)]
  measure.begin = begin
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  # The GPU runs the other kernel forms (Plan.form) only where the config
  # lets it: only then are they timed (planner.kernel_forms.FormTiming).
  measure.kernel_forms = bool(config.kernel_forms)
  return measure


def _ensure_triton_cache_dir() -> None:
  """Launching through Triton's own runtime (unlike jax-triton) needs its
  cache dir, which it failed to locate on the benchmark machines ("Could
  not create or locate cache dir"): unless the user set one, use one under
  jaxfuse's cache dir, else a temp dir."""
  import tempfile  # pylint: disable=g-import-not-at-top
  if os.environ.get("TRITON_CACHE_DIR"):
    return
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  d = os.path.join(os.path.abspath(os.path.expanduser(config.cache_dir)), "triton")
  try:
    os.makedirs(d, exist_ok=True)
    if not os.access(d, os.W_OK):
      raise OSError(f"{d} is not writable")
  except OSError:
    d = tempfile.mkdtemp(prefix="jaxfuse-triton-")
  os.environ["TRITON_CACHE_DIR"] = d


def _time_kernel(k: GeneratedKernel, xs: list, reps: int) -> float:
  """Wall time of the jitted jax-triton call: the path for machines without
  torch CUDA."""
  import jax  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda *a: triton_launch(k, a))
  dev = [jax.device_put(x) for x in xs]
  jax.block_until_ready(f(*dev))
  ts = []
  for _ in range(max(reps, 3)):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*dev))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))
