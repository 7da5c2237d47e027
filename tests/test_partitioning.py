"""jaxfuse.runtime.partitioning: which loops of a region may be split across
devices, the region at a device's extents, and the rule XLA is given. The
partitioned program itself runs in tests/test_sharding.py (4 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import capture, ir
from jaxfuse.runtime import launch, partitioning


def _region(fn, *shapes, dtype=jnp.float32):
  args = [jnp.zeros(s, dtype) for s in shapes]
  found = capture.find_regions(jax.make_jaxpr(fn)(*args))
  assert len(found) == 1
  return found[0].region


def attn(q, k, v):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def causal(q, k, v):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
  t = q.shape[2]
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def chain(a, b, d):
  return jnp.tanh(a @ b) @ d


ATTN = ((2, 2, 32, 16),) * 3


def test_attention_may_split_batch_heads_and_query_rows_not_reductions():
  r = _region(attn, *ATTN)
  spec = partitioning.partition_spec(r)
  assert spec is not None
  # q: b g m k; k: b g n k; v: b g n h; out: b g m h (capture's loop names).
  q_axes, k_axes, v_axes = spec.in_axes
  free = {l for axes in spec.in_axes + spec.out_axes for l in axes if l}
  reduced = r.reduced_loops()
  assert free and not free & reduced
  assert q_axes[:3] == spec.out_axes[0][:3] and q_axes[3] is None   # the head dim is reduced
  assert k_axes[2:] == (None, None)                                  # keys and head dim: reduced
  assert v_axes[2] is None and v_axes[3] == spec.out_axes[0][3]      # keys reduced, v's columns not
  rule, whole = spec.rule()
  ins, outs = rule.split(" -> ")
  assert len(ins.split(", ")) == 3 and len(outs.split(", ")) == 1
  assert len(whole) == 4 and all(w in rule for w in whole)


def test_a_masked_loop_stays_whole():
  """A causal mask compares iotas of the query and key loops: a device's
  share of query rows would restart its iota at 0."""
  spec = partitioning.partition_spec(_region(causal, *ATTN))
  plain = partitioning.partition_spec(_region(attn, *ATTN))
  q_row = plain.in_axes[0][2]
  assert q_row is not None
  assert spec is not None and q_row not in {l for a in spec.in_axes for l in a}


@pytest.mark.parametrize("fn,shapes,axis", [
    (attn, ATTN, 0),          # batch
    (attn, ATTN, 2),          # query rows
    (chain, ((32, 16), (16, 24), (24, 8)), 0),   # rows of a GEMM chain
])
def test_local_region_computes_a_shard_of_the_whole(fn, shapes, axis):
  r = _region(fn, *shapes)
  spec = partitioning.partition_spec(r)
  loop = spec.out_axes[0][axis]
  assert loop is not None
  n = 2
  local = partitioning.local_region(r, {loop: r.extent(loop) // n})
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal(s).astype(np.float32) for s in ir.operand_shapes(r.inputs)]
  (whole,) = ir.evaluate(r, xs)
  for i in range(n):
    shard = []
    for x, axes in zip(xs, spec.in_axes):
      if loop in axes:
        a = axes.index(loop)
        x = np.take(x, range(i * x.shape[a] // n, (i + 1) * x.shape[a] // n), axis=a)
      shard.append(x)
    (got,) = ir.evaluate(local, shard)
    want = np.take(whole, range(i * whole.shape[axis] // n, (i + 1) * whole.shape[axis] // n),
                   axis=axis)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if i == 0:
      # The shard's own kernel (Triton's interpreter) computes it too.
      (k_out,) = launch.run_interpreted(launch.select_kernel(
          local, launch.ranked_plans(local)[:4], backend="interpret"), shard)
      # float32 dots run as TF32 in the kernel: the self-check's measure.
      assert launch.compare(local, [k_out], [want]) <= launch.tolerance(local)


def test_window_operands_take_no_rule():
  """A static window of an input (a packed QKV's split) is read at an
  offset into the whole array: a device's shard has no such layout."""
  def packed(qkv):
    q, k, v = jnp.split(qkv, 3, axis=-1)
    return attn(q, k, v)
  r = _region(packed, (2, 2, 32, 48))
  assert any(b.window for b in r.inputs)
  assert partitioning.partition_spec(r) is None
