"""The IR evaluated with jax.numpy in float32: a reference that runs on the GPU.

``jaxfuse.ir.evaluate`` (NumPy, float64) is the ground truth in tests; for a
self-check of a kernel at full size on the GPU (a 8x16x2048x2048 attention
has 537M scores) it is far too slow, so the launch path compares against this
float32 evaluation on the device instead. Same semantics, op by op.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import ir

__all__ = ["evaluate"]

_JNP_FNS = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
    "max": jnp.maximum, "min": jnp.minimum, "pow": jnp.power, "neg": jnp.negative,
    "abs": jnp.abs, "exp": jnp.exp, "exp2": jnp.exp2, "log": jnp.log,
    "log1p": jnp.log1p, "expm1": jnp.expm1, "tanh": jnp.tanh,
    "logistic": jax.nn.sigmoid, "erf": jax.scipy.special.erf, "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt, "square": jnp.square, "sign": jnp.sign,
    "eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
    "gt": jnp.greater, "ge": jnp.greater_equal, "and": jnp.logical_and,
    "or": jnp.logical_or, "not": jnp.logical_not,
    "select": lambda p, f, t: jnp.where(p, t, f), "convert": lambda x: x,
}


def _align(x, loops: Sequence[str], target: Sequence[str]):
  present = [l for l in target if l in loops]
  x = jnp.transpose(x, [list(loops).index(l) for l in present])
  shape, it = [], iter(x.shape)
  for l in target:
    shape.append(next(it) if l in present else 1)
  return x.reshape(shape)


def _work_dtype(dtype: str):
  return jnp.float32 if dtype in ir.FLOAT_DTYPES else ir.np_dtype(dtype)


def evaluate(region: ir.Region, inputs: Sequence[jax.Array], *,
             rounded: bool = True) -> list[jax.Array]:
  """Outputs of ``region`` on ``inputs`` (one per operand:
  ``ir.operand_shapes(region.inputs)``), every float op in float32; outputs
  cast to their IR dtypes, one per output operand. ``rounded``: each value
  is rounded to its IR dtype, as XLA computes it; without, values stay in
  float32 up to the outputs, the stand-in for the exact result on the
  device (``launch.self_check``), where float64 NumPy would take minutes."""
  if set(_JNP_FNS) != set(ir.ELEMENTWISE_FNS):  # pragma: no cover - table drift
    raise NotImplementedError(sorted(set(ir.ELEMENTWISE_FNS) ^ set(_JNP_FNS)))
  vm, ext = region.value_map, region.loop_extents
  env = {}
  inputs = ir.stack_parts(region.inputs, list(inputs), stack=jnp.stack)
  for buf, arr in zip(region.inputs, inputs):
    v = vm[buf.value]
    if _dense(buf, ext) and set(buf.loops) <= set(v.loops):
      view = _align(jnp.reshape(arr, [ext[l] for l in buf.loops]), buf.loops, v.loops)
    else:
      present = [l for l in v.loops if l in buf.loops]
      view = _align(jnp.take(jnp.ravel(arr), _offsets(buf, present, ext)), present, v.loops)
    full = jnp.broadcast_to(view, [ext[l] for l in v.loops])
    env[v.name] = full.astype(_work_dtype(v.dtype))
  for op in region.ops:
    out = vm[op.out]
    if isinstance(op, ir.Contraction):
      a, b = vm[op.lhs], vm[op.rhs]
      letters = {}
      for l in list(a.loops) + list(b.loops):
        letters.setdefault(l, chr(ord("a") + len(letters)))
      spec = (f"{''.join(letters[l] for l in a.loops)},{''.join(letters[l] for l in b.loops)}"
              f"->{''.join(letters[l] for l in out.loops)}")
      res = jnp.einsum(spec, env[op.lhs], env[op.rhs],
                       precision=jax.lax.Precision.HIGHEST)
    elif isinstance(op, ir.Elementwise):
      args = [jnp.asarray(a.value, _work_dtype(a.dtype)) if isinstance(a, ir.Literal)
              else _align(env[a], vm[a].loops, out.loops) for a in op.args]
      res = jnp.broadcast_to(_JNP_FNS[op.fn](*args), [ext[l] for l in out.loops])
    elif isinstance(op, ir.Reduction):
      arg = vm[op.arg]
      axis = arg.loops.index(op.loop)
      res = (jnp.max if op.kind == "max" else jnp.sum)(env[op.arg], axis=axis)
      rest = [l for l in arg.loops if l != op.loop]
      res = _align(res, rest, out.loops).reshape([ext[l] for l in out.loops])
    else:
      res = jnp.arange(ext[op.loop], dtype=jnp.int32)
    if out.dtype in ir.FLOAT_DTYPES:  # round like the IR dtype, keep float32
      if rounded:
        res = res.astype(ir.np_dtype(out.dtype))
      res = res.astype(jnp.float32)
    else:
      res = res.astype(ir.np_dtype(out.dtype))
    env[op.out] = res
  outs = []
  for buf in region.outputs:
    v = vm[buf.value]
    val = _align(env[v.name], v.loops, buf.loops).astype(ir.np_dtype(v.dtype))
    if _dense(buf, ext):
      outs.append(val.reshape(buf.shape))
      continue
    flat = jnp.zeros((buf.size,), ir.np_dtype(v.dtype))
    flat = flat.at[_offsets(buf, buf.loops, ext).reshape(-1)].set(val.reshape(-1))
    outs.append(flat.reshape(buf.shape))
  return ir.split_parts(region.outputs, outs)


def _dense(buf: ir.Buffer, ext) -> bool:
  """Whether ``buf`` is its loops' extents laid out row-major from element 0
  (the common case): then it is a reshape, no gather or scatter."""
  want = 1
  for l, s in reversed(buf.strides):
    if ext[l] > 1 and s != want:
      return False
    want *= ext[l]
  return buf.offset == 0 and want == buf.size


def _offsets(buf: ir.Buffer, loops: Sequence[str], ext):
  """Flat element offsets of ``buf`` over ``loops`` (int32). Built from iotas
  inside the program: a NumPy index array would be embedded as a constant as
  large as the buffer (a 8x16x2048x128 attention output made a 268 MB HLO
  text that took 7 s to lower and compile, 2026-11-22)."""
  off = jnp.full([ext[l] for l in loops], buf.offset, dtype=jnp.int32)
  for i, l in enumerate(loops):
    shape = [1] * len(loops)
    shape[i] = ext[l]
    off = off + buf.stride(l) * jnp.arange(ext[l], dtype=jnp.int32).reshape(shape)
  return off
