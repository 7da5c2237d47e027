"""jaxfuse.codegen.rewrite: the exp2 softmax fold."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxfuse import ir
from jaxfuse.codegen import rewrite, testing as T
from jaxfuse.codegen.triton_printer import print_kernel
from jaxfuse.planner import examples


def _inputs(r, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(b.shape).astype(ir.np_dtype(r.value_map[b.value].dtype))
          for b in r.inputs]


def _fns(r):
  return {op.out: (op.fn, op.args) for op in r.ops if isinstance(op, ir.Elementwise)}


@pytest.mark.parametrize("make", [
    lambda: examples.attention(1, 2, 64, 48, 32, 32),
    lambda: T.attention(64, 64, 32, causal=True),
    lambda: T.attention(64, 64, 32, mask=True),
])
def test_fold_exp2_same_values(make):
  r = make()
  r2 = rewrite.fold_exp2(r)
  assert r2 is not r
  fns = _fns(r2)
  assert "exp" not in [f for f, _ in fns.values()] and "exp2" in [f for f, _ in fns.values()]
  scales = [a for f, args in fns.values() if f == "mul" for a in args if isinstance(a, ir.Literal)]
  assert any(math.isclose(float(s.value), 0.125 / math.log(2.0)) or
             math.isclose(float(s.value), (32 ** -0.5) / math.log(2.0)) for s in scales)
  # names, loops and op count unchanged: a plan for r places r2
  assert [op.out for op in r2.ops] == [op.out for op in r.ops]
  xs = _inputs(r)
  for a, b in zip(ir.evaluate(r, xs), ir.evaluate(r2, xs)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_fold_exp2_leaves_unfoldable_softmax():
  # a bias added after the scale: folding would need the bias scaled too
  r = T.attention(64, 64, 32, bias=True)
  assert rewrite.fold_exp2(r) is r
  # a GEMM chain has no softmax
  g = examples.gemm_chain(1, 64, 64, 32, 32)
  assert rewrite.fold_exp2(g) is g


def test_fold_exp2_needs_private_values():
  """When the scaled scores or the max feed anything else (here: the max is
  also a region output), rescaling would change them: no fold."""
  r = examples.attention(1, 1, 32, 32, 16, 16)
  vm = r.value_map
  mx = next(op.out for op in r.ops if isinstance(op, ir.Reduction) and op.kind == "max")
  shape = tuple(r.loop_extents[l] for l in vm[mx].loops)
  extra = ir.Buffer(mx, shape, tuple(zip(vm[mx].loops, ir.contiguous_strides(shape))))
  r_out = ir.Region(r.loops, r.values, r.inputs, r.outputs + (extra,), r.ops, name=r.name)
  assert rewrite.fold_exp2(r_out) is r_out


def test_printed_attention_uses_exp2():
  from jaxfuse.planner import plan_region
  r = examples.attention(1, 2, 64, 64, 32, 32)
  src = print_kernel(r, plan_region(r, "h100", use_cache=False).best).source
  assert "tl.exp2(" in src and "tl.exp(" not in src


def _captured(fn, *shapes, dtype=np.float32):
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(s, dtype) for s in shapes]))
  return cap.region


def _masked_attention(mask):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def attend(q, k, v):
    if mask == "dot_product_attention":
      return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    i, j = jnp.arange(s.shape[1])[:, None], jnp.arange(s.shape[2])[None, :]
    lowest = jnp.finfo(s.dtype).min
    s = {"where(i >= j, s, min)": lambda: jnp.where(i >= j, s, lowest),
         # query 0 keeps no key: its row averages every value, as unfolded
         "where(i > j, s, min)": lambda: jnp.where(i > j, s, lowest),
         "s + where(i >= j, 0, -1e9)": lambda: s + jnp.where(i >= j, 0.0, -1e9).astype(s.dtype),
         "where(i >= j, s, -1e3)": lambda: jnp.where(i >= j, s, -1e3)}[mask]()
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)
  return attend


@pytest.mark.parametrize("mask,dtype", [
    ("dot_product_attention", np.float32),     # finite fill -0.7 x max: x log2 e overflows, clamped
    ("where(i >= j, s, min)", np.float16),     # float16's min, clamped
    ("where(i > j, s, min)", np.float32),
    ("s + where(i >= j, 0, -1e9)", np.float32),
    ("where(i >= j, s, -1e3)", np.float32),    # scaled exactly
])
def test_fold_exp2_rescales_finite_mask_fills(mask, dtype):
  """A mask between the scale and the softmax folds with it: its fill is
  multiplied by log2 e, clamped to the dtype's lowest finite value so a
  finite fill stays finite; the region computes the same values."""
  shapes = ((1, 24, 4, 16),) * 3 if mask == "dot_product_attention" else ((2, 24, 16),) * 3
  r = _captured(_masked_attention(mask), *shapes, dtype=dtype)
  r2 = rewrite.fold_exp2(r)
  assert r2 is not r and "exp2" in [f for f, _ in _fns(r2).values()]
  fills = lambda reg: sorted(float(a.value) for f, args in _fns(reg).values() if f == "select"
                             for a in args if isinstance(a, ir.Literal) and a.value < 0)
  lowest = float(np.finfo(dtype).min)
  for before, after in zip(fills(r), fills(r2), strict=True):
    assert math.isfinite(after) and after == max(before / math.log(2.0), lowest)
    assert after <= before
  xs = _inputs(r)
  for a, b in zip(ir.evaluate(r, xs), ir.evaluate(r2, xs)):
    assert np.isfinite(b).all()
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_fold_exp2_leaves_positive_fills():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def attend(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    s = jnp.where(jnp.arange(24)[:, None] >= jnp.arange(24)[None, :], s, 3.0)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

  r = _captured(attend, (2, 24, 16), (2, 24, 16), (2, 24, 16))
  assert rewrite.fold_exp2(r) is r
