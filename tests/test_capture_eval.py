"""Property tests: the IR evaluator reproduces every captured region's ops.

For random shapes (dims that are not multiples of 16, dims of size 1) and
dtypes (float16, bfloat16, float32), each pattern is traced, captured, and
``jaxfuse.ir.evaluate(region, inputs)`` (float64) is compared with the
region's original jaxpr run on the same fresh random inputs. The rewrite
with the original ops must equal the original function exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxfuse import capture, ir

try:
  from jax.extend.core import jaxpr_as_fun
except ImportError:  # pragma: no cover
  from jax.core import jaxpr_as_fun  # type: ignore

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}
# Tolerance relative to the output's scale: one rounding per op in the
# region's dtype, a few ops deep.
TOL = {"float16": 2e-2, "bfloat16": 1.2e-1, "float32": 2e-4}

dims = st.sampled_from([1, 2, 3, 5, 7, 13, 17, 24])
dtypes = st.sampled_from(sorted(DTYPES))
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _gemm_chain(shapes_dt):
  (b, m, n, k, h), _ = shapes_dt
  return (lambda a, bb, d: (a @ bb) @ d), [(b, m, k), (b, k, n), (b, n, h)]


def _attention(variant, b, m, n, k, h):
  def f(q, kk, v, *extra):
    s = jnp.einsum("bqd,bkd->bqk", q, kk) * jnp.asarray(0.7, q.dtype)
    if variant == "bias":
      s = s + extra[0]
    elif variant == "mask":
      s = jnp.where(extra[0], s, jnp.asarray(-1e4, s.dtype))
    elif variant == "causal":
      row = jax.lax.broadcasted_iota(jnp.int32, (m, n), 0)
      col = jax.lax.broadcasted_iota(jnp.int32, (m, n), 1)
      s = jnp.where(row + (n - m) >= col, s, -jnp.inf)
    if variant == "hand":
      e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
      p = e / jnp.sum(e, axis=-1, keepdims=True)
    else:
      p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bqk,bkd->bqd", p, v)
  shapes = [(b, m, k), (b, n, k), (b, n, h)]
  if variant == "bias":
    shapes.append((b, m, n))
  if variant == "mask":
    shapes.append(("bool", b, m, n))
  return f, shapes


def _mlp(act, b, m, k, n, h):
  acts = {"relu": jax.nn.relu, "gelu": jax.nn.gelu,
          "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
          "silu": jax.nn.silu, "tanh": jnp.tanh}
  a = acts[act]

  def f(x, w1, w2, w3, bias):
    return a(a(x @ w1 + bias) @ w2) @ w3
  return f, [(b, m, k), (k, n), (n, h), (h, k), (n,)]


def _bthd(b, t, s, heads, d):
  def f(q, k, v):
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    sc = jnp.einsum("bhqd,bhkd->bhqk", qh, kh)
    o = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(sc, axis=-1), vh)
    return o.transpose(0, 2, 1, 3).reshape(b, t, heads * d)
  return f, [(b, t, heads, d), (b, s, heads, d), (b, s, heads, d)]


def _inputs(shapes, dtype, rng):
  out = []
  for s in shapes:
    if s and s[0] == "bool":
      out.append(jnp.asarray(rng.standard_normal(s[1:]) > -0.5))
    else:
      out.append(jnp.asarray(rng.standard_normal(s) * 0.5, dtype))
  return out


def _check(f, shapes, dtype_name, seed, min_regions=1):
  rng = np.random.default_rng(seed)
  dtype = DTYPES[dtype_name]
  args = _inputs(shapes, dtype, rng)
  closed = jax.make_jaxpr(f)(*args)
  regions = capture.find_regions(closed)
  assert len(regions) >= min_regions
  for r in regions:
    ins = []
    for b in r.region.inputs:
      dt = r.region.value(b.value).dtype
      if dt == "bool":
        ins.append(rng.standard_normal(b.shape) > -0.5)
      else:
        ins.append((rng.standard_normal(b.shape) * 0.5).astype(ir.np_dtype(dt)))
    want = [np.asarray(x, np.float64) for x in jaxpr_as_fun(r.jaxpr)(*ins)]
    got = ir.evaluate(r.region, ins)
    for w, g, buf in zip(want, got, r.region.outputs):
      assert w.shape == g.shape == tuple(buf.shape)
      dt = r.region.value(buf.value).dtype
      scale = max(1.0, float(np.max(np.abs(g))) if g.size else 1.0)
      tol = max(TOL[dtype_name], TOL.get(dt, 0.0))
      np.testing.assert_allclose(w, g, rtol=tol, atol=tol * scale)
  # Rewriting with the original ops computes exactly the same.
  new = capture.rewrite(closed, lambda cap, *xs: jaxpr_as_fun(cap.jaxpr)(*xs))
  for w, g in zip(jaxpr_as_fun(closed)(*args), jaxpr_as_fun(new)(*args)):
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(g, np.float32))
  return regions


@SETTINGS
@given(b=dims, m=dims, n=dims, k=dims, h=dims, dt=dtypes)
def test_gemm_chain_property(b, m, n, k, h, dt):
  f = lambda a, bb, d: (a @ bb) @ d  # noqa: E731
  [r] = _check(f, [(b, m, k), (b, k, n), (b, n, h)], dt, seed=b * 1000 + m)
  ext = r.region.loop_extents
  for name, size in zip("bmnkh", (b, m, n, k, h)):
    assert ext.get(name, 1) == size


@SETTINGS
@given(variant=st.sampled_from(["plain", "bias", "mask", "causal", "hand"]),
       b=dims, m=dims, n=dims, k=dims, h=dims, dt=dtypes)
def test_attention_property(variant, b, m, n, k, h, dt):
  f, shapes = _attention(variant, b, m, n, k, h)
  [r] = _check(f, shapes, dt, seed=m * 100 + n)
  assert len(r.region.contractions) == 2


@SETTINGS
@given(act=st.sampled_from(["relu", "gelu", "gelu_erf", "silu", "tanh"]),
       b=dims, m=dims, k=dims, n=dims, h=dims, dt=dtypes)
def test_mlp_property(act, b, m, k, n, h, dt):
  f, shapes = _mlp(act, b, m, k, n, h)
  [r] = _check(f, shapes, dt, seed=k * 100 + n)
  assert len(r.region.contractions) == 3


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(b=dims, t=dims, s=dims, heads=st.sampled_from([1, 2, 3]), d=dims, dt=dtypes)
def test_bthd_attention_property(b, t, s, heads, d, dt):
  f, shapes = _bthd(b, t, s, heads, d)
  [r] = _check(f, shapes, dt, seed=t * 100 + s)
  assert [tuple(x.shape) for x in r.region.inputs] == [tuple(x) for x in shapes]


@pytest.mark.parametrize("dt", sorted(DTYPES))
def test_mixed_precision_chain(dt):
  """float16/bfloat16 operands with float32 accumulation and casts between."""
  def f(a, b, d):
    c = jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return jnp.matmul(jax.nn.relu(c).astype(a.dtype), d, preferred_element_type=jnp.float32)
  [r] = _check(f, [(3, 9, 7), (7, 11), (11, 5)], dt, seed=7)
  assert r.region.value(r.region.outputs[0].value).dtype == "float32"
