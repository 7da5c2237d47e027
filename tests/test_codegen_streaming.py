"""Streaming analysis: which reduced loops may be tiled sequentially."""

from __future__ import annotations

import dataclasses

from jaxfuse import ir
from jaxfuse.codegen import streaming, testing
from jaxfuse.ir import Elementwise, Literal, Region, Value


def test_gemm_chain_loops_accumulate_plainly():
  info = streaming.analyze(testing.gemm_chain())
  assert info.single_tile == {}
  assert set(info.streamed) == {"k", "n"}
  assert not info.is_online("n") and not info.is_online("k")
  assert info.streamed["n"].accumulators == (("E", None),)
  assert info.streamed["k"].post == ("E",)


def test_attention_softmax_streams_online_with_deferred_division():
  r = testing.attention(bias=True, mask=True, causal=True)
  info = streaming.analyze(r)
  assert info.single_tile == {}
  n = info.streamed["n"]
  assert info.is_online("n")
  assert n.running_max == ("mx",)
  acc = dict(n.accumulators)
  assert acc["l"] == streaming.Scale(max="mx", base="e")
  assert acc["O"].deferred == (("div", "l"),)
  assert dict(n.deferred) == {"pn": "p"}


def _replace_op(r: Region, out: str, new_op) -> Region:
  ops = tuple(new_op if o.out == out else o for o in r.ops)
  return Region(r.loops, r.values, r.inputs, r.outputs, ops, name=r.name)


def test_nonlinear_use_of_softmax_forces_single_tile():
  r = testing.attention()
  # pn = p / l squared: the division no longer commutes with the contraction.
  vals = r.values + (Value("pq", ("b", "g", "m", "n"), "float32"),)
  ops = []
  for o in r.ops:
    if o.out == "ph":
      ops.append(Elementwise("pq", "mul", ("pn", "pn")))
      ops.append(Elementwise("ph", "convert", ("pq",)))
    else:
      ops.append(o)
  r2 = Region(r.loops, vals, r.inputs, r.outputs, tuple(ops))
  info = streaming.analyze(r2)
  assert "n" in info.single_tile and not info.can_tile("n")
  assert info.can_tile("d")


def test_softmax_output_along_loop_forces_single_tile():
  r = testing.attention()
  outs = r.outputs + (ir.Buffer("pn", (1, 1, 64, 64), (("b", 4096), ("g", 4096), ("m", 64), ("n", 1))),)
  r2 = Region(r.loops, r.values, r.inputs, outs, r.ops)
  info = streaming.analyze(r2)
  assert "pn" in info.single_tile["n"]


def test_scaled_shift_by_literal_and_exp2():
  r = testing.attention()
  vals = r.values + (Value("z2", ("b", "g", "m", "n"), "float32"),)
  ops = []
  for o in r.ops:
    ops.append(o)
    if o.out == "z":
      ops.append(Elementwise("z2", "mul", ("z", Literal(1.4426950408889634, "float32"))))
  ops = [Elementwise("p", "exp2", ("z2",)) if o.out == "p" else o for o in ops]
  info = streaming.analyze(Region(r.loops, vals, r.inputs, r.outputs, tuple(ops)))
  sc = dict(info.streamed["n"].accumulators)["O"]
  assert sc.base == "2" and abs(sc.coef - 1.4426950408889634) < 1e-12


def test_masked_tile_relation_of_a_causal_mask():
  # keep iota(m) cmp iota(n)  <=>  n flip(cmp) m: the key tiles outside it are skipped
  for cmp, band in (("ge", streaming.Band("m", upper=0)), ("gt", streaming.Band("m", upper=-1)),
                    ("le", streaming.Band("m", lower=0)), ("lt", streaming.Band("m", lower=1))):
    r = testing.attention(causal=cmp)
    assert streaming.masked_tile_relations(r) == {"n": band}, cmp
  # A data mask or none: every key tile may contribute.
  assert streaming.masked_tile_relations(testing.attention()) == {}
  assert streaming.masked_tile_relations(testing.attention(mask=True)) == {}
  # A plain sum along n sees masked scores (exp(-inf) is added to no max).
  assert streaming.masked_tile_relations(testing.gemm_chain()) == {}


def test_a_causal_mask_is_read_through_a_cast_to_float32_of_either_16_bit_type():
  """A training step's softmax runs in float32 of 16-bit scores: the mask
  is read through the cast for bfloat16 as for float16 (numpy gives
  bfloat16 kind 'V', which once hid it: the kernel then ran every key
  tile of a causal bfloat16 step)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top

  def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
  for dtype in (jnp.float16, jnp.bfloat16):
    x = jax.ShapeDtypeStruct((2, 512, 4, 64), dtype)
    [found] = capture.find_regions(jax.make_jaxpr(attention)(x, x, x))
    assert streaming.masked_tile_relations(found.region) == {"n": streaming.Band("m", upper=0)}
