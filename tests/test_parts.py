"""Sibling contractions as one region with a part loop (ir.with_parts):
capture, the IR, the planner's part loop, the printed kernel in Triton's
interpreter, and jaxfuse.jit end to end."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from unittest import mock

import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, codegen, ir, planner
from jaxfuse.config import config
from jaxfuse.planner import tiling
from jaxfuse.runtime import launch


def _projections(x, wq, wk, wv, bq, bk, bv):
  return x @ wq + bq, x @ wk + bk, x @ wv + bv


def _attention_block(x, wq, wk, wv, bq, bk, bv, heads=2):
  bsz, seq, d = x.shape
  dh = d // heads
  split = lambda t: t.reshape(bsz, seq, heads, dh).transpose(0, 2, 1, 3)
  q, k, v = split(x @ wq + bq), split(x @ wk + bk), split(x @ wv + bv)
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / math.sqrt(dh))
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def _args(m=48, d=32, dtype=jnp.float16, lead=(1,)):
  ks = jax.random.split(jax.random.PRNGKey(3), 7)
  x = jax.random.normal(ks[0], (*lead, m, d), dtype)
  ws = [(jax.random.normal(ks[1 + i], (d, d)) / math.sqrt(d)).astype(dtype) for i in range(3)]
  bs = [(jax.random.normal(ks[4 + i], (d,)) * 0.1).astype(dtype) for i in range(3)]
  return (x, *ws, *bs)


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.abs(out - ref).max() / np.abs(ref).max())


def test_sibling_projections_are_one_region_with_a_part_loop():
  args = _args()
  [r] = capture.find_regions(jax.make_jaxpr(_projections)(*args))
  reg = r.region
  assert reg.part_loop == "p" and reg.extent("p") == 3
  assert reg.einsum_summary() == "mk,pkn->pmn"
  # x once, then each weight and each bias: one operand per part.
  assert len(r.jaxpr.in_avals) == 7 and len(r.jaxpr.out_avals) == 3
  assert [b.parts for b in reg.inputs] == [1, 3, 3]
  assert ir.operand_shapes(reg.outputs) == [(1, 48, 32)] * 3
  # The region's original ops compute what the function does.
  got = jax.core.eval_jaxpr(r.jaxpr.jaxpr, r.jaxpr.consts, *args)
  for g, want in zip(got, _projections(*args)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_siblings_that_differ_are_not_grouped():
  x, wq, wk, wv, bq, bk, bv = _args()
  # Different epilogues: not one region.
  f = lambda x, wq, wk, bq: (x @ wq + bq, jnp.tanh(x @ wk))
  assert capture.find_regions(jax.make_jaxpr(f)(x, wq, wk, bq)) == []
  # One sibling reads the other's result: a chain, not parts.
  g = lambda x, wq, wk: (x @ wq, (x @ wk) @ wq)
  regions = capture.find_regions(jax.make_jaxpr(g)(x[0], wq, wk))
  assert all(not r.region.part_loop for r in regions)
  # A lone projection is left to XLA (its bias stays in XLA's GEMM).
  assert capture.find_regions(jax.make_jaxpr(lambda x, w, b: x @ w + b)(x, wq, bq)) == []


def test_windows_of_one_stacked_weight_are_not_read_as_one_shared_input():
  """x @ W[i] + b_i: the three windows of W come from one array at three
  offsets. Taking W for an input the siblings share would give every part
  W[0]; capture must not group them that way."""
  ks = jax.random.split(jax.random.PRNGKey(5), 5)
  x = jax.random.normal(ks[0], (48, 32), jnp.float32)
  w = jax.random.normal(ks[1], (3, 32, 32), jnp.float32)
  bs = [jax.random.normal(k, (32,), jnp.float32) for k in ks[2:]]
  f = lambda x, w, b0, b1, b2: tuple(x @ w[i] + b for i, b in enumerate((b0, b1, b2)))
  for r in capture.find_regions(jax.make_jaxpr(f)(x, w, *bs)):
    assert not r.region.part_loop, r.region
  with config.override(backend="interpret"):
    got = jaxfuse.jit(f)(x, w, *bs)
  for g, want in zip(got, f(x, w, *bs)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-5)


def test_with_parts_evaluates_each_part_like_its_own_region():
  x, wq, wk, wv, bq, bk, bv = _args(m=16, d=16)
  f = lambda x, w, b: jax.nn.gelu(x @ w + b)
  [r] = capture.find_regions(jax.make_jaxpr(f)(x, wq, bq))
  one = ir.simplify(r.region)
  parts = ir.with_parts(one, 3, per_part=[1, 2])
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal(s).astype(np.float16) for s in ir.operand_shapes(parts.inputs)]
  outs = ir.evaluate(parts, xs)
  assert len(outs) == 3
  for i in range(3):
    (want,) = ir.evaluate(one, [xs[0], xs[1 + i], xs[4 + i]])
    np.testing.assert_array_equal(outs[i], want)
  assert parts.signature() != one.signature()
  with pytest.raises(ir.IRError, match="parts must be >= 2"):
    ir.with_parts(one, 1, per_part=[1])
  with pytest.raises(ir.IRError, match="must name inputs"):
    ir.with_parts(one, 3, per_part=[7])
  with pytest.raises(ValueError, match="region takes 7 inputs, got 3"):
    ir.evaluate(parts, xs[:3])


def test_a_part_buffer_must_lead_with_its_loop():
  x, wq, wk, wv, bq, bk, bv = _args(m=16, d=16)
  [r] = capture.find_regions(jax.make_jaxpr(_projections)(x, wq, wk, wv, bq, bk, bv))
  reg = r.region
  b = reg.inputs[1]
  bad = ir.Buffer(b.value, b.shape, tuple((l, s + 1 if l == "p" else s) for l, s in b.strides),
                  part_loop="p")
  with pytest.raises(ir.IRError, match="size of one part"):
    ir.Region(reg.loops, reg.values, (reg.inputs[0], bad, reg.inputs[2]), reg.outputs, reg.ops)


def test_the_part_loop_is_a_program_id_of_tile_one():
  x, wq, wk, wv, bq, bk, bv = _args(m=512, d=256)
  [r] = capture.find_regions(jax.make_jaxpr(_projections)(x, wq, wk, wv, bq, bk, bv))
  reg = ir.simplify(r.region)
  assert "p" in tiling.batch_loops(reg)
  res = planner.plan_region(reg, "h100")
  for plan in res.ranked:
    assert plan.tile_map["p"] == 1 and "p" in plan.grid
  # XLA's side: one merged GEMM, then a kernel per part over its output.
  from jaxfuse.planner import cost_model   # pylint: disable=import-outside-toplevel
  dev = jaxfuse.devices.get_device("h100")
  stacked = ir.Region(reg.loops, reg.values,
                      tuple(ir.Buffer(b.value, b.shape, b.strides) for b in reg.inputs),
                      tuple(ir.Buffer(b.value, b.shape, b.strides) for b in reg.outputs),
                      reg.ops)
  # (Stacked in one buffer, the weights' part and column loops do not merge:
  # XLA would copy them first, ir.xla_gemm_copies. Left out here, so that
  # the two differ by the per-part kernels alone.)
  with mock.patch.object(ir, "xla_gemm_copies", return_value=[]):
    extra = cost_model.unfused_time(reg, dev) - cost_model.unfused_time(stacked, dev)
  assert extra >= 3 * dev.min_kernel_s


@pytest.mark.parametrize("m", [48, 40])
def test_the_printed_kernel_picks_each_part(m):
  x, wq, wk, wv, bq, bk, bv = _args(m=m, d=32)
  [r] = capture.find_regions(jax.make_jaxpr(_projections)(x, wq, wk, wv, bq, bk, bv))
  reg = ir.simplify(r.region)
  res = planner.plan_region(reg, "h100")
  xs = launch.random_inputs(reg, seed=1)
  refs = ir.evaluate(reg, xs)
  for plan in res.ranked[:2]:
    k = codegen.generate(reg, plan, interpret=True)
    assert "if pid_p == 0:" in k.source
    outs = launch.run_interpreted(k, xs)
    assert [o.shape for o in outs] == [(1, m, 32)] * 3
    assert launch.compare(reg, outs, refs) <= launch.tolerance(reg)
    # Each part reads and writes its own arrays: swapping the first two
    # parts' weights and biases swaps their outputs.
    x0, w0, w1, w2, b0, b1, b2 = xs
    swapped = launch.run_interpreted(k, [x0, w1, w0, w2, b1, b0, b2])
    assert launch.compare(reg, swapped, [refs[1], refs[0], refs[2]]) <= launch.tolerance(reg)
    assert launch.compare(reg, swapped[:1], refs[:1]) > 10 * launch.tolerance(reg)


def test_jit_fuses_the_projections_and_the_attention():
  args = _args(m=64, d=32)
  fused = jaxfuse.fused_jaxpr(_attention_block)(*args)
  regions = [e for e in fused.jaxpr.eqns if e.primitive.name == "jaxfuse_region"]
  assert [e.params["region"].einsum_summary() for e in regions] == [
      "mk,pkn->pmn", "mgk,ngk->gmn ; gmn,ngh->gmh"]   # the batch of 1 is no loop
  ref = _attention_block(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    out = jaxfuse.jit(_attention_block)(*args)
  assert out.shape == ref.shape
  assert _rel_err(out, ref) < 2e-3
  # Without a GPU the default backend runs the original ops: exactly jax.jit.
  np.testing.assert_array_equal(np.asarray(jaxfuse.jit(_attention_block)(*args)),
                                np.asarray(jax.jit(_attention_block)(*args)))
