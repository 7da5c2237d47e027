"""Sibling contractions whose results meet (a gated MLP's ``silu(x @ wg) *
(x @ wu)``) as one chain link: capture, the XLA-side price of the join,
the printed kernel in Triton's interpreter, and jaxfuse.jit end to end."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, codegen, ir, planner
from jaxfuse.config import config
from jaxfuse.planner import cost_model, examples
from jaxfuse.runtime import launch

from test_parts import _rel_err  # pylint: disable=g-bad-import-order


def _gated_mlp(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _gate(x, wg, wu):
  return jax.nn.silu(x @ wg) * (x @ wu)


def _args(m=16, d=32, f=64, dtype=jnp.float16):
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  x = jax.random.normal(ks[0], (m, d), dtype)
  wg = (jax.random.normal(ks[1], (d, f)) / math.sqrt(d)).astype(dtype)
  wu = (jax.random.normal(ks[2], (d, f)) / math.sqrt(d)).astype(dtype)
  wd = (jax.random.normal(ks[3], (f, d)) / math.sqrt(f)).astype(dtype)
  return x, wg, wu, wd


def test_gated_mlp_is_one_region_reading_x_once():
  args = _args()
  [r] = capture.find_regions(jax.make_jaxpr(_gated_mlp)(*args))
  reg = r.region
  assert reg.einsum_summary() == "mk,kn->mn ; mk,kn->mn ; mn,nh->mh"
  # x is one input both gate and up projections read.
  assert len(reg.inputs) == 4 and len(r.jaxpr.in_avals) == 4
  g, u, _ = reg.contractions
  assert g.lhs == u.lhs == reg.inputs[0].value
  [(join, dots)] = ir.xla_joins(reg).items()
  assert dots == (g.out, u.out)
  assert reg.value(join).loops == reg.value(g.out).loops
  got = jax.core.eval_jaxpr(r.jaxpr.jaxpr, r.jaxpr.consts, *args)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(_gated_mlp(*args)))


def test_the_gate_alone_is_a_region():
  """Without a down projection the joined GEMMs are a region of their own:
  XLA would run the join as a kernel after them."""
  x, wg, wu, _ = _args()
  [r] = capture.find_regions(jax.make_jaxpr(_gate)(x, wg, wu))
  assert r.region.einsum_summary() == "mk,kn->mn ; mk,kn->mn"   # as a lone GEMM names them
  assert len(ir.xla_joins(r.region)) == 1
  # With biases and a sum as the join too.
  f = lambda x, a, b, ba, bb: jnp.tanh(x @ a + ba) + (x @ b + bb)
  ba = jnp.ones((64,), jnp.float16)
  [r] = capture.find_regions(jax.make_jaxpr(f)(x, wg, wu, ba, ba))
  assert len(r.region.contractions) == 2 and len(r.region.inputs) == 5


def test_a_chain_left_to_xla_lowers_the_joined_part():
  args = _args()
  regions = capture.find_regions(jax.make_jaxpr(_gated_mlp)(*args), max_contractions=2)
  assert [r.region.einsum_summary() for r in regions] == ["mk,kn->mn ; mk,kn->mn"]
  # One contraction at most: the join cannot form, and a kernel for the gate
  # GEMM alone would keep XLA from merging it with its sibling (measured
  # 0.72x jax.jit at Qwen2-0.5B's widths, M=32, H100): none.
  assert capture.find_regions(jax.make_jaxpr(_gated_mlp)(*args), max_contractions=1) == []


def test_siblings_that_do_not_meet_are_not_joined():
  x, wg, wu, wd = _args()
  # Projections used apart (q, k, v): parts of one region, not a join.
  f = lambda x, a, b: (jnp.tanh(x @ a), jnp.tanh(x @ b))
  for r in capture.find_regions(jax.make_jaxpr(f)(x, wg, wu)):
    assert len(r.region.contractions) == 1
  # Attention's two contractions depend on each other: no join.
  assert ir.xla_joins(examples.attention(1, 2, 64, 64, 32)) == {}
  assert ir.xla_joins(examples.gemm_chain(1, 64, 64, 32, 32)) == {}


def test_a_join_whose_dots_share_no_loop_is_undone():
  """Self-attention over one array, differentiated (``attn(x, x, x)``): its
  backward dots read ``x`` in several roles, so siblings were joined whose
  region parts share no loop (11 loops; building its search space took 6
  minutes). Capture rejects such a region and tries the dots without the
  join: every region is connected and small."""
  def attn(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 8.0
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
  x = jnp.ones((1, 2, 128, 64), jnp.float32)
  regions = capture.find_regions(jax.make_jaxpr(jax.grad(lambda x: attn(x, x, x).sum()))(x))
  assert regions
  for r in regions:
    assert len(r.region.loops) <= 6, r.region.to_text()
  from jaxfuse import capture_ir
  with pytest.raises(capture_ir.Reject, match="2 parts that share no loop"):
    capture_ir._check_connected(_two_unrelated_chains())   # pylint: disable=protected-access


def _two_unrelated_chains() -> ir.Region:
  """Two GEMM chains with no loop in common, as one region."""
  a = examples.gemm_chain(1, 64, 64, 32, 32)
  ren = {l.name: l.name + "2" for l in a.loops}

  def buf(b):
    return ir.Buffer(b.value + "2", b.shape, tuple((ren[l], st) for l, st in b.strides))
  return ir.Region(
      a.loops + tuple(ir.Loop(ren[l.name], l.extent) for l in a.loops),
      a.values + tuple(ir.Value(v.name + "2", tuple(ren[l] for l in v.loops), v.dtype)
                       for v in a.values),
      a.inputs + tuple(buf(b) for b in a.inputs), a.outputs + tuple(buf(b) for b in a.outputs),
      a.ops + tuple(ir.Contraction(o.out + "2", o.lhs + "2", o.rhs + "2",
                                   tuple(ren[l] for l in o.reduce)) for o in a.ops),
      name="two_chains")


def test_the_planner_bounds_the_space_it_builds():
  """Over MAX_SPACE_PAIRS (grid, expression) pairs, build_space keeps fewer
  grids: two unrelated chains (10 loops, 5,040 expressions, 64 grids) keep
  the default grid alone, and are still planned."""
  from jaxfuse.devices import get_device
  from jaxfuse.planner import search
  r = _two_unrelated_chains()
  space = search.build_space(r, get_device("h100"))
  assert space.counts["expressions"] == 5040 and len(space.grids) == 1
  assert len(space.grids) * space.counts["expressions"] <= search.MAX_SPACE_PAIRS
  assert planner.plan_region(r, "h100", use_cache=False).best is not None
  # A region within the bound keeps every grid.
  g = examples.mlp_chain(1, 128, [1024, 4096, 1024, 4096, 1024])
  assert len(search.build_space(g, get_device("h100")).grids) == 2


def test_xla_pays_a_kernel_for_the_join():
  x, wg, wu, _ = _args(m=16, d=1024, f=2816)
  [r] = capture.find_regions(jax.make_jaxpr(_gate)(x, wg, wu))
  reg = ir.simplify(r.region)
  dev = jaxfuse.devices.get_device("h100")
  gemm = cost_model._library_gemm_time  # pylint: disable=protected-access
  peak = dev.dot_peak("float16", reg.contractions[0].precision)
  # XLA's DotMerger runs the gate and up GEMMs as one GEMM of both
  # weights side by side (ir.xla_merged_dots).
  assert [tuple(c.out for c in g) for g in ir.xla_merged_dots(reg)] == [
      tuple(c.out for c in reg.contractions)]
  merged = gemm(16, 2 * 2816, 1, 1024, 2, peak, dev)
  assert merged < 2 * gemm(16, 2816, 1, 1024, 2, peak, dev)
  join_bytes = 3 * 16 * 2816 * 2
  assert cost_model.unfused_time(reg, dev) == pytest.approx(
      merged + join_bytes / dev.mem_bandwidth_Bps + dev.min_kernel_s)


def test_xla_merges_sibling_dots_only_when_one_is_small():
  """XLA's DotMerger: the gate and up GEMMs of a gated MLP merge when one of
  them moves at most 32 MiB (Qwen2-0.5B's, 8.7 MB of weight each: one
  kernel on the H100), not at LLaMA-2-7B's widths (90 MB each: two
  kernels); a chain's dependent dots never merge."""
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)
  merged = {}
  for d, f in ((896, 4864), (4096, 11008)):
    [r] = capture.find_regions(jax.make_jaxpr(_gate)(spec(128, d), spec(d, f), spec(d, f)))
    reg = ir.simplify(r.region)
    merged[d] = ir.xla_merged_dots(reg)
  assert len(merged[896]) == 1 and len(merged[896][0]) == 2
  assert merged[4096] == []
  assert ir.xla_merged_dots(examples.gemm_chain(1, 64, 64, 32, 32)) == []
  assert ir.xla_merged_dots(examples.attention(1, 2, 64, 64, 32)) == []
  # The merged pair is priced as one GEMM of both weights' columns.
  [r] = capture.find_regions(jax.make_jaxpr(_gate)(spec(128, 896), spec(896, 4864),
                                                   spec(896, 4864)))
  dev = jaxfuse.devices.get_device("h100")
  peak = dev.dot_peak("float16", "default")
  one = cost_model._library_gemm_time(128, 9728, 1, 896, 2, peak, dev)  # pylint: disable=protected-access
  two = 2 * cost_model._library_gemm_time(128, 4864, 1, 896, 2, peak, dev)  # pylint: disable=protected-access
  assert one < two
  assert cost_model.unfused_time(ir.simplify(r.region), dev) < two


@pytest.mark.parametrize("fun", [_gated_mlp, _gate])
def test_printed_kernels_compute_the_region(fun):
  x, wg, wu, wd = _args(m=16, d=32, f=96)
  args = (x, wg, wu, wd) if fun is _gated_mlp else (x, wg, wu)
  [r] = capture.find_regions(jax.make_jaxpr(fun)(*args))
  reg = ir.simplify(r.region)
  res = planner.plan_region(reg, "h100")
  assert res.best is not None, res.why_not
  xs = launch.random_inputs(reg, seed=2)
  refs = ir.evaluate(reg, xs)
  for plan in res.ranked[:2]:
    k = codegen.generate(reg, plan, interpret=True)
    assert k.source.count("tl.dot(") == len(reg.contractions)
    outs = launch.run_interpreted(k, xs)
    assert launch.compare(reg, outs, refs) <= launch.tolerance(reg)
    # Gate and up weights play different roles: swapped, the answer moves.
    swapped = launch.run_interpreted(k, [xs[0], xs[2], xs[1], *xs[3:]])
    assert launch.compare(reg, swapped, refs) > 10 * launch.tolerance(reg)


def test_jit_runs_the_gated_mlp():
  args = _args(m=16, d=32, f=64)
  fused = jaxfuse.fused_jaxpr(_gated_mlp)(*args)
  [eqn] = [e for e in fused.jaxpr.eqns if e.primitive.name == "jaxfuse_region"]
  assert len(eqn.params["region"].contractions) == 3
  ref = _gated_mlp(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(_gated_mlp)(*args)
  assert out.shape == ref.shape
  assert _rel_err(out, ref) < 2e-3


def test_random_inputs_keep_a_gated_mlp_in_float16_range():
  """Unit normal inputs would take the down projection's float16 result past
  65504 at Qwen2-0.5B's widths: every plan's self-check would then fail on
  inf. The checker's inputs are scaled down where the region needs it."""
  x, wg, wu, wd = _args(m=8, d=896, f=4864)
  [r] = capture.find_regions(jax.make_jaxpr(_gated_mlp)(x, wg, wu, wd))
  reg = ir.simplify(r.region)
  scale = launch.input_scale(reg)
  assert scale < 1.0
  xs = launch.random_inputs(reg, seed=0)
  assert 0.5 * scale < float(np.std(xs[0])) < 2 * scale
  (out,) = ir.evaluate(reg, xs)
  assert np.isfinite(out).all() and np.abs(out).max() < 65504 / 4
  # Regions that fit at unit scale keep unit inputs.
  assert launch.input_scale(examples.attention(2, 4, 2048, 2048, 128)) == 1.0
  assert launch.input_scale(examples.gemm_chain(1, 512, 512, 256, 256)) == 1.0


def test_a_chain_with_no_working_kernel_still_lowers_its_parts(monkeypatch):
  """When every plan of the whole chain fails (not a keep-or-drop
  decision), the parts with fewer contractions are still tried."""
  args = _args(m=16, d=32, f=64)
  seen = []
  real = launch.fused_call

  def flaky(region, xs, **kw):
    seen.append(len(region.contractions))
    if len(region.contractions) == 3:
      raise RuntimeError("no plan produced a working kernel (test)")
    return real(region, xs, **kw)

  monkeypatch.setattr(launch, "fused_call", flaky)
  ref = _gated_mlp(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(_gated_mlp)(*args)
  assert seen[:2] == [3, 2]
  assert _rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("which", ["gate", "gelu", "mlp3"])
def test_split_reductions_finish_their_epilogue_in_the_combine_pass(which):
  """A reduction split across programs may be followed by a nonlinear
  epilogue (GELU, a gated MLP's join, a bias and a further GEMM): the
  combine pass sums the partials and then runs it."""
  x, wg, wu, wd = _args(m=8, d=256, f=128)
  b = jnp.linspace(-1, 1, 128).astype(jnp.float16)
  funs = {"gate": (_gate, (x, wg, wu)),
          "gelu": (lambda x, w, b: jax.nn.gelu(x @ w + b), (x, wg, b)),
          "mlp3": (lambda x, w1, b, w2: jax.nn.relu(x @ w1 + b) @ w2, (x, wg, b, wd))}
  fun, args = funs[which]
  [r] = capture.find_regions(jax.make_jaxpr(fun)(*args))
  reg = ir.simplify(r.region)
  from jaxfuse.planner import search   # pylint: disable=import-outside-toplevel
  assert search.splittable_loops(reg)
  res = planner.plan_region(reg, "h100", top=200, use_cache=False)
  split = [p for p in res.ranked if p.split][:3]
  assert split, [str(p) for p in res.ranked[:5]]
  xs = launch.random_inputs(reg, seed=3)
  refs = ir.evaluate(reg, xs)
  for plan in split:
    k = codegen.generate(reg, plan, interpret=True)
    assert k.combine_fn is not None
    outs = launch.run_interpreted(k, xs)
    assert launch.compare(reg, outs, refs) <= launch.tolerance(reg), str(plan)


def _dq(q, k, v, do, m, l, dvec):
  """The query gradient of attention, recomputing the probabilities from
  the forward's row statistics (as a FlashAttention-style backward does):
  ``q @ k.T`` and ``do @ v.T`` share no operand and meet in ``ds``."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125
  p = jnp.exp(s - m[..., None]) / l[..., None]
  dp = jnp.einsum("bqhd,bkhd->bhqk", do, v).astype(jnp.float32)
  ds = (p * (dp - dvec[..., None]) * 0.125).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", ds, k)


def _dq_args(b=1, t=64, h=2, d=32):
  ks = jax.random.split(jax.random.PRNGKey(3), 5)
  q, k, v, do = (jax.random.normal(x, (b, t, h, d), jnp.float16) for x in ks[:4])
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125
  m = s.max(-1)
  l = jnp.exp(s - m[..., None]).sum(-1)
  dvec = jax.random.normal(ks[4], (b, h, t), jnp.float32)
  return q, k, v, do, m, l, dvec


def test_parallel_dots_that_meet_are_joined():
  """Dots of one result shape sharing no operand, whose results meet in
  cheap ops, are one chain link: neither [T, T] product is written."""
  args = _dq_args()
  [r] = capture.find_regions(jax.make_jaxpr(_dq)(*args))
  reg = r.region
  assert len(reg.contractions) == 3
  s, dp, _ = reg.contractions
  assert {s.lhs, s.rhs}.isdisjoint({dp.lhs, dp.rhs})
  [(_, dots)] = ir.xla_joins(reg).items()
  assert dots == (s.out, dp.out)
  assert all(len(b.shape) <= 4 for b in reg.outputs) and len(reg.outputs) == 1
  assert planner.plan_region(ir.simplify(reg), "h100").best is not None
  ref = _dq(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(_dq)(*args)
  assert _rel_err(out, ref) < 2e-3


def test_a_sum_of_products_of_different_operands_is_one_region():
  """A layer's input gradient sums its projections' gradients
  (``dq @ wq.T + dk @ wk.T + dv @ wv.T``): one kernel accumulates the
  three products, where XLA writes each and adds them."""
  ks = jax.random.split(jax.random.PRNGKey(5), 6)
  g = [jax.random.normal(x, (64, 96), jnp.float16) for x in ks[:3]]
  w = [(jax.random.normal(x, (32, 96)) / 10).astype(jnp.float16) for x in ks[3:]]
  f = lambda a, b, c, wa, wb, wc: jnp.tanh(a @ wa.T + b @ wb.T + c @ wc.T)
  [r] = capture.find_regions(jax.make_jaxpr(f)(*g, *w))
  assert len(r.region.contractions) == 3 and len(r.region.inputs) == 6
  ref = f(*[a.astype(jnp.float32) for a in (*g, *w)])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(f)(*g, *w)
  assert _rel_err(out, ref) < 2e-3


def test_a_dot_computed_from_the_other_is_not_its_parallel():
  """An output projection and the MLP's down projection after it meet in
  the residual add, but the second is computed from the first (through the
  up projection): joining them would make a cycle."""
  ks = jax.random.split(jax.random.PRNGKey(9), 4)
  x = jax.random.normal(ks[0], (32, 64), jnp.float16)
  wo = (jax.random.normal(ks[1], (64, 64)) / 8).astype(jnp.float16)
  # (Square weights: every dot contracts 64 elements into a [32, 64] result.)
  w1 = (jax.random.normal(ks[2], (64, 64)) / 8).astype(jnp.float16)
  w2 = (jax.random.normal(ks[3], (64, 64)) / 8).astype(jnp.float16)

  def layer(x, wo, w1, w2):
    h = x @ wo + x
    return jax.nn.gelu(h @ w1) @ w2 + h
  closed = jax.make_jaxpr(layer)(x, wo, w1, w2)
  lvl = capture.flatten(closed, frozenset())
  lvl.build_maps()
  an = capture._LevelAnalysis(lvl)   # pylint: disable=protected-access
  dots = [it for it in lvl.items if it.prim == "dot_general"]
  assert an.joined_groups(dots, {d.idx: an.fwd(d) for d in dots}) == {}
  ref = layer(*[a.astype(jnp.float32) for a in (x, wo, w1, w2)])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(layer)(x, wo, w1, w2)
  assert _rel_err(out, ref) < 2e-3


def _attention_and_rowsum(q, k, v, do):
  """Attention whose result meets the cotangent in rowsum(do * o) (a
  FlashAttention-style backward's D, fused into the forward)."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(q.dtype), v)
  return o, jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))


def test_a_row_dot_is_priced_on_the_fma_pipe():
  """rowsum(do * o) pairs its operands element by element: no tile makes it
  a tl.dot, so neither its price nor the chain's mma.sync layout is a
  tensor core's at one row (it read 3.6x the attention's time before)."""
  spec = jax.ShapeDtypeStruct((8, 2048, 16, 64), jnp.float16)
  [r] = capture.find_regions(jax.make_jaxpr(_attention_and_rowsum)(spec, spec, spec, spec))
  reg = ir.simplify(r.region)
  s, pv, d = reg.contractions
  assert [cost_model.is_row_dot(reg, c) for c in (s, pv, d)] == [False, False, True]
  ranked = planner.plan_region(reg, "h100", use_cache=False).ranked
  # On a Hopper the Gluon form computes the row dot too (its own price,
  # tests/test_gluon.py); here the Triton form's price is tested.
  assert ranked[0].form == "gluon-ws"
  with_d = next(p for p in ranked if not p.form)
  tiles = dict(with_d.tiles)
  assert cost_model.tile_rows(reg, tiles) == tiles["m"]
  [r0] = capture.find_regions(jax.make_jaxpr(lambda *a: _attention_and_rowsum(*a)[0])(
      spec, spec, spec, spec))
  # Against the attention's best plan of the same (Triton) form.
  plain = min((p for p in planner.plan_region(ir.simplify(r0.region), "h100", top=400,
                                              use_cache=False).ranked if not p.form),
              key=lambda p: p.predicted.time_s)
  assert with_d.predicted.time_s < 1.3 * plain.predicted.time_s, (with_d, plain)


def test_row_statistics_get_positive_random_inputs():
  """A divisor (the softmax's sum) and a value subtracted before exp (its
  row max) are drawn away from zero: a recomputing backward's float16
  gradients then stay in range on the tuner's random inputs."""
  spec = lambda *s, dt=jnp.float16: jax.ShapeDtypeStruct(s, dt)
  a = (spec(1, 256, 2, 32),) * 4 + (spec(1, 2, 256, dt=jnp.float32),) * 3
  [r] = capture.find_regions(jax.make_jaxpr(_dq)(*a))
  reg = ir.simplify(r.region)
  stats = launch._row_statistics(reg)   # pylint: disable=protected-access
  # The row max: one standard deviation over the scores' typical row max,
  # at least 3 (launch._row_statistics).
  assert sorted(stats.values())[0] == 1.0 and 3.0 <= sorted(stats.values())[1] < 5.0
  xs = launch.random_inputs(reg, seed=0)
  for b, x in zip(reg.inputs, xs):
    if b.value in stats:
      assert float(x.min()) >= stats[b.value]
  (out,) = ir.evaluate(reg, xs)
  assert np.isfinite(out).all() and np.abs(out).max() < 1e3
