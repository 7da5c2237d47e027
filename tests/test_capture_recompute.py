"""capture_recompute: contractions that share a wide intermediate get copies."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, capture_recompute, ir
from jaxfuse.capture_flat import flatten, live_code
from jaxfuse.capture_ir import contraction_size
from jaxfuse.codegen import streaming
from jaxfuse.config import config
from test_capture import check_region_matches_jaxpr

B, H, T, D = 1, 2, 64, 32


def _attention(q, k, v, causal):
  # Token-major, as models lay out q, k, v ([B, T, H, D]).
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
  if causal:
    t = s.shape[-1]
    keep = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0) >= jax.lax.broadcasted_iota(
        jnp.int32, (t, t), 1)
    s = jnp.where(keep, s, -jnp.inf)
  p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _train_step(causal):
  def loss(q, k, v, g):
    return jnp.sum(_attention(q, k, v, causal).astype(jnp.float32) * g)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _args(seed=0, t=T):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k, v = (jax.random.normal(x, (B, t, H, D), jnp.float16) for x in ks[:3])
  return q, k, v, jax.random.normal(ks[3], (B, t, H, D), jnp.float32)


def _level(fn, *args):
  return flatten(live_code(jax.make_jaxpr(fn)(*args)))


def test_autodiff_attention_backward_recomputes_its_probabilities():
  """jax.grad saves the forward's probabilities; dv, dq and dk each read
  them, and so does rowsum(p * dp). Each gets its own copy of q @ k.T and
  the softmax ops, reading only the forward's row max and sum; the forward's
  p @ v keeps the original."""
  lvl = _level(_train_step(False), *_args())
  copies = capture_recompute.plan(lvl)
  kinds = sorted(lvl.items[i].prim for i in copies)
  assert kinds == ["dot_general"] * 3 + ["reduce_sum"]
  first = next(it for it in lvl.items if it.prim == "dot_general"
               and len(it.invars[0].aval.shape) == 4 and it.invars[0].aval.shape[-1] == T)
  assert first.idx not in copies    # the forward's p @ v
  for cone in copies.values():
    dots = [lvl.items[i] for i in cone if lvl.items[i].prim == "dot_general"]
    # q @ k.T (and do @ v.T where ds is formed): products of [T, D] operands.
    assert dots and all(contraction_size(d) == D for d in dots)
    assert not any(lvl.items[i].prim in ("reduce_max", "reduce_sum") for i in cone)


def test_rowsum_of_p_times_dp_becomes_rowsum_of_do_times_o():
  """Autodiff's rowsum(p * (do @ v.T)) (scaled by row statistics) is
  computed from the forward's o = p @ v as rowsum(do * o), FlashAttention-2's
  D: no [T, T] product and no copy of p for it; the values agree."""
  fn = _train_step(False)
  args = _args(4)
  lvl = _level(fn, *args)
  new = capture_recompute.reassociate(lvl)
  assert new is not lvl
  changed = [it for it, old in zip(new.items, lvl.items) if it is not old]
  assert [old.prim for old in (lvl.items[it.idx] for it in changed)] == ["reduce_sum"]
  assert sorted(new.items[i].prim for i in capture_recompute.plan(new)) == ["dot_general"] * 3
  closed = live_code(jax.make_jaxpr(fn)(*args))
  got = jax.core.eval_jaxpr(capture._recompute_shared(closed, "").jaxpr, (), *args)   # pylint: disable=protected-access
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_autodiff_attention_step_is_four_fused_regions(causal):
  """With the copies and D from o the step is four regions, as a
  hand-written FlashAttention-2 backward: the forward (writing its row max
  and sum, and rowsum(do * o)), dv, dk and dq; none writes a [T, T] value,
  and under a causal mask each skips the masked tiles. Their Triton kernels
  compute the step as the plain function does. (With ``config.merge`` dk and
  dv become one region: tests/test_ir_merge.py.)"""
  fn = _train_step(causal)
  args = _args(1)
  with config.override(merge=False):
    regions = capture.find_regions(jax.make_jaxpr(fn)(*args))
  assert sorted(len(r.region.contractions) for r in regions) == [2, 3, 3, 3]
  # No kernel reads the float32 cotangent g: they read the float16 cast XLA
  # writes for them all (capture.narrow_read_outside), not g on every step
  # of their loops.
  f32 = [r for r in regions if any(
      b.shape == (B, T, H, D) and r.region.value_map[b.value].dtype == "float32"
      for b in r.region.inputs)]
  assert not f32, [r.region for r in f32]
  for r in regions:
    assert all(np.prod(b.shape) < B * H * T * T for b in r.region.outputs), r.region
    bands = streaming.masked_tile_relations(ir.simplify(r.region))
    assert bool(bands) == causal, r.region
  ref = jax.jit(fn)(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret", merge=False):
    jitted = jaxfuse.jit(fn)
    got = jitted(*args)
    report = jaxfuse.inspect(jitted, *args)
  assert [bool(r.lowered) for r in report.regions] == [True] * 4
  _assert_close(got, ref)


def _assert_close(got, ref, tol=3e-3):
  """Each leaf of ``got`` within relative norm error ``tol`` of ``ref``'s."""
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    err = float(jnp.linalg.norm((g.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
    assert err < tol, err


def test_the_rewritten_program_computes_the_same():
  """The copies read the forward's row statistics: the program with them
  gives the original's values."""
  fn = _train_step(True)
  args = _args(2)
  closed = live_code(jax.make_jaxpr(fn)(*args))
  new = capture._recompute_shared(closed, "")   # pylint: disable=protected-access
  assert new is not closed
  n_dots = lambda c: sum(e.primitive.name == "dot_general" for e in c.jaxpr.eqns)
  assert n_dots(new) > n_dots(closed)
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  got = jax.core.eval_jaxpr(new.jaxpr, new.consts, *args)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                               rtol=2e-3, atol=2e-3)


def test_a_wide_contraction_is_not_recomputed():
  """An MLP's x @ w1 contracts 512 elements: reading its result back is
  cheaper than recomputing it, so its training step gets no copies."""
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  x = jax.random.normal(ks[0], (128, 512), jnp.float16)
  w1 = jax.random.normal(ks[1], (512, 2048), jnp.float16)
  w2 = jax.random.normal(ks[2], (2048, 512), jnp.float16)

  def loss(x, w1, w2):
    return jnp.sum(jax.nn.gelu(x @ w1) @ w2)
  lvl = _level(jax.grad(loss, argnums=(0, 1, 2)), x, w1, w2)
  assert 512 > capture_recompute.MAX_RECOMPUTE_CONTRACTION
  assert capture_recompute.plan(lvl) == {}


def test_a_product_that_reduces_its_wide_operand_is_not_copied():
  """rowsum(do * o) reads attention's o = p @ v: copying that product would
  read p again, so a hand-written recomputing backward (which already
  forms each gradient from its own q @ k.T) gets no further copies."""
  from benchmarks import attention_workloads as aw  # pylint: disable=g-import-not-at-top
  flash = aw.make_train_step(aw.make_flash_attention(True, 0.125, "bhtd"))
  assert capture_recompute.plan(_level(flash, *_args())) == {}


def test_a_computed_right_operand_is_read_from_registers():
  """A product written as ``v^T @ p`` (autodiff's dv before capture folds
  the transpose into the input's index map: ``(do^T @ p)^T``) has the
  computed ``p`` as its right operand. The kernel runs it as ``p^T @ v``,
  ``p`` on the left, which wgmma reads from registers (on the right it
  would go through shared memory every key step), and its accumulator is
  in the result's order (no transpose before the store)."""
  from jaxfuse import codegen, planner  # pylint: disable=g-import-not-at-top
  t = 256
  ks = jax.random.split(jax.random.PRNGKey(8), 3)
  q, k, v = (jax.random.normal(x, (2, t, 32), jnp.float16) for x in ks)

  def chain(q, k, v):
    s = jnp.einsum("bmd,bnd->bmn", q, k).astype(jnp.float32)
    p = jnp.exp(s - s.max(-1, keepdims=True)).astype(jnp.float16)
    # v [b, n, h] contracted with p [b, m, n] over n: [b, h, m].
    return jax.lax.dot_general(v, p, (((1,), (2,)), ((0,), (0,))))

  [r] = capture.find_regions(jax.make_jaxpr(chain)(q, k, v))
  reg = ir.simplify(r.region)
  # Capture lists the chained value first here; a prologue op on the loaded
  # operand (autodiff's cast of the cotangent) keeps the program's order.
  # The product is symmetric in its operands: list them as the program did.
  last = reg.contractions[-1]
  op = dataclasses.replace(last, lhs=last.rhs, rhs=last.lhs)
  reg = ir.Region(reg.loops, reg.values, reg.inputs, reg.outputs,
                  tuple(op if o is last else o for o in reg.ops), name=reg.name)
  assert op.lhs in reg.input_names and op.rhs not in reg.input_names
  # A plan that streams the key loop, so that the product accumulates.
  res = planner.plan_region(reg, "h100", top=300, use_cache=False)
  plan = next(p for p in res.ranked if dict(p.tiles)["n"] == 64 and not p.split)
  k_ = codegen.generate(reg, plan, interpret=True)
  [line] = [l.strip() for l in k_.source.splitlines()
            if l.strip().startswith(f"acc_{op.out} = tl.dot(")]
  assert line.startswith(f"acc_{op.out} = tl.dot({op.rhs}"), line
  assert "tl.trans(acc_" not in k_.source
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  xs = launch.random_inputs(reg, seed=2)
  outs = launch.run_interpreted(k_, xs)
  assert launch.compare(reg, outs, ir.evaluate(reg, xs)) <= launch.tolerance(reg)


def test_copies_left_unfused_are_merged_back_by_xla():
  """Where a copy is not fused, the program computes what it did before:
  XLA's common-subexpression pass merges the copied products with the
  originals (more dots in the jaxpr, no more in the compiled program)."""
  try:
    from jax.extend.core import jaxpr_as_fun  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    from jax.core import jaxpr_as_fun  # type: ignore  # pylint: disable=g-import-not-at-top
  fn = _train_step(True)
  args = _args(3)
  closed = live_code(jax.make_jaxpr(fn)(*args))
  new = capture._recompute_shared(closed, "")   # pylint: disable=protected-access
  lvl = capture_recompute.reassociate(_level(fn, *args))
  copied = sum(lvl.items[i].prim == "dot_general" for c in capture_recompute.plan(lvl).values()
               for i in c)
  n_dots = lambda c: sum(e.primitive.name == "dot_general" for e in c.jaxpr.eqns)
  # The copies; the original do @ v.T is gone (D is a call of its own).
  assert copied >= 3 and n_dots(new) == n_dots(closed) - 1 + copied
  compiled = lambda c: jax.jit(jaxpr_as_fun(c)).lower(*args).compile().as_text().count(" dot(")
  assert 0 < compiled(new) <= compiled(closed)


def test_a_row_sum_without_the_matching_product_is_left_as_written():
  """rowsum(x * (a @ b.T)) is rewritten only where the level forms
  cast(x / s) @ b over the same b: with another operand, or with no such
  product, the sum stays."""
  ks = jax.random.split(jax.random.PRNGKey(6), 5)
  q, k, v, w, do = (jax.random.normal(x, (2, 64, 32), jnp.float16) for x in ks)

  def step(q, k, v, w, do, other):
    s = jnp.einsum("bmd,bnd->bmn", q, k).astype(jnp.float32)
    x = jnp.exp(s - s.max(-1, keepdims=True))
    l = x.sum(-1, keepdims=True)
    o = jnp.einsum("bmn,bnd->bmd", (x / l).astype(q.dtype), v)
    dp = jnp.einsum("bmd,bnd->bmn", do, w if other else v).astype(jnp.float32)
    return o, jnp.sum(dp * x / (l * l), axis=-1)

  for other, rewritten in ((False, True), (True, False)):
    lvl = _level(lambda *a: step(*a, other), q, k, v, w, do)
    assert (capture_recompute.reassociate(lvl) is not lvl) == rewritten
  closed = live_code(jax.make_jaxpr(lambda *a: step(*a, False))(q, k, v, w, do))
  got = jax.core.eval_jaxpr(capture._recompute_shared(closed, "").jaxpr, (), q, k, v, w, do)   # pylint: disable=protected-access
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, q, k, v, w, do)
  # Both round to float16 (dp there, p and o here): normwise, they agree.
  g, w_ = np.asarray(got[1], np.float64), np.asarray(want[1], np.float64)
  assert np.linalg.norm(g - w_) / np.linalg.norm(w_) < 2e-3


def _dpa_train_step(causal):
  def loss(q, k, v, g):
    o = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    return jnp.sum(o.astype(jnp.float32) * g)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_a_row_sum_reached_through_a_transpose_is_reassociated(causal):
  """jax.nn.dot_product_attention's backward sums rowsum(dp * e / l^2),
  its dp = do @ v.T moved by a transpose (its size-1 group axis): that sum
  too is computed from the forward's o, so the forward region writes D
  (and runs as the Gluon form on Hopper). dq and dk+dv are regions too,
  none of which reads a [T, T] array (the broadcast of D stays in the
  kernel); the step computes the same."""
  fn = _dpa_train_step(causal)
  args = _args(5)
  # The float16 step as capture sees it (its dots' float16 algorithm does
  # not run on a CPU): the forward region writes o, its row max and sum,
  # and D.
  for a in (args, [x.astype(jnp.float32) for x in args]):
    lvl = _level(fn, *a)
    new = capture_recompute.reassociate(lvl)
    changed = [lvl.items[it.idx] for it, old in zip(new.items, lvl.items) if it is not old]
    assert [it.prim for it in changed] == ["reduce_sum"]
  regions = [r.region for r in capture.find_regions(jax.make_jaxpr(fn)(*args))]
  # dq; the forward; dk and dv as one region (dk reads q through dpa's
  # 5-D view, dv reads q itself: one memory, and its size-1 group axis is
  # no loop of either).
  assert sorted((len(r.contractions), len(r.outputs)) for r in regions) == [
      (3, 1), (3, 4), (4, 2)]
  scores = T * T * B * H
  assert all(math.prod(b.shape) < scores for r in regions for b in r.inputs)
  if causal:
    # Every kernel skips the tiles the mask hides: dv's p is zero there by
    # dpa's finite fill, since every query keeps a key.
    assert all(streaming.masked_tile_relations(ir.simplify(r)) for r in regions)
  # dq and dk multiply ds rounded to float16, as the dots' float16
  # algorithm does (ds is float32).
  for r in regions:
    if len(r.outputs) == 4:
      continue   # the forward: its last product is the row dot D, in float32
    for c in r.contractions:
      assert {r.value(c.lhs).dtype, r.value(c.rhs).dtype} == {"float16"}
  # Values, in float32: the rewritten program, and jaxfuse.jit's step.
  args = [x.astype(jnp.float32) for x in args]
  closed = live_code(jax.make_jaxpr(fn)(*args))
  got = jax.core.eval_jaxpr(capture._recompute_shared(closed, "").jaxpr, (), *args)   # pylint: disable=protected-access
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
  ref = jax.jit(fn)(*args)
  with config.override(backend="interpret"):
    got = jaxfuse.jit(fn)(*args)
  _assert_close(got, ref)


def test_a_merged_region_reads_one_array_through_two_shapes(monkeypatch):
  """dpa's dk reads q through its 5-D view, dv reads q itself: merged, the
  region reads one of them for both, and its original ops (what a failed
  plan runs) give dv's ops that input in q's own shape. In float32 the
  model keeps these two apart at these shapes, so the merge is forced."""
  monkeypatch.setattr(capture, "_merge_pays", lambda *a: True)
  fn = _dpa_train_step(False)
  args = [x.astype(jnp.float32) for x in _args(6)]
  caps = capture.find_regions(jax.make_jaxpr(fn)(*args))
  merged = [c for c in caps if len(c.region.outputs) < 4 and len(c.region.contractions) > 3]
  assert merged
  for c in caps:
    check_region_matches_jaxpr(c, rtol=1e-4, atol=1e-4)
  ref = jax.jit(fn)(*args)
  with config.override(backend="interpret"):
    got = jaxfuse.jit(fn)(*args)
  _assert_close(got, ref)
