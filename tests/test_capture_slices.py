"""Slices of a contraction's result as contractions of operand windows
(``jaxfuse.capture_slices``): packed gate/up projections fuse like separate
ones, the fallback keeps the packed GEMM, and what no region takes is left
as the program wrote it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, ir
from jaxfuse.capture_flat import flatten
from jaxfuse.capture_slices import push_slices
from jaxfuse.config import config

from test_parts import _rel_err  # pylint: disable=g-bad-import-order

T, D, F = 16, 32, 48


def _weights(dtype=jnp.float16):
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  x = jax.random.normal(ks[0], (T, D), dtype)
  wgu = (jax.random.normal(ks[1], (D, 2 * F)) / math.sqrt(D)).astype(dtype)
  wd = (jax.random.normal(ks[2], (F, D)) / math.sqrt(F)).astype(dtype)
  return x, wgu, wd


def packed_split(x, wgu, wd):
  g, u = jnp.split(x @ wgu, 2, axis=-1)
  return (jax.nn.silu(g) * u) @ wd


def packed_slices(x, wgu, wd):
  h = x @ wgu
  return (jax.nn.silu(h[:, :F]) * h[:, F:]) @ wd


def stacked_einsum(x, w2, wd):
  # w2: [2, D, F], gate and up stacked on a leading axis.
  h = jnp.einsum("td,cdf->tcf", x, w2)
  return (jax.nn.silu(h[:, 0]) * h[:, 1]) @ wd


def separate(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _cases():
  x, wgu, wd = _weights()
  w2 = wgu.reshape(D, 2, F).transpose(1, 0, 2)
  return {"split": (packed_split, (x, wgu, wd)), "slices": (packed_slices, (x, wgu, wd)),
          "stacked": (stacked_einsum, (x, w2, wd))}


def _dots(closed) -> list:
  return [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("name", ["split", "slices", "stacked"])
def test_packed_gate_up_is_the_gated_mlp_region(name):
  fun, args = _cases()[name]
  [r] = capture.find_regions(jax.make_jaxpr(fun)(*args))
  x, wgu, wd = _weights()
  [ref] = capture.find_regions(jax.make_jaxpr(separate)(x, wgu[:, :F], wgu[:, F:], wd))
  reg = ir.simplify(r.region)
  assert reg.einsum_summary() == ir.simplify(ref.region).einsum_summary()
  # Gate and up read windows of the one packed weight, in place.
  wins = [b for b in reg.inputs if b.window]
  assert len(wins) == 2
  assert r.same_as[list(reg.inputs).index(wins[1])] == list(reg.inputs).index(wins[0])
  # The region's own ops (XLA's fallback) keep the packed GEMM: one
  # contraction over the whole weight, then the down projection.
  dots = _dots(r.jaxpr)
  assert len(dots) == 2
  assert tuple(dots[0].invars[1].aval.shape) == tuple(args[1].shape)
  got = jax.core.eval_jaxpr(r.jaxpr.jaxpr, r.jaxpr.consts, *_region_args(fun, args))
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(fun(*args)))


def _region_args(fun, args):
  """The arrays the inputs of ``fun``'s one region receive (each reads an
  argument of ``fun``)."""
  closed = jax.make_jaxpr(fun)(*args)
  lvl, [f] = capture._analyze(closed, "")  # pylint: disable=protected-access
  by_var = dict(zip(lvl.invars, args))
  return [by_var[v] for v in f.input_src]


@pytest.mark.parametrize("name", ["split", "slices", "stacked"])
def test_jit_runs_the_packed_mlp_interpreted(name):
  fun, args = _cases()[name]
  fused = jaxfuse.fused_jaxpr(fun)(*args)
  [eqn] = [e for e in fused.jaxpr.eqns if e.primitive.name == "jaxfuse_region"]
  assert len(eqn.params["region"].contractions) == 3
  ref = fun(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(fun)(*args)
  assert _rel_err(out, ref) < 2e-3


def test_the_fallback_lowers_one_packed_gemm():
  """On the CPU every region runs its original ops: the packed GEMM, not
  two GEMMs of weight windows."""
  x, wgu, wd = _weights()
  txt = jaxfuse.jit(packed_split).lower(x, wgu, wd).as_text()
  assert txt.count("stablehlo.dot_general") == 2
  out = jaxfuse.jit(packed_split)(x, wgu, wd)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(jax.jit(packed_split)(x, wgu, wd), np.float32),
                             rtol=2e-2, atol=2e-2)


def test_a_region_left_to_xla_emits_the_packed_gemm():
  x, wgu, wd = _weights()
  closed = jax.make_jaxpr(lambda x, w, wd: jnp.tanh(packed_split(x, w, wd)))(x, wgu, wd)
  seen = []

  def keep(cap, *xs):
    seen.append(cap)
    return None   # the planner's verdict: XLA

  new = capture.rewrite(closed, keep)
  assert len(seen) == 1
  assert len(_dots(new)) == 2
  assert [tuple(d.invars[1].aval.shape) for d in _dots(new)] == [(D, 2 * F), (F, D)]


def test_half_of_a_packed_result_reads_half_the_weight():
  x, wgu, wd = _weights()
  fun = lambda x, w, wd: jax.nn.silu(jnp.split(x @ w, 2, -1)[0]) @ wd
  [r] = capture.find_regions(jax.make_jaxpr(fun)(x, wgu, wd))
  reg = ir.simplify(r.region)
  assert len(reg.contractions) == 2
  [win] = [b for b in reg.inputs if b.window]
  assert win.offset == 0 and tuple(win.shape) == (D, 2 * F)
  with config.override(backend="interpret"):
    out = jaxfuse.jit(fun)(x, wgu, wd)
  assert _rel_err(out, fun(*[a.astype(jnp.float32) for a in (x, wgu, wd)])) < 2e-3


def test_pushed_parts_no_region_takes_are_left_packed():
  x, wgu, wd = _weights()
  # The gate alone: its parts would be a region of sibling GEMMs only,
  # priced against one GEMM per part where XLA runs one packed GEMM.
  gate = lambda x, w: (lambda g, u: jax.nn.silu(g) * u)(*jnp.split(x @ w, 2, -1))
  closed = jax.make_jaxpr(gate)(x, wgu)
  assert capture.find_regions(closed) == []
  assert capture.rewrite(closed, lambda cap, *xs: xs) is closed
  # So also a packed gated MLP's gate/up part, when its chain is left to XLA.
  assert capture.find_regions(jax.make_jaxpr(packed_split)(x, wgu, wd),
                              max_contractions=2) == []
  # Parts used apart.
  apart = lambda x, w: tuple(jnp.tanh(h) for h in jnp.split(x @ w, 2, -1))
  assert capture.find_regions(jax.make_jaxpr(apart)(x, wgu)) == []
  # A packed result also used whole is not pushed.
  both = lambda x, w, wd: (packed_split(x, w, wd), x @ w)
  lvl = flatten(jax.make_jaxpr(lambda x, w, wd: (lambda h: (
      (jax.nn.silu(h[:, :F]) * h[:, F:]) @ wd, h))(x @ w))(x, wgu, wd))
  assert push_slices(lvl) == []
  assert len(capture.find_regions(jax.make_jaxpr(both)(x, wgu, wd))) == 1
  # Packed QKV feeding attention keeps its windows of the qkv result.
  attn = lambda x, w: (lambda q, k, v: jax.nn.softmax(q @ k.T) @ v)(
      *jnp.split(x @ w, 3, -1))
  [r] = capture.find_regions(jax.make_jaxpr(attn)(x, wgu[:, :3 * 16]))
  assert r.region.einsum_summary() == "mk,nk->mn ; mn,nh->mh"
  assert r.same_as == (0, 0, 0)


def test_pushdown_rules():
  x, wgu, wd = _weights()
  lvl = flatten(jax.make_jaxpr(packed_split)(x, wgu, wd))
  [p] = push_slices(lvl)
  assert p.side == 1 and len(p.parts) == 2
  assert [tuple(w.outvars[0].aval.shape) for [w] in p.windows] == [(D, F), (D, F)]
  assert [it.prim for it in lvl.items[:4]] == ["slice", "dot_general"] * 2
  assert [it.idx for it in lvl.items] == list(range(len(lvl.items)))
  # Rows of the result are windows of the lhs.
  lvl = flatten(jax.make_jaxpr(lambda x, w: (x @ w)[:8])(x, wgu))
  [p] = push_slices(lvl)
  assert p.side == 0 and tuple(p.windows[0][0].outvars[0].aval.shape) == (8, D)
  # Windows of one layer w[l] of stacked weights slice the stack itself.
  ws = jnp.stack([wgu, wgu])
  lvl = flatten(jax.make_jaxpr(lambda x, ws: jnp.split(x @ ws[1], 2, -1)[1])(x, ws))
  [p] = push_slices(lvl)
  [[sl, sq]] = p.windows
  assert sl.invars[0] is lvl.invars[1] and sq.prim == "squeeze"
  assert (tuple(sl.params["start_indices"]), tuple(sl.params["limit_indices"])) == (
      (1, 0, F), (2, D, 2 * F))
  assert [e.primitive.name for e in p.via] == ["slice", "squeeze"]
  # Windows of both operands at once, and batch axes: not pushed.
  assert push_slices(flatten(jax.make_jaxpr(lambda x, w: (x @ w)[:8, :F])(x, wgu))) == []
  xb = jnp.ones((2, T, D), jnp.float16)
  wb = jnp.ones((2, D, F), jnp.float16)
  bmm = lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))))[:1]
  assert push_slices(flatten(jax.make_jaxpr(bmm)(xb, wb))) == []
  # A strided slice is not a window.
  assert push_slices(flatten(jax.make_jaxpr(lambda x, w: (x @ w)[:, ::2])(x, wgu))) == []


def _layer(x, w):
  wgu, wd = w
  g, u = jnp.split(x @ wgu, 2, axis=-1)
  return x + (jax.nn.silu(g) * u) @ wd, None


@pytest.mark.parametrize("form", ["scan", "unrolled"])
def test_packed_layers_values_and_gradients(form):
  """Stacked packed weights: in a scan body (each layer's region planned
  there), and unrolled (``wgu[l]`` is itself a window, and a layer's down
  projection chains into the next layer's gate/up)."""
  layers = 3
  ks = jax.random.split(jax.random.PRNGKey(5), 3)
  x = jax.random.normal(ks[0], (T, D), jnp.float32)
  wgu = jax.random.normal(ks[1], (layers, D, 2 * F)) / math.sqrt(D)
  wd = jax.random.normal(ks[2], (layers, F, D)) / math.sqrt(F)
  if form == "scan":
    fun = lambda x, wgu, wd: jax.lax.scan(_layer, x, (wgu, wd))[0]
  else:
    def fun(x, wgu, wd):
      for l in range(layers):
        x = _layer(x, (wgu[l], wd[l]))[0]
      return x
  regions = capture.find_regions(jax.make_jaxpr(fun)(x, wgu, wd))
  assert regions and all(len(_dots(r.jaxpr)) < len(r.region.contractions) for r in regions)
  if form == "unrolled":
    # The gate and up windows of wgu[l] read the stacked wgu in place.
    for r in regions:
      wins = [b for b in r.region.inputs if b.window and tuple(b.shape) == wgu.shape]
      assert len(wins) == 2 and wins[1].offset - wins[0].offset == F
  ref = fun(x, wgu, wd)
  grads_ref = jax.grad(lambda *a: fun(*a).sum(), argnums=(0, 1))(x, wgu, wd)
  with config.override(backend="interpret"):
    out = jaxfuse.jit(fun)(x, wgu, wd)
    grads = jax.grad(lambda *a: jaxfuse.jit(fun)(*a).sum(), argnums=(0, 1))(x, wgu, wd)
  assert _rel_err(out, ref) < 2e-3
  for g, r in zip(grads, grads_ref):
    assert _rel_err(g, r) < 2e-3
