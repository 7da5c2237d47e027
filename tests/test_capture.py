"""Capture: which regions are found (loops, extents, paths) and rewrite."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, ir

try:
  from jax.extend.core import jaxpr_as_fun
except ImportError:  # pragma: no cover
  from jax.core import jaxpr_as_fun  # type: ignore

RNG = np.random.default_rng(1234)


def rand(*shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(RNG.standard_normal(shape) * scale, dtype)


# --------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------

def gemm_chain(a, b, d):
  return (a @ b) @ d


def attention(q, k, v):
  s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def attention_bias(q, k, v, bias):
  s = jnp.einsum("bqd,bkd->bqk", q, k) / 3.0 + bias
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def attention_mask(q, k, v, mask):
  s = jnp.einsum("bqd,bkd->bqk", q, k)
  s = jnp.where(mask, s, -1e9)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def attention_causal(q, k, v):
  t = q.shape[1]
  s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
  causal = jnp.tril(jnp.ones((t, t), bool))
  s = jnp.where(causal[None], s, -jnp.inf)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def attention_causal_iota(q, k, v):
  t = q.shape[1]
  row = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
  s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
  s = jnp.where(row >= col, s, jnp.finfo(s.dtype).min)
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def attention_hand_softmax(q, k, v):
  s = q @ jnp.swapaxes(k, -1, -2) * 0.3
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  p = e / jnp.sum(e, axis=-1, keepdims=True)
  return p @ v


def attention_bthd(q, k, v):
  """[B, T, H, D] layout: heads split by transposes, merged by a reshape."""
  qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh) / np.sqrt(q.shape[-1]).astype(np.float32)
  o = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), vh)
  b, h, t, d = o.shape
  return o.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def mlp3(x, w1, w2, w3, act1, act2):
  return act2(act1(x @ w1) @ w2) @ w3


ACTS = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
}


@jax.custom_jvp
def my_softmax(x):
  e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@my_softmax.defjvp
def _my_softmax_jvp(primals, tangents):
  (x,), (tx,) = primals, tangents
  y = my_softmax(x)
  return y, y * (tx - (y * tx).sum(-1, keepdims=True))


def attention_custom_jvp(q, k, v):
  return my_softmax(q @ jnp.swapaxes(k, -1, -2)) @ v


def mlp_scan(x, w1, w2):
  def body(c, _):
    return jnp.tanh(jax.nn.relu(c @ w1) @ w2), None
  c, _ = jax.lax.scan(body, x, None, length=3)
  return c


def mlp_checkpoint(x, w1, w2, w3):
  return jax.checkpoint(lambda x: jax.nn.silu(jax.nn.gelu(x @ w1) @ w2) @ w3)(x)


def regions_of(f, *args):
  return capture.find_regions(jax.make_jaxpr(f)(*args))


def one_region(f, *args) -> capture.CapturedRegion:
  rs = regions_of(f, *args)
  assert len(rs) == 1, [r.region for r in rs]
  return rs[0]


def check_region_matches_jaxpr(r: capture.CapturedRegion, rtol=1e-4, atol=1e-5):
  ins = []
  for i, b in enumerate(r.region.inputs):
    dt = r.region.value(b.value).dtype
    if r.same_as and r.same_as[i] != i:
      ins.append(ins[r.same_as[i]])   # a window of an array already drawn
    elif dt == "bool":
      ins.append(RNG.standard_normal(b.shape) > 0)
    else:
      ins.append((RNG.standard_normal(b.shape) * 0.5).astype(ir.np_dtype(dt)))
  ref = jaxpr_as_fun(r.jaxpr)(*ins)
  got = ir.evaluate(r.region, ins)
  assert len(ref) == len(got)
  for a, g in zip(ref, got):
    np.testing.assert_allclose(np.asarray(a, np.float64), g, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------
# Exactly one region, right loops
# --------------------------------------------------------------------------

def test_batch_gemm_chain():
  a, b, d = rand(3, 40, 24), rand(3, 24, 20), rand(3, 20, 12)
  r = one_region(gemm_chain, a, b, d)
  assert r.region.loop_extents == {"b": 3, "m": 40, "n": 20, "k": 24, "h": 12}
  assert r.region.einsum_summary() == "bmk,bkn->bmn ; bmn,bnh->bmh"
  assert [b.shape for b in r.region.inputs] == [(3, 40, 24), (3, 24, 20), (3, 20, 12)]
  line = inspect.getsourcelines(gemm_chain)[1] + 1
  assert r.path == "" and r.source.endswith(f"test_capture.py:{line}")
  check_region_matches_jaxpr(r)


ATTN = {"b": 2, "m": 12, "n": 10, "k": 8, "h": 6}


def _qkv():
  return rand(2, 12, 8), rand(2, 10, 8), rand(2, 10, 6)


@pytest.mark.parametrize("variant", ["plain", "bias", "mask", "causal", "causal_iota",
                                     "hand", "custom_jvp"])
def test_attention(variant):
  q, k, v = _qkv()
  if variant in ("causal", "causal_iota"):
    k, v = rand(2, 12, 8), rand(2, 12, 6)
  fn, extra = {
      "plain": (attention, ()),
      "bias": (attention_bias, (rand(2, 12, 10),)),
      "mask": (attention_mask, (rand(2, 12, 10) > 0,)),
      "causal": (attention_causal, ()),
      "causal_iota": (attention_causal_iota, ()),
      "hand": (attention_hand_softmax, ()),
      "custom_jvp": (attention_custom_jvp, ()),
  }[variant]
  r = one_region(fn, q, k, v, *extra)
  want = dict(ATTN, n=k.shape[1])
  assert r.region.loop_extents == want
  assert r.region.einsum_summary() == "bmk,bnk->bmn ; bmn,bnh->bmh"
  reds = [op for op in r.region.ops if isinstance(op, ir.Reduction)]
  assert {(op.kind, op.loop) for op in reds} == {("max", "n"), ("sum", "n")}
  if variant.startswith("causal"):
    assert {op.loop for op in r.region.ops if isinstance(op, ir.Iota)} == {"m", "n"}
  assert len(r.region.outputs) == 1
  check_region_matches_jaxpr(r)


def test_attention_bthd_layout_folds_into_strides():
  q, k, v = rand(2, 12, 3, 8), rand(2, 10, 3, 8), rand(2, 10, 3, 8)
  r = one_region(attention_bthd, q, k, v)
  ext = r.region.loop_extents
  assert sorted(ext.values()) == sorted([2, 3, 12, 10, 8, 8])
  assert ext["b"] == 2 and ext["m"] == 12 and ext["n"] == 10 and ext["k"] == 8
  # No copies: inputs are the untransposed arrays, read through strides.
  assert [b.shape for b in r.region.inputs] == [(2, 12, 3, 8), (2, 10, 3, 8), (2, 10, 3, 8)]
  qb = r.region.inputs[0]
  assert qb.stride("b") == 12 * 3 * 8 and qb.stride("m") == 3 * 8 and qb.stride("k") == 1
  out = r.region.outputs[0]
  assert out.shape == (2, 12, 24)
  assert out.stride("m") == 24 and out.stride("h") == 1 and out.stride("b") == 12 * 24
  check_region_matches_jaxpr(r)


def test_computed_operand_is_the_left_one_of_its_contraction():
  # jnp.einsum("bhqk,bkhd->bqhd", p, v) is traced as dot(v, p): the IR puts
  # the softmax weights left of v (tl.dot's register operand), so the kernel
  # keeps them in registers instead of storing them to shared memory.
  def attention_tokens_major(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
  q, k, v = rand(2, 32, 3, 16), rand(2, 32, 3, 16), rand(2, 32, 3, 16)
  r = one_region(attention_tokens_major, q, k, v)
  inputs = set(r.region.input_names)
  pv = r.region.contractions[1]
  assert pv.lhs not in inputs and pv.rhs in inputs
  from jaxfuse.codegen.triton_printer import print_kernel  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  best = plan_region(r.region, "h100", use_cache=False).best
  src = print_kernel(r.region, best).source
  assert "tl.dot(" in src and "tl.trans(acc" not in src, src
  check_region_matches_jaxpr(r)


@pytest.mark.parametrize("act1,act2", [("relu", "gelu_tanh"), ("gelu_erf", "silu"),
                                       ("tanh", "relu")])
def test_mlp3(act1, act2):
  x, w1, w2, w3 = rand(2, 9, 8), rand(8, 24), rand(24, 16), rand(16, 5)
  r = one_region(lambda *a: mlp3(*a, ACTS[act1], ACTS[act2]), x, w1, w2, w3)
  # b and m are both M loops of every contraction, contiguous: one loop m (ir.coalesce_loops)
  assert r.region.loop_extents == {"m": 18, "k": 8, "n": 24, "p": 16, "h": 5}
  assert len(r.region.contractions) == 3
  check_region_matches_jaxpr(r)


def test_mlp_inside_scan():
  x, w1, w2 = rand(4, 8), rand(8, 16), rand(16, 8)
  r = one_region(mlp_scan, x, w1, w2)
  assert r.path == "scan/body"
  assert r.region.loop_extents == {"m": 4, "k": 8, "n": 16, "h": 8}
  check_region_matches_jaxpr(r)


def test_mlp_inside_checkpoint():
  x, w1, w2, w3 = rand(4, 8), rand(8, 16), rand(16, 8), rand(8, 3)
  r = one_region(mlp_checkpoint, x, w1, w2, w3)
  assert r.path == "remat"
  assert len(r.region.contractions) == 3
  check_region_matches_jaxpr(r)


def test_while_and_cond_bodies():
  def f(x, w):
    y = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: ((c[0] @ w) @ w, c[1] + 1), (x, 0))[0]
    z = jax.lax.cond(x.sum() > 0, lambda x: jax.nn.relu(x @ w) @ w, lambda x: x, x)
    return y + z
  rs = regions_of(f, rand(8, 8), rand(8, 8))
  assert sorted(r.path for r in rs) == ["cond/branch1", "while/body"]
  for r in rs:
    check_region_matches_jaxpr(r)


def test_custom_vjp_body_region_keeps_rule():
  @jax.custom_vjp
  def attn(q, k, v):
    return attention(q, k, v)
  attn.defvjp(lambda q, k, v: (attn(q, k, v), (q, k, v)),
              lambda res, g: tuple(jnp.full_like(x, 3.0) for x in res))
  q, k, v = _qkv()
  closed = jax.make_jaxpr(lambda *a: attn(*a) * 2)(q, k, v)
  [r] = capture.find_regions(closed)
  # Absorbed whole (with the "* 2" epilogue): the region's own ops keep the call.
  assert "custom_vjp_call" in str(r.jaxpr)
  new = capture.rewrite(closed, lambda cap, *xs: jaxpr_as_fun(cap.jaxpr)(*xs))
  assert "custom_vjp_call" in str(new)
  g = jax.grad(lambda *a: jaxpr_as_fun(new)(*a)[0].sum(), argnums=(0, 1, 2))(q, k, v)
  for x in g:
    np.testing.assert_array_equal(np.asarray(x), 3.0)


def test_extra_output_and_const_input():
  w = np.asarray(RNG.standard_normal((8, 6)), np.float32)

  def f(q, k, v):
    s = q @ jnp.swapaxes(k, -1, -2)
    return jax.nn.softmax(s, -1) @ v, s.sum(), jnp.tanh(v[0] @ w) @ jnp.transpose(w)
  q, k, v = rand(2, 5, 8), rand(2, 6, 8), rand(2, 6, 8)
  rs = regions_of(f, q, k, v)
  assert len(rs) == 2
  attn_r = next(r for r in rs if len(r.region.outputs) == 2)
  outs = {attn_r.region.value(b.value).loops for b in attn_r.region.outputs}
  assert outs == {("b", "m", "n"), ("b", "m", "h")}
  const_r = next(r for r in rs if r is not attn_r)
  # The closed-over array is read twice with different index maps (two
  # buffers, so that no loop is both reduced and kept); v[0] is a window
  # read in place from v.
  assert [b.shape for b in const_r.region.inputs] == [(2, 6, 8), (8, 6), (8, 6)]
  assert len(const_r.region.loops) == 4
  for r in rs:
    check_region_matches_jaxpr(r)
  _check_rewrite(f, q, k, v, expect_calls=2)


def test_a_result_read_through_one_transpose_is_written_transposed():
  """A middle result the program reads only through a transpose is stored
  in the transpose's layout (XLA would copy it); one it also reads as is
  stays in its own."""
  def f(a, b, d, both=False):
    c = jnp.exp(a @ b)
    return (c @ d, c.T) + ((c,) if both else ())
  a, b, d = rand(40, 24), rand(24, 20), rand(20, 12)
  r = one_region(f, a, b, d)
  c = next(buf for buf in r.region.outputs if r.region.value(buf.value).loops == ("m", "n"))
  assert c.shape == (20, 40) and dict(c.strides) == {"n": 40, "m": 1}
  check_region_matches_jaxpr(r)
  transposes = lambda r: [e for e in r.jaxpr.jaxpr.eqns if e.primitive.name == "transpose"]
  assert len(transposes(r)) == 1   # the region replaces it
  _check_rewrite(f, a, b, d, expect_calls=1)
  g = lambda *xs: f(*xs, both=True)
  r = one_region(g, a, b, d)
  assert [buf.shape for buf in r.region.outputs if buf.shape != (40, 12)] == [(40, 20)]
  assert not transposes(r)
  _check_rewrite(g, a, b, d, expect_calls=1)


def test_dead_code_is_not_a_reader_but_effects_are():
  """An intermediate that only dead equations read (``jax.grad`` leaves
  such: the JVP of ``reduce_max`` compares its input with the maximum) is
  not written by the region; one read by an effect (a debug callback) is."""
  def f(a, b, d, effect=False):
    t = jnp.tanh(a @ b)
    dead = jnp.sum(t * 3.0)  # pylint: disable=unused-variable
    if effect:
      jax.debug.callback(lambda x: None, t)
    return t @ d
  a, b, d = rand(8, 16), rand(16, 32), rand(32, 4)
  closed = jax.make_jaxpr(f)(a, b, d)
  assert any(e.primitive.name == "reduce_sum" for e in closed.jaxpr.eqns)
  r = one_region(f, a, b, d)
  assert len(r.region.outputs) == 1
  assert r.region.value(r.region.outputs[0].value).loops == ("m", "h")
  check_region_matches_jaxpr(r)
  new = _check_rewrite(f, a, b, d, expect_calls=1)
  assert all(e.primitive.name != "reduce_sum" for e in new.jaxpr.eqns)
  g = lambda *xs: f(*xs, effect=True)
  r = one_region(g, a, b, d)
  assert len(r.region.outputs) == 2
  closed = jax.make_jaxpr(g)(a, b, d)
  new = capture.rewrite(closed, lambda cap, *xs: jaxpr_as_fun(cap.jaxpr)(*xs))
  assert new is not closed and "debug_callback" in str(new)


def test_prologue_scale_and_epilogue():
  def f(q, k, v, bias):
    s = (q * 0.5) @ jnp.swapaxes(k, -1, -2).astype(jnp.float32)
    return jax.nn.relu(jax.nn.softmax(s, -1) @ v + bias).astype(jnp.bfloat16)
  q, k, v, bias = rand(2, 5, 8), rand(2, 6, 8), rand(2, 6, 4), rand(4)
  r = one_region(f, q, k, v, bias)
  assert [b.shape for b in r.region.inputs] == [(2, 5, 8), (2, 6, 8), (2, 6, 4), (4,)]
  assert r.region.value(r.region.outputs[0].value).dtype == "bfloat16"
  assert r.region.inputs[3].strides == (("h", 1),)
  check_region_matches_jaxpr(r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_narrowing_cast_read_elsewhere_stays_outside(read_elsewhere):
  # A float32 -> float16 cast of the chain's input is absorbed when the
  # region is its only reader (the kernel reads float32 once). When another
  # op reads the float16 value too, XLA writes it anyway, so the region must
  # read that half-size copy rather than the float32 operand.
  def f(x, w1, w2):
    h = x.astype(jnp.float16)
    y = jax.nn.relu(h @ w1) @ w2
    return (y, h + 1) if read_elsewhere else y
  x = rand(8, 16)
  w1, w2 = rand(16, 32, dtype=jnp.float16), rand(32, 16, dtype=jnp.float16)
  r = one_region(f, x, w1, w2)
  want = "float16" if read_elsewhere else "float32"
  assert r.region.value(r.region.inputs[0].value).dtype == want
  assert any(getattr(op, "fn", None) == "convert" for op in r.region.ops) == (not read_elsewhere)
  check_region_matches_jaxpr(r, rtol=1e-2, atol=1e-2)
  _check_rewrite(f, x, w1, w2, expect_calls=1)


def test_chain_reading_inside_a_neighbour_tries_its_parts():
  # A transformer layer whose residual input is a plain argument: one chain
  # runs from the attention through the output projection, LayerNorm and
  # MLP. Its output-projection region reads the attention's result before
  # the layout ops the attention region takes, so it is dropped; its
  # shorter parts (projection + LayerNorm + up projection) must still be
  # captured.
  def layer(x, q, k, v, wo, w1, w2):
    t, d = x.shape
    p = jax.nn.softmax(jnp.einsum("hqd,hkd->hqk", q, k), axis=-1)
    o = jnp.einsum("hqk,hkd->hqd", p, v).transpose(1, 0, 2).reshape(t, d)
    y = (x + o @ wo).astype(jnp.float32)
    mu = y.mean(-1, keepdims=True)
    h = ((y - mu) * jax.lax.rsqrt(jnp.square(y - mu).mean(-1, keepdims=True) + 1e-6))
    return jax.nn.gelu(h.astype(x.dtype) @ w1, approximate=False) @ w2

  f16 = jnp.float16
  args = [rand(16, 8, dtype=f16)] + [rand(2, 16, 4, dtype=f16, scale=0.5) for _ in range(3)] + [
      rand(8, 8, dtype=f16, scale=0.3), rand(8, 32, dtype=f16, scale=0.3),
      rand(32, 8, dtype=f16, scale=0.2)]
  rs = regions_of(layer, *args)
  assert [r.region.einsum_summary() for r in rs] == [
      "bmk,bnk->bmn ; bmn,bnh->bmh", "mk,kn->mn ; mn,nh->mh"], [r.region for r in rs]
  for r in rs:
    check_region_matches_jaxpr(r, rtol=2e-2, atol=2e-2)
  _check_rewrite(layer, *args, expect_calls=2)


# --------------------------------------------------------------------------
# Nothing captured
# --------------------------------------------------------------------------

NOTHING = {
    "single_matmul": (lambda a, b: a @ b, [(4, 8), (8, 3)]),
    "matmul_bias_relu": (lambda a, b, c: jax.nn.relu(a @ b + c), [(4, 8), (8, 3), (3,)]),
    "two_independent": (lambda a, b, c, d: (a @ b, c @ d), [(4, 8), (8, 3), (4, 8), (8, 3)]),
    "sort_between": (lambda a, b, d: jnp.sort(a @ b, axis=-1) @ d, [(4, 8), (8, 3), (3, 5)]),
    "gather_between": (lambda a, b, d: jnp.take(a @ b, jnp.array([2, 0, 1]), axis=0) @ d,
                       [(4, 8), (8, 3), (3, 5)]),
    "cumsum_between": (lambda a, b, d: jnp.cumsum(a @ b, axis=-1) @ d, [(4, 8), (8, 3), (3, 5)]),
}


@pytest.mark.parametrize("name", sorted(NOTHING))
def test_nothing_captured(name):
  f, shapes = NOTHING[name]
  args = [rand(*s) for s in shapes]
  assert regions_of(f, *args) == []
  _check_rewrite(f, *args, expect_calls=0)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.complex64])
def test_unsupported_dtypes_not_captured(dtype):
  a = jnp.asarray(RNG.integers(-3, 3, (4, 8)), dtype)
  b = jnp.asarray(RNG.integers(-3, 3, (8, 3)), dtype)
  d = jnp.asarray(RNG.integers(-3, 3, (3, 5)), dtype)
  assert regions_of(gemm_chain, a, b, d) == []


def test_bad_arguments():
  with pytest.raises(TypeError, match="closed_jaxpr"):
    capture.find_regions(lambda x: x)
  closed = jax.make_jaxpr(gemm_chain)(rand(2, 3), rand(3, 4), rand(4, 5))
  with pytest.raises(TypeError, match="bind_region"):
    capture.rewrite(closed, None)


# --------------------------------------------------------------------------
# rewrite
# --------------------------------------------------------------------------

def _check_rewrite(f, *args, expect_calls=None):
  closed = jax.make_jaxpr(f)(*args)
  calls = []

  def bind_original(cap, *xs):
    calls.append(cap)
    assert len(xs) == len(cap.region.inputs)
    for x, b in zip(xs, cap.region.inputs):
      assert tuple(x.shape) == tuple(b.shape)
    return jaxpr_as_fun(cap.jaxpr)(*xs)

  want = jaxpr_as_fun(closed)(*args)
  new = capture.rewrite(closed, bind_original)
  if expect_calls is not None:
    assert len(calls) == expect_calls
  got = jaxpr_as_fun(new)(*args)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
  jit_want = jax.jit(f)(*args)
  jit_got = jax.jit(jaxpr_as_fun(new))(*args)
  for w, g in zip(jax.tree_util.tree_leaves(jit_want), jit_got):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
  # bind_region returning None: the same computation (the input itself).
  assert capture.rewrite(closed, lambda cap, *xs: None) is closed
  return new


REWRITE_CASES = {
    "gemm_chain": (gemm_chain, [(3, 10, 7), (3, 7, 12), (3, 12, 5)]),
    "attention_causal": (attention_causal, [(2, 9, 8), (2, 9, 8), (2, 9, 4)]),
    "attention_bthd": (attention_bthd, [(2, 7, 2, 8), (2, 5, 2, 8), (2, 5, 2, 8)]),
    "mlp_scan": (mlp_scan, [(4, 8), (8, 16), (16, 8)]),
    "mlp_checkpoint": (mlp_checkpoint, [(4, 8), (8, 16), (16, 8), (8, 3)]),
}


@pytest.mark.parametrize("name", sorted(REWRITE_CASES))
def test_rewrite_with_original_ops_is_identical(name):
  f, shapes = REWRITE_CASES[name]
  _check_rewrite(f, *[rand(*s) for s in shapes], expect_calls=1)


def test_rewrite_replaces_region_and_keeps_unabsorbed_custom_jvp():
  def f(x, w1, w2, w3):
    y = jax.nn.relu(x @ w3)          # single matmul: its relu stays a custom_jvp_call
    return jnp.tanh(jax.nn.relu(x @ w1) @ w2), y
  args = rand(4, 8), rand(8, 16), rand(16, 6), rand(8, 6)
  closed = jax.make_jaxpr(f)(*args)
  seen = []

  def bind_zeros(cap, *xs):
    seen.append(cap)
    return [jnp.zeros(b.shape, a.dtype) for b, a in zip(cap.region.outputs, cap.jaxpr.out_avals)]

  text = str(capture.rewrite(closed, bind_zeros))
  assert len(seen) == 1
  assert text.count("custom_jvp_call") == 1      # the unabsorbed relu, still a custom call
  assert text.count("dot_general") == 1
  new = capture.rewrite(closed, lambda cap, *xs: jaxpr_as_fun(cap.jaxpr)(*xs))
  g0 = jax.grad(lambda *a: jaxpr_as_fun(closed)(*a)[0].sum(), argnums=(0, 1))(*args)
  g1 = jax.grad(lambda *a: jaxpr_as_fun(new)(*a)[0].sum(), argnums=(0, 1))(*args)
  for a, b in zip(g0, g1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_rewrite_region_call_replaces_ops():
  """A bind_region that computes something else shows where regions are."""
  q, k, v = _qkv()

  def f(q, k, v):
    return attention(q, k, v) + 1.0
  closed = jax.make_jaxpr(f)(q, k, v)

  def bind(cap, *xs):
    return [jnp.zeros(b.shape, cap.jaxpr.out_avals[i].dtype)
            for i, b in enumerate(cap.region.outputs)]
  new = capture.rewrite(closed, bind)
  assert "dot_general" not in str(new) and "exp" not in str(new)
  # The "+ 1.0" is the region's epilogue, replaced too.
  np.testing.assert_array_equal(np.asarray(jaxpr_as_fun(new)(q, k, v)[0]), 0.0)


def test_vmapped_heads_and_jitted_helper():
  def per_head(q, k, v):
    return jax.nn.softmax(q @ k.T / 3.0) @ v

  def heads(q, k, v):   # [B, T, H, D] through two vmaps
    return jax.vmap(jax.vmap(per_head, in_axes=(1, 1, 1), out_axes=1))(q, k, v)

  r = one_region(heads, rand(2, 5, 3, 4), rand(2, 6, 3, 4), rand(2, 6, 3, 4))
  assert sorted(r.region.loop_extents.values()) == [2, 3, 4, 4, 5, 6]
  check_region_matches_jaxpr(r)

  def helper_twice(x, w1, w2):
    h = jax.jit(lambda a, b: jax.nn.relu(a @ b))
    return h(h(x, w1), w2) @ w1.T
  r = one_region(helper_twice, rand(4, 8), rand(8, 8), rand(8, 8))
  assert len(r.region.contractions) == 3
  check_region_matches_jaxpr(r)
  _check_rewrite(helper_twice, rand(4, 8), rand(8, 8), rand(8, 8), expect_calls=1)


def test_non_affine_prologue_becomes_an_input():
  def f(a, b, d):
    a2 = a.reshape(6, 4)       # [4, 6] -> [6, 4]: not a split/merge of dims
    return jnp.tanh(a2 @ b) @ d
  r = one_region(f, rand(4, 6), rand(4, 5), rand(5, 3))
  assert [b.shape for b in r.region.inputs] == [(6, 4), (4, 5), (5, 3)]
  check_region_matches_jaxpr(r)


@pytest.mark.parametrize("custom_jvp", [False, True])
@pytest.mark.parametrize("use_where", [False, True])
def test_softmax_as_custom_jvp_call(custom_jvp, use_where):
  """jax >= 0.11 emits jax.nn.softmax as a custom_jvp_call; absorb it whole."""
  try:
    old = jax.config.jax_softmax_custom_jvp
  except AttributeError:
    pytest.skip("this jax has no softmax_custom_jvp flag")
  q, k, v = _qkv()
  mask = rand(2, 12, 10) > -0.5

  def f(q, k, v, mask):
    s = jnp.einsum("bqd,bkd->bqk", q, k)
    p = jax.nn.softmax(s, -1, where=mask) if use_where else jax.nn.softmax(s, -1)
    return jnp.einsum("bqk,bkd->bqd", p, v)
  jax.config.update("jax_softmax_custom_jvp", custom_jvp)
  try:
    closed = jax.make_jaxpr(f)(q, k, v, mask)
    assert ("custom_jvp_call" in str(closed)) == custom_jvp
    [r] = capture.find_regions(closed)
    assert r.region.einsum_summary() == "bmk,bnk->bmn ; bmn,bnh->bmh"
    check_region_matches_jaxpr(r)
    if custom_jvp:
      assert "custom_jvp_call" in str(r.jaxpr)     # the rule travels with the region
    new = _check_rewrite(f, q, k, v, mask, expect_calls=1)
    g0 = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v, mask)
    g1 = jax.grad(lambda *a: jaxpr_as_fun(new)(*a)[0].sum(), argnums=(0, 1, 2))(q, k, v, mask)
    for a, b in zip(g0, g1):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  finally:
    jax.config.update("jax_softmax_custom_jvp", old)


def test_rewrite_bodies_with_constants_from_bind_region():
  """bind_region results that close over arrays become body constants: they
  are hoisted into scan/while/cond/remat operands."""
  def f(x, w):
    def body(c, _):
      return jnp.tanh(c @ w) @ w, None
    a, _ = jax.lax.scan(body, x, None, length=2)
    b = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: ((c[0] @ w) @ w, c[1] + 1), (x, 0))[0]
    c = jax.lax.cond(x.sum() > 0, lambda x: jax.nn.relu(x @ w) @ w, lambda x: x, x)
    d = jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w)(x)
    return a + b + c + d
  x, w = rand(8, 8), rand(8, 8, scale=0.3)
  closed = jax.make_jaxpr(f)(x, w)
  offset = np.full((8, 8), 0.5, np.float32)   # a numpy array: a jaxpr constant
  seen = []

  def bind(cap, *xs):
    seen.append(cap.path)
    return [o + offset for o in jaxpr_as_fun(cap.jaxpr)(*xs)]
  new = capture.rewrite(closed, bind)
  assert sorted(seen) == ["cond/branch1", "remat", "scan/body", "while/body"]

  def g(x, w):   # the same program with the offset written in
    def body(c, _):
      return jnp.tanh(c @ w) @ w + offset, None
    a, _ = jax.lax.scan(body, x, None, length=2)
    b = jax.lax.while_loop(lambda c: c[1] < 2,
                           lambda c: ((c[0] @ w) @ w + offset, c[1] + 1), (x, 0))[0]
    c = jax.lax.cond(x.sum() > 0, lambda x: jax.nn.relu(x @ w) @ w + offset, lambda x: x, x)
    d = jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w + offset)(x)
    return a + b + c + d
  np.testing.assert_allclose(np.asarray(jaxpr_as_fun(new)(x, w)[0]), np.asarray(g(x, w)),
                             rtol=1e-5, atol=1e-5)


def test_transformer_layer_captures_attention_between_projections():
  """In a full layer (biased Q/K/V projections split into heads, attention,
  merge, output projection), the chain runs through the softmax: the V
  projection is an input of the second contraction, not its predecessor."""
  heads, T, D = 2, 8, 16
  dh = D // heads

  def layer(x, wq, bq, wk, bk, wv, bv, wo):
    def split(t):
      return t.reshape(T, heads, dh).transpose(1, 0, 2)
    q, k, v = split(x @ wq + bq), split(x @ wk + bk), split(x @ wv + bv)
    p = jax.nn.softmax(jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(dh), axis=-1)
    o = jnp.einsum("hqk,hkd->hqd", p, v).transpose(1, 0, 2).reshape(T, D)
    return o @ wo

  rng = np.random.default_rng(0)
  args = [rng.normal(size=s).astype(np.float32)
          for s in [(T, D), (D, D), (D,), (D, D), (D,), (D, D), (D,), (D, D)]]
  regions = capture.find_regions(jax.make_jaxpr(layer)(*args))
  summaries = [r.region.einsum_summary() for r in regions]
  assert any(len(r.region.contractions) == 2 and
             any(isinstance(op, ir.Reduction) for op in r.region.ops)
             for r in regions), summaries
  for r in regions:  # every region still computes what its ops compute
    xs = [rng.normal(size=s).astype(np.float32) for s in ir.operand_shapes(r.region.inputs)]
    want = jaxpr_as_fun(r.jaxpr)(*xs)
    got = ir.evaluate(r.region, xs)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# Dot precision (float32 operands)
# --------------------------------------------------------------------------

def _precisions(f, *args):
  return [op.precision for op in one_region(f, *args).region.contractions]


@pytest.mark.parametrize("precision, want", [
    (None, "default"), ("default", "default"), ("high", "default"),
    ("tensorfloat32", "default"), ("highest", "ieee"), ("float32", "ieee"),
    ((jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT), "ieee"),
    ("TF32_TF32_F32", "default"), ("TF32_TF32_F32_X3", "tf32x3"), ("F32_F32_F32", "ieee"),
    ("BF16_BF16_F32", "default")])
def test_float32_dot_precision_is_recorded(precision, want):
  a, b, d = rand(2, 40, 24), rand(2, 24, 20), rand(2, 20, 16)
  f = lambda a, b, d: jnp.matmul(jnp.matmul(a, b, precision=precision), d, precision=precision)
  assert _precisions(f, a, b, d) == [want, want]


def test_16_bit_dot_algorithms_round_a_float32_operand_first():
  """A dot whose algorithm multiplies float16 rounds a float32 operand to
  float16 first, as XLA does (autodiff's transpose of attention's float16
  scores with a float32 result multiplies the float32 ds by float16 q and
  k): the region's contraction is float16 by float16."""
  rng = np.random.default_rng(7)
  a = jnp.asarray(rng.standard_normal((2, 40, 24)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((2, 24, 20)), jnp.float16)
  d = jnp.asarray(rng.standard_normal((2, 20, 16)), jnp.float16)
  alg = jax.lax.DotAlgorithmPreset.F16_F16_F32

  def f(a, b, d):
    x = jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), precision=alg,
                            preferred_element_type=jnp.float32)
    return jax.lax.dot_general(jnp.tanh(x), d, (((2,), (1,)), ((0,), (0,))), precision=alg,
                               preferred_element_type=jnp.float32)
  r = one_region(f, a, b, d).region
  for c in r.contractions:
    assert (r.value(c.lhs).dtype, r.value(c.rhs).dtype, c.precision) == (
        "float16", "float16", "default")
  # Evaluated rounding each value to its dtype: as the operands rounded to
  # float16 and multiplied exactly, not as the float32 ones.
  [got] = ir.evaluate(r, [np.asarray(a), np.asarray(b), np.asarray(d)], precision="native")
  f64 = lambda x, dt=np.float64: np.asarray(x).astype(dt).astype(np.float64)
  x = np.tanh(f64(a, np.float16) @ f64(b)).astype(np.float32)
  want = f64(x, np.float16) @ f64(d)
  unrounded = f64(np.tanh(f64(a) @ f64(b))) @ f64(d)
  err = lambda y: np.linalg.norm(got - y) / np.linalg.norm(y)
  assert err(want) < 2e-5 < 1e-4 < err(unrounded), (err(want), err(unrounded))


def test_default_matmul_precision_config_reaches_the_region():
  a, b, d = rand(2, 40, 24), rand(2, 24, 20), rand(2, 20, 16)
  with jax.default_matmul_precision("float32"):
    assert _precisions(gemm_chain, a, b, d) == ["ieee", "ieee"]
  assert _precisions(gemm_chain, a, b, d) == ["default", "default"]


def test_precision_of_16_bit_dots_is_normalized_and_keys_the_region():
  a, b, d = (rand(2, 40, 24, dtype=jnp.float16), rand(2, 24, 20, dtype=jnp.float16),
             rand(2, 20, 16, dtype=jnp.float16))
  exact = lambda a, b, d: jnp.matmul(jnp.matmul(a, b, precision="highest"), d,
                                     precision="highest")
  assert _precisions(exact, a, b, d) == ["default", "default"]
  assert one_region(exact, a, b, d).region.signature() == \
      one_region(gemm_chain, a, b, d).region.signature()
  # float32: the same chain at another precision is another region (plan cache
  # key), and its text says which.
  a32, b32, d32 = (x.astype(jnp.float32) for x in (a, b, d))
  r_exact = one_region(exact, a32, b32, d32).region
  r_fast = one_region(gemm_chain, a32, b32, d32).region
  assert r_exact.signature() != r_fast.signature()
  assert "precision=ieee" in r_exact.to_text() and "precision=" not in r_fast.to_text()


def test_dot_algorithms_a_triton_dot_cannot_compute_are_left_to_xla():
  from jaxfuse import capture_ir  # pylint: disable=g-import-not-at-top
  for preset in ("F64_F64_F64", "ANY_F8_ANY_F8_F32"):
    with pytest.raises(capture_ir.Reject, match="dot algorithm"):
      capture_ir.dot_precision(getattr(jax.lax.DotAlgorithmPreset, preset),
                               ["float32", "float32"])
  with pytest.raises(capture_ir.Reject, match="dot precision"):
    capture_ir.dot_precision(("fastest-ever", None), ["float32", "float32"])
  r = one_region(gemm_chain, rand(2, 8, 8), rand(2, 8, 8), rand(2, 8, 8)).region
  with pytest.raises(ir.IRError, match="precision 'tf64'"):
    ir.Region(r.loops, r.values, r.inputs, r.outputs,
              (dataclasses.replace(r.ops[0], precision="tf64"), *r.ops[1:]))


# --------------------------------------------------------------------------
# Static windows of an input are read in place
# --------------------------------------------------------------------------

def packed_attention(qkv):
  """qkv [b, t, 3*h*d]: jnp.split into q, k, v, then 4 heads of 8."""
  q, k, v = jnp.split(qkv, 3, axis=-1)
  b, t, _ = q.shape
  q, k, v = (x.reshape(b, t, 4, 8).transpose(0, 2, 1, 3) for x in (q, k, v))
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 8.0
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)


def windowed_chain(x, w1, w2):
  return (x[:, 8:40, 4:28] @ w1) @ w2


def test_split_windows_are_offsets_into_the_packed_input():
  qkv = rand(2, 12, 96)
  r = one_region(packed_attention, qkv)
  # One input buffer per window, each the whole packed array at its offset.
  assert [b.shape for b in r.region.inputs] == [(2, 12, 96)] * 3
  assert [b.offset for b in r.region.inputs] == [0, 32, 64]
  assert r.same_as == (0, 0, 0)
  q = r.region.inputs[0]
  assert q.stride("b") == 12 * 96 and q.stride("m") == 96 and q.stride("k") == 1
  assert q.stride("g") == 8
  # The rewritten program passes the packed array itself: no split left.
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(packed_attention)(qkv).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  check_region_matches_jaxpr(r)


def test_slice_window_reads_the_input_in_place():
  x, w1, w2 = rand(3, 48, 32), rand(24, 16), rand(16, 8)
  r = one_region(windowed_chain, x, w1, w2)
  xb = r.region.inputs[0]
  assert xb.shape == (3, 48, 32) and xb.offset == 8 * 32 + 4
  assert r.region.loop_extents["m"] == 32 and r.region.loop_extents["k"] == 24
  check_region_matches_jaxpr(r)


def test_window_of_an_input_the_region_reads_whole_stays_a_copy():
  # The second dot reads x whole: the window stays XLA's slice, as before.
  def f(x, w):
    return (x[:, :, :16] @ w) @ x
  x, w = rand(2, 16, 32), rand(16, 16)
  r = one_region(f, x, w)
  assert all(b.offset == 0 for b in r.region.inputs)
  assert [b.shape for b in r.region.inputs] == [(2, 16, 16), (16, 16), (2, 16, 32)]
  check_region_matches_jaxpr(r)


def test_two_windows_of_one_input():
  def f(x, w):
    return (x[:, :8] @ w) @ x[:, 8:, :8]
  x, w = rand(2, 16, 16), rand(16, 8)
  r = one_region(f, x, w)
  offs = sorted(b.offset for b in r.region.inputs if b.shape == (2, 16, 16))
  assert offs == [0, 8 * 16]
  check_region_matches_jaxpr(r)


def test_strided_slice_is_not_a_window():
  x, w1, w2 = rand(2, 48, 16), rand(16, 16), rand(16, 8)
  r = one_region(lambda x, w1, w2: (x[:, ::2] @ w1) @ w2, x, w1, w2)
  assert [b.shape for b in r.region.inputs][0] == (2, 24, 16)
  check_region_matches_jaxpr(r)


def test_batched_activations_times_a_weight_coalesce_into_one_m_loop():
  """``x[b,m,k] @ w[k,n]`` (jnp.matmul of a [B, T, D] array) has two M loops,
  b and m; Triton's dot takes one, so without merging them the kernel was a
  broadcast product that took minutes to compile. Contiguous b and m merge
  (also through a window of x); a transposed activation whose output is
  not laid out alike keeps both loops, and an attention's batch loops (in
  both operands) are left alone."""
  rng = np.random.default_rng(0)

  def chain(x, w1, w2):
    return (x @ w1) @ w2

  def windowed(x, w1, w2):
    return (x[:, :, 8:24] @ w1) @ w2

  def transposed(x, w1, w2):
    return (x.transpose(1, 0, 2) @ w1) @ w2

  w1 = jnp.asarray(rng.standard_normal((16, 32)) / 4, jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((32, 16)) / 6, jnp.float32)
  for fn, x, merged in ((chain, rng.standard_normal((4, 24, 16)), True),
                        (windowed, rng.standard_normal((4, 24, 40)), True),
                        (transposed, rng.standard_normal((24, 4, 16)), False)):
    x = jnp.asarray(x, jnp.float32)
    (cap,) = capture.find_regions(jax.make_jaxpr(fn)(x, w1, w2))
    r = cap.region
    c0 = r.contractions[0]
    m_loops = set(r.value_map[c0.lhs].loops) & set(r.value_map[c0.out].loops)
    assert (len(m_loops) == 1) == merged, r
    if merged:
      assert sorted(r.loop_extents.values()) == [16, 16, 32, 96]   # b*m = 4*24
      assert r.einsum_summary() == "mk,kn->mn ; mn,nh->mh"   # the merged rows read as m
    (got,) = ir.evaluate(r, [np.asarray(x), np.asarray(w1), np.asarray(w2)])
    np.testing.assert_allclose(got, np.asarray(jax.jit(fn)(x, w1, w2)), rtol=1e-4, atol=1e-4)

  def attention(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
  q = jnp.zeros((2, 3, 16, 8), jnp.float32)
  (cap,) = capture.find_regions(jax.make_jaxpr(attention)(q, q, q))
  ext = cap.region.loop_extents   # batch loops b and g (heads) in both operands stay apart
  assert sorted(ext.values()) == [2, 3, 8, 8, 16, 16], ext


# --------------------------------------------------------------------------
# Single contractions fused for their epilogue
# --------------------------------------------------------------------------

ACTIVATIONS = {
    "gelu_erf": lambda h: jax.nn.gelu(h, approximate=False),
    "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "none": lambda h: h,
}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_single_contraction_is_a_region_only_when_xla_would_cut_its_epilogue(act):
  """GELU and SiLU read the biased GEMM result twice, so XLA runs them after
  its GEMM in kernels of their own (H100, 2026-11-22): a region. relu, tanh
  and exp fuse into XLA's GEMM: left alone."""
  f = lambda x, w, b: ACTIVATIONS[act](x @ w + b)
  args = (rand(2, 6, 8), rand(8, 12), rand(12))
  rs = regions_of(f, *args)
  if act in ("gelu_erf", "gelu_tanh", "silu"):
    assert len(rs) == 1
    r = rs[0]
    assert len(r.region.contractions) == 1
    assert r.region.einsum_summary() == "mk,kn->mn"   # a lone GEMM's loops read m, n, k
    assert ir.xla_epilogue_split(r.region) is not None
    check_region_matches_jaxpr(r)
    _check_rewrite(f, *args, expect_calls=1)
  else:
    assert rs == []


def test_vector_matrix_dot_is_a_region_even_without_an_epilogue():
  """One row (a decoding step at batch 1) is a vector-matrix product, which
  XLA runs as a reduction and not as a GEMM (H100, sixtieth session: 0.4-0.8
  TB/s): a region with or without an epilogue. Eight rows, or a batch of
  single rows, are XLA's GEMMs: left alone."""
  x1, x8, w, b = rand(1, 64), rand(8, 64), rand(64, 96), rand(96)
  r = one_region(lambda x, w: x @ w, x1, w)
  assert r.region.einsum_summary() == "mk,kn->mn"
  assert ir.xla_vector_dot(r.region, r.region.contractions[0])
  check_region_matches_jaxpr(r)
  _check_rewrite(lambda x, w: x @ w, x1, w, expect_calls=1)
  biased = lambda x, w, b: jnp.maximum(x @ w + b, 0.0)   # relu: XLA fuses it
  r = one_region(biased, x1, w, b)
  assert len(r.region.ops) > 1                            # the epilogue is in it
  check_region_matches_jaxpr(r)
  _check_rewrite(biased, x1, w, b, expect_calls=1)
  # the matrix on the left, one column on the right
  col = one_region(lambda w, v: w.T @ v, w, rand(64, 1))
  assert ir.xla_vector_dot(col.region, col.region.contractions[0])
  assert regions_of(lambda x, w: x @ w, x8, w) == []
  assert regions_of(biased, x8, w, b) == []
  batched = lambda x, w: jnp.einsum("bmk,bkn->bmn", x, w)
  assert regions_of(batched, rand(2, 1, 64), rand(2, 64, 96)) == []


def test_a_one_row_chain_falls_back_to_its_vector_matrix_parts():
  """A three-GEMM MLP at one row: below its length, every GEMM is a part of
  its own (with its bias and activation), none left to XLA's reduction."""
  def mlp(x, w1, b1, w2, b2, w3):
    return jax.nn.relu(jax.nn.gelu(x @ w1 + b1) @ w2 + b2) @ w3
  args = (rand(1, 32), rand(32, 64), rand(64), rand(64, 32), rand(32), rand(32, 16))
  [whole] = regions_of(mlp, *args)
  assert len(whole.region.contractions) == 3
  singles = capture.find_regions(whole.jaxpr, max_contractions=1)
  assert [len(p.region.contractions) for p in singles] == [1, 1, 1]
  for p in singles:
    check_region_matches_jaxpr(p)


def test_max_contractions_captures_the_parts_of_a_chain():
  """An FFN chain is one region; below its length, its first GEMM with the
  GELU is (the second GEMM's epilogue is plain: XLA's)."""
  def ffn(x, w1, b1, w2, b2):
    return jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2
  args = (rand(6, 8), rand(8, 16), rand(16), rand(16, 8), rand(8))
  closed = jax.make_jaxpr(ffn)(*args)
  [whole] = capture.find_regions(closed)
  assert len(whole.region.contractions) == 2
  [part] = capture.find_regions(whole.jaxpr, max_contractions=1)
  assert len(part.region.contractions) == 1
  assert [v.shape for v in part.region.inputs] == [(6, 8), (8, 16), (16,)]
  check_region_matches_jaxpr(part)
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="max_contractions"):
      capture.find_regions(closed, max_contractions=bad)
    with pytest.raises(ValueError, match="max_contractions"):
      capture.rewrite(closed, lambda cap, *xs: None, max_contractions=bad)


def test_closed_over_ranges_are_read_as_iotas():
  """A closed-over ``0, 1, ..., n-1`` vector (``jnp.array(range(n))``, as
  ``jax.nn.dot_product_attention`` builds window masks) becomes an ``iota``
  item; other integer constants stay constants. The rewritten program
  computes what the original does."""
  from jaxfuse.capture_flat import flatten  # pylint: disable=g-import-not-at-top
  ramp, perm = jnp.array(range(8)), jnp.array([0, 2, 1, 3, 4, 5, 6, 7])
  ramp16 = np.arange(5, dtype=np.int16)

  def f(x):
    return x + ramp, x + perm, x[:5] * ramp16

  x = jnp.arange(8, dtype=jnp.int32) * 3
  lvl = flatten(jax.make_jaxpr(f)(x))
  iotas = [it for it in lvl.items if it.prim == "iota"]
  assert sorted(str(it.outvars[0].aval) for it in iotas) == ["int16[5]", "int32[8]"]
  assert [c.aval.shape for c in lvl.constvars] == [(8,)]   # perm
  for got, want in zip(jaxfuse.jit(f)(x), f(x)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sliding_window_mask_of_ranges_is_computed_in_the_region():
  """``jax.nn.dot_product_attention(local_window_size=..)``: the window is
  an index compare inside the region, not a [T, S] mask read from memory."""
  sd = jax.ShapeDtypeStruct((1, 64, 2, 16), np.float32)
  jp = jax.make_jaxpr(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, local_window_size=(8, 0)))(sd, sd, sd)
  [cap] = capture.find_regions(jp)
  assert len(cap.region.inputs) == 3
  assert sum(isinstance(op, ir.Iota) for op in cap.region.ops) == 2


@pytest.mark.parametrize("causal", [False, True])
def test_a_size_1_axis_a_reshape_keeps_is_one_loop(causal):
  """``jax.nn.dot_product_attention`` reshapes q to [B, T, H, 1, D] (a
  group axis): at batch 1 the batch axis keeps its loop through the reshape
  (a size-1 axis at the same cut of the index), so the region is the one of
  batch 2 with b = 1, which ``ir.drop_unit_loops`` then drops. (It had
  lost the batch loop on q's side and kept it on k's: a loop of one operand
  only, which the backward's products could not place.)"""
  def loops(b):
    sd = jax.ShapeDtypeStruct((b, 64, 2, 16), np.float16)
    [cap] = capture.find_regions(jax.make_jaxpr(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal))(sd, sd, sd))
    r = cap.region
    return (r.einsum_summary(), [l.name for l in r.loops],
            sum(isinstance(op, ir.Reduction) for op in r.ops))
  one, two = loops(1), loops(2)
  assert two[0] == "bmgk,bngk->bgmn ; bgmn,bngh->bghm" and one[2] == two[2] == 2
  assert one[0] == two[0].replace("b", "") and one[1] == [l for l in two[1] if l != "b"]


def test_one_arange_read_as_rows_and_columns_is_two_loops():
  """``i = jnp.arange(T); i[:, None] >= i[None, :]`` (a causal mask from one
  range, as users write it) reads one iota as the query and as the key
  index. Each reader gets its own iota, so the mask is compares the kernel
  computes: before, the region was refused with its mask ops and read a
  [B, H, T, T] boolean mask and a [B, H, T, T] float32 -inf fill that XLA
  wrote."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top

  def attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    i = jnp.arange(q.shape[1])
    s = jnp.where((i[:, None] >= i[None, :])[None, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
  x = jax.ShapeDtypeStruct((2, 64, 2, 16), np.float32)
  [cap] = capture.find_regions(jax.make_jaxpr(attend)(x, x, x))
  r = cap.region
  assert [b.operand_shape for b in r.inputs] == [(2, 64, 2, 16)] * 3
  [(loop, band)] = streaming.masked_tile_relations(r).items()
  assert loop == "n" and (band.lower, band.upper) == (None, 0)
  got = jaxfuse.jit(attend)(*[np.random.default_rng(i).standard_normal(x.shape, np.float32)
                              for i in range(3)])
  want = jax.jit(attend)(*[np.random.default_rng(i).standard_normal(x.shape, np.float32)
                           for i in range(3)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_row_reduction_joins_an_epilogue_only_where_it_narrows_the_outputs():
  """rowsum over a product's key axis keeps the [M, N] product off memory:
  the region takes it (and writes [M]). A LayerNorm after a GEMM writes a
  value as large as the GEMM's anyway: its reductions stay outside, as
  before. A sum over both operands' axes (a loss) crosses programs: not
  taken."""
  a, b = rand(2, 128, 64, dtype=jnp.float16), rand(2, 128, 64, dtype=jnp.float16)
  c, d = rand(2, 128, 64, dtype=jnp.float16), rand(2, 128, 64, dtype=jnp.float16)

  def rows(a, b, c, d):
    s = jnp.einsum("bmk,bnk->bmn", a, b).astype(jnp.float32)
    p = jnp.einsum("bmk,bnk->bmn", c, d).astype(jnp.float32)
    return jnp.sum(jnp.exp(s) * p, axis=-1)
  [r] = capture.find_regions(jax.make_jaxpr(rows)(a, b, c, d))
  assert [b.shape for b in r.region.outputs] == [(2, 128)]
  assert any(isinstance(op, ir.Reduction) for op in r.region.ops)

  def loss(a, b, c, d):
    s = jnp.einsum("bmk,bnk->bmn", a, b).astype(jnp.float32)
    return jnp.sum(jnp.exp(s) * jnp.einsum("bmk,bnk->bmn", c, d))
  for r in capture.find_regions(jax.make_jaxpr(loss)(a, b, c, d)):
    assert not any(isinstance(op, ir.Reduction) for op in r.region.ops)

  x, w = rand(256, 128, dtype=jnp.float16), rand(128, 128, dtype=jnp.float16)

  def ln(x, w):
    h = jax.nn.gelu(x @ w).astype(jnp.float32)
    m = h.mean(-1, keepdims=True)
    return (h - m) * jax.lax.rsqrt(((h - m) ** 2).mean(-1, keepdims=True) + 1e-5)
  for r in capture.find_regions(jax.make_jaxpr(ln)(x, w)):
    assert not any(isinstance(op, ir.Reduction) for op in r.region.ops)


def test_an_epilogue_stops_where_the_region_writes_the_fewest_bytes():
  """A LayerNorm-backward-like epilogue (float32 products that XLA sums
  outside) is cut back to the chain's float16 result: XLA fuses those
  products into its reductions, so writing them (two float32 arrays where
  one float16 suffices) only adds traffic. What the program returns, or a
  dot outside reads, is written either way and stays in the region; an
  epilogue that writes no more than its GEMM's result (GELU) stays too."""
  a, b = rand(64, 32, dtype=jnp.float16), rand(32, 48, dtype=jnp.float16)
  d, res = rand(48, 40, dtype=jnp.float16), rand(64, 40, dtype=jnp.float16)
  s1, s2 = rand(64, 40), rand(64, 40)

  def reduced(a, b, d, res, s1, s2):
    y = ((a @ b) @ d + res).astype(jnp.float32)
    return (y * s1).sum(), (y * s2 * 3.0).sum()
  r = one_region(reduced, a, b, d, res, s1, s2)
  outs = [(buf.shape, r.region.value(buf.value).dtype) for buf in r.region.outputs]
  assert outs == [((64, 40), "float16")]
  assert [buf.shape for buf in r.region.inputs] == [(64, 32), (32, 48), (48, 40), (64, 40)]
  check_region_matches_jaxpr(r, rtol=1e-2, atol=1e-2)
  _check_rewrite(reduced, a, b, d, res, s1, s2, expect_calls=1)

  def returned(a, b, d, res, s1, s2):
    y = ((a @ b) @ d + res).astype(jnp.float32)
    return y * s1, (y * s2).sum()
  r = one_region(returned, a, b, d, res, s1, s2)
  outs = [(buf.shape, r.region.value(buf.value).dtype) for buf in r.region.outputs]
  # y * s1 is returned (written either way), so the cast to y stays; from
  # y on, writing y * s2 costs what writing y would: the epilogue stays.
  assert outs == [((64, 40), "float32"), ((64, 40), "float32")]
  assert sum(isinstance(op, ir.Elementwise) and op.fn == "mul" for op in r.region.ops) == 2
  check_region_matches_jaxpr(r, rtol=1e-2, atol=1e-2)

  w = rand(40, 8)

  def dotted(a, b, d, res, s1, w):
    y = ((a @ b) @ d + res).astype(jnp.float32) * s1
    return jnp.tanh(y) @ w, y.sum()
  rs = regions_of(dotted, a, b, d, res, s1, w)
  assert any(r.region.value(buf.value).dtype == "float32"
             for r in rs for buf in r.region.outputs)

  x, wg, bg = rand(32, 64, dtype=jnp.float16), rand(64, 96, dtype=jnp.float16), rand(96, dtype=jnp.float16)
  gelu = lambda x, w, b: jax.nn.gelu(x @ w + b).sum()
  r = one_region(gelu, x, wg, bg)
  assert ir.xla_epilogue_split(r.region) is not None


def test_fewest_written_is_a_minimum_cut():
  """``_fewest_written`` on a flattened program: a value read by two ops
  outside is written once, and where cuts tie the larger epilogue stays."""
  def widened(x):
    y = (x * 2.0).astype(jnp.float32)   # float16 -> float32
    u, v = y + 1.0, y * 3.0
    return u.sum(), v.sum(), (u * v).sum()

  def narrowed(x):
    y = (x * 2.0).astype(jnp.float32)
    return jnp.tanh(y).astype(jnp.float16).sum()

  x = rand(8, 8, dtype=jnp.float16)
  # Items by index: widened: 0 mul, 1 cast, 2 add, 3 mul, 6 mul (the
  # others sum); narrowed: 0 mul, 1 cast, 2 tanh, 3 cast to float16, then
  # the sum's own cast to float32 (4), which XLA's reduction takes.
  for prog, epi, want in ((widened, {1, 2, 3, 6}, set()), (narrowed, {1, 2, 3}, {1, 2, 3})):
    lvl = capture.flatten(jax.make_jaxpr(prog)(x))
    assert lvl.items[0].prim == "mul" and lvl.items[1].prim == "convert_element_type"
    keep = capture._fewest_written(lvl, lvl.items, {0}, epi, {0} | epi)
    # widened: x * 2 (float16) is the cheapest value to write; any cut
    # after the cast writes at least one float32 array. narrowed: x * 2 and
    # the float16 tanh cost the same, so the epilogue stays whole.
    assert keep == want
