"""ir_merge: two regions as one multi-output region, and capture's merges."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import capture, ir, ir_merge
from jaxfuse.codegen import testing
from jaxfuse.config import config
from jaxfuse.ir import Buffer, Contraction, Elementwise, Loop, Region, Value
from jaxfuse.runtime import launch
from test_capture_recompute import B, D, H, T, _args, _assert_close, _train_step  # pylint: disable=g-bad-import-order



def _two_heads(second_fn="exp", share_b=True):
  """a: e = exp(A @ B) @ D; b: f = g(A @ B) @ F, over renamed loops and
  values (b's m, n, k, h are a's i, j, l, p)."""
  a = testing.gemm_chain(M=32, N=48, K=16, H=24)
  a = Region(a.loops, a.values + (Value("X", ("b", "m", "n"), "float32"),),
             a.inputs, a.outputs,
             (a.ops[0], Elementwise("X", "exp", ("C",)),
              dataclasses.replace(a.ops[1], lhs="X")), name="a")
  ext = dict(b=1, i=32, j=48, l=16, q=40)
  loops = tuple(Loop(k, v) for k, v in ext.items())
  vals = (Value("P", ("b", "i", "l"), "float32"), Value("Q", ("b", "l", "j"), "float32"),
          Value("R", ("b", "j", "q"), "float32"), Value("S", ("b", "i", "j"), "float32"),
          Value("U", ("b", "i", "j"), "float32"), Value("W", ("b", "i", "q"), "float32"))
  buf = lambda v, order: Buffer(v, tuple(ext[x] for x in order), tuple(
      zip(order, ir.contiguous_strides([ext[x] for x in order]))))
  b = Region(loops, vals, (buf("P", "bil"), buf("Q", "blj"), buf("R", "bjq")),
             (buf("W", "biq"),),
             (Contraction("S", "P", "Q", ("l",)), Elementwise("U", second_fn, ("S",)),
              Contraction("W", "U", "R", ("j",))), name="b")
  a_keys = ["A", "B", "D"]
  b_keys = ["A", "B" if share_b else "B2", "F"]
  return a, b, a_keys, b_keys


def _random(region, seed):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(b.shape).astype(np.float32) * 0.3 for b in region.inputs]


def test_the_common_part_is_computed_once():
  """b's A @ B and exp are a's: the merged region computes them once, reads
  A and B once, and keeps b's own product over a loop of its own."""
  a, b, ak, bk = _two_heads()
  m = ir_merge.merge(a, b, ak, bk)
  r = m.region
  assert (m.shared_ops, m.shared_contractions) == (2, 1)
  assert len(r.contractions) == 3 and len(r.ops) == 4
  assert len(r.inputs) == 4 and m.b_inputs == (0, 1, 3)
  assert len(r.outputs) == 2 and m.b_outputs == (1,)
  # b's q (extent 40) has no counterpart: it keeps a loop of its own.
  assert r.loop_extents["q"] == 40
  xa, xb = _random(a, 0), None
  xb = [xa[0], xa[1], _random(b, 1)[2]]
  xs = xa + [xb[2]]
  got = ir.evaluate(r, xs)
  np.testing.assert_allclose(got[0], ir.evaluate(a, xa)[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], ir.evaluate(b, xb)[0], rtol=1e-6)


def test_different_arrays_or_functions_share_nothing():
  """Another array under B, or another function of the product, computes
  b's ops anew; the merged region still computes both results."""
  for fn, share in (("exp", False), ("tanh", True)):
    a, b, ak, bk = _two_heads(fn, share)
    m = ir_merge.merge(a, b, ak, bk)
    assert m.shared_contractions == (1 if share else 0)
    assert len(m.region.contractions) == 4 - m.shared_contractions
    xa = _random(a, 2)
    xb = [xa[0], xa[1] if share else _random(b, 3)[1], _random(b, 4)[2]]
    xs = list(xa) + [x for j, x in enumerate(xb) if m.b_inputs[j] >= len(a.inputs)]
    got = ir.evaluate(m.region, xs)
    np.testing.assert_allclose(got[1], ir.evaluate(b, xb)[0], rtol=1e-6)


def test_one_array_through_two_shapes_is_read_once():
  """Equal keys are one memory: b may view A through another shape of the
  same size (a reshape outside the region, such as dpa's 5-D view of q);
  a shape of another size is another array."""
  a, b, ak, bk = _two_heads()
  p = b.inputs[0]
  for shape, shared in (((32, 16), 1), ((32, 32), 0)):
    view = dataclasses.replace(p, shape=shape)
    b2 = dataclasses.replace(b, inputs=(view,) + b.inputs[1:])
    m = ir_merge.merge(a, b2, ak, bk)
    assert m.shared_contractions == shared
    assert (m.b_inputs[0] == 0) == bool(shared)


def test_bad_keys_are_refused():
  a, b, ak, _ = _two_heads()
  with pytest.raises(ValueError, match="keys"):
    ir_merge.merge(a, b, ak, ["A"])


@pytest.mark.parametrize("causal", [False, True])
def test_autodiff_dk_and_dv_are_one_region(causal):
  """The attention backward's dk and dv regions recompute p from the same
  q, k and row statistics: capture merges them into one region that
  computes q @ k.T once and writes both (FlashAttention-2's dk/dv kernel),
  three regions in all; the Triton kernels compute the step as the plain
  function. With config.merge off they stay apart."""
  fn = _train_step(causal)
  args = _args(1)
  closed = jax.make_jaxpr(fn)(*args)
  regions = capture.find_regions(closed)
  assert sorted(len(r.region.contractions) for r in regions) == [3, 3, 4]
  both = next(r for r in regions if len(r.region.contractions) == 4)
  assert len(both.region.outputs) == 2
  assert all(b.shape == (B, T, H, D) for b in both.region.outputs)
  # q @ k.T once: one contraction over the head dimension of q and k.
  firsts = [op for op in both.region.contractions
            if not any(both.region.producer(x) for x in op.inputs)]
  assert len(firsts) == 2, both.region   # q @ k.T and do @ v.T
  # q (for q @ k.T and ds.T @ q) and do (for do @ v.T and p.T @ do) are
  # each one array read through two buffers.
  assert len(both.region.same_array()) == 2
  with config.override(merge=False):
    assert len(capture.find_regions(closed)) == 4
  ref = jax.jit(fn)(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    jitted = jaxfuse.jit(fn)
    got = jitted(*args)
    report = jaxfuse.inspect(jitted, *args)
  assert [bool(r.lowered) for r in report.regions] == [True] * 3
  _assert_close(got, ref)


def test_the_merged_fallback_computes_both_outputs():
  """A merged region left to XLA runs its original ops: the union of both
  regions' jaxprs gives every output."""
  fn = _train_step(False)
  args = _args(2)
  regions = capture.find_regions(jax.make_jaxpr(fn)(*args))
  both = next(r for r in regions if len(r.region.contractions) == 4)
  # Inputs with the row statistics softmax would give (launch.random_inputs),
  # one array per source (dO is read through two buffers: for dk's
  # do @ v.T and for dv's p.T @ do).
  xs = launch.random_inputs(both.region, seed=3)
  assert sorted(both.same_as) != list(range(len(xs)))
  xs = [xs[j] for j in both.same_as]
  got = jax.core.eval_jaxpr(both.jaxpr.jaxpr, both.jaxpr.consts, *xs)
  want = ir.evaluate(both.region, xs)
  assert len(got) == len(want) == 2
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32).reshape(w.shape),
                               np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_regions_that_share_no_product_are_not_merged():
  """Two attentions over different queries and keys compute nothing in
  common: one kernel over both would only lengthen the programs, so they
  stay two regions."""
  def fn(q1, k1, q2, k2, v):
    a = jax.nn.softmax(jnp.einsum("qd,kd->qk", q1, k1), axis=-1) @ v
    b = jax.nn.softmax(jnp.einsum("qd,kd->qk", q2, k2), axis=-1) @ v
    return a, b
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  args = [jax.random.normal(x, (128, 64), jnp.float32) for x in ks]
  regions = capture.find_regions(jax.make_jaxpr(fn)(*args))
  assert len(regions) == 2
  assert all(len(r.region.outputs) == 1 for r in regions)


def test_merges_that_write_a_product_or_nest_a_new_loop_are_refused():
  """The two rules in front of the model's verdict (``capture.merged``): a
  merged region writing an output as large as its widest product (BERT
  training's ds with dv: slower on the GPU), and a merged plan nesting more
  loops than either part's (the split head dimensions the model prices
  1.3-1.5x too fast)."""
  from jaxfuse.planner import plan as plan_lib  # pylint: disable=g-import-not-at-top
  r = testing.gemm_chain(M=64, N=256, K=32, H=32)
  assert not capture._writes_a_product(r)   # pylint: disable=protected-access
  c = r.value("C")
  wide = Region(r.loops, r.values, r.inputs,
                r.outputs + (Buffer("C", (1, 64, 256), (("b", 64 * 256), ("m", 256), ("n", 1))),),
                r.ops, name="wide")
  assert c.loops == ("b", "m", "n")
  assert capture._writes_a_product(wide)   # pylint: disable=protected-access
  flat = plan_lib.parse_plan("grid(m) (LA,n(LB,CC,LD,CE),SE)  tiles(b=1, m=64, n=64, k=32, h=32)  "
                             "warps=4 stages=3")
  nested = plan_lib.parse_plan("grid(m) (n(k(LA,LB,CC),LD,CE),SE)  tiles(b=1, m=64, n=64, k=16, "
                               "h=32)  warps=4 stages=3")
  assert capture._nested_loops(flat.expr) == 0   # pylint: disable=protected-access
  assert capture._nested_loops(nested.expr) == 1   # pylint: disable=protected-access
