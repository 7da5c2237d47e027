"""Chain IR: invariants, canonical signature, and the NumPy evaluator."""

import dataclasses

import numpy as np
import pytest

from jaxfuse import ir
from jaxfuse.ir import (Buffer, Contraction, Elementwise, Iota, Literal, Loop,
                        Reduction, Region, Value)


def _chain(B=2, M=5, N=7, K=3, H=4, dtype="float32", names=("b", "m", "n", "k", "h"),
           transposed_b=True):
  b, m, n, k, h = names
  loops = (Loop(b, B), Loop(m, M), Loop(n, N), Loop(k, K), Loop(h, H))
  vals = (Value("A", (b, m, k), dtype), Value("Bt", (b, k, n), dtype),
          Value("D", (b, n, h), dtype), Value("C", (b, m, n), dtype),
          Value("E", (b, m, h), dtype))
  if transposed_b:  # B stored as [b, n, k]: a stride map, not a copy
    bbuf = Buffer("Bt", (B, N, K), ((b, N * K), (k, 1), (n, K)))
  else:
    bbuf = Buffer("Bt", (B, K, N), ((b, K * N), (k, N), (n, 1)))
  return Region(loops, vals,
                (Buffer("A", (B, M, K), ((b, M * K), (m, K), (k, 1))), bbuf,
                 Buffer("D", (B, N, H), ((b, N * H), (n, H), (h, 1)))),
                (Buffer("E", (B, M, H), ((b, M * H), (m, H), (h, 1))),),
                (Contraction("C", "A", "Bt", (k,)), Contraction("E", "C", "D", (n,))))


def test_gemm_chain_evaluates_with_transposed_operand():
  rng = np.random.default_rng(0)
  r = _chain()
  A, Bt, D = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 7, 4))
  (out,) = ir.evaluate(r, [A, Bt, D])
  np.testing.assert_allclose(out, (A @ Bt.transpose(0, 2, 1)) @ D, rtol=1e-12)


def test_native_precision_rounds_to_dtype():
  rng = np.random.default_rng(1)
  r = _chain(dtype="float16", transposed_b=False)
  args = [rng.normal(size=s).astype(np.float16) for s in [(2, 5, 3), (2, 3, 7), (2, 7, 4)]]
  (exact,) = ir.evaluate(r, args)
  (native,) = ir.evaluate(r, args, precision="native")
  assert native.dtype == np.float16
  ref = (args[0].astype(np.float64) @ args[1]) @ args[2]
  np.testing.assert_allclose(exact, ref, rtol=1e-12)
  assert np.linalg.norm(native - ref) / np.linalg.norm(ref) < 5e-3


def test_signature_ignores_names_but_not_shapes_or_layout():
  a = _chain()
  b = _chain(names=("p", "q", "r", "s", "t"))
  assert a.signature() == b.signature() and a == b and hash(a) == hash(b)
  assert _chain(M=6).signature() != a.signature()
  assert _chain(transposed_b=False).signature() != a.signature()
  assert _chain(dtype="float16").signature() != a.signature()


def test_str_is_einsum_like():
  r = _chain()
  text = str(r)
  assert "C[b,m,n] float32 = sum_k A[b,m,k] * Bt[b,k,n]" in text
  assert r.einsum_summary() == "bmk,bkn->bmn ; bmn,bnh->bmh"


def test_costs():
  r = _chain(B=2, M=5, N=7, K=3, H=4)
  assert r.flops() == 2 * 2 * 5 * 7 * 3 + 2 * 2 * 5 * 7 * 4
  assert r.min_bytes() == 4 * (2 * 5 * 3 + 2 * 7 * 3 + 2 * 7 * 4 + 2 * 5 * 4)
  assert r.spatial_loops() == ("b", "m", "h")
  assert r.reduced_loops() == {"k", "n"}


def _attention(M=6, N=9, D=4, causal=True):
  loops = (Loop("m", M), Loop("n", N), Loop("d", D), Loop("e", D))
  f32 = "float32"
  vals = [Value("q", ("m", "d"), f32), Value("k", ("n", "d"), f32), Value("v", ("n", "e"), f32),
          Value("bias", ("n",), f32),
          Value("s", ("m", "n"), f32), Value("s2", ("m", "n"), f32), Value("sb", ("m", "n"), f32),
          Value("im", ("m",), "int32"), Value("in", ("n",), "int32"), Value("keep", ("m", "n"), "bool"),
          Value("sm", ("m", "n"), f32), Value("mx", ("m",), f32), Value("z", ("m", "n"), f32),
          Value("p", ("m", "n"), f32), Value("l", ("m",), f32), Value("pn", ("m", "n"), f32),
          Value("o", ("m", "e"), f32)]
  ops = [Contraction("s", "q", "k", ("d",)),
         Elementwise("s2", "mul", ("s", Literal(0.5, f32))),
         Elementwise("sb", "add", ("s2", "bias")),
         Iota("im", "m"), Iota("in", "n"),
         Elementwise("keep", "ge", ("im", "in")),
         Elementwise("sm", "select", ("keep", Literal(float("-inf"), f32), "sb")),
         Reduction("mx", "max", "sm", "n"),
         Elementwise("z", "sub", ("sm", "mx")),
         Elementwise("p", "exp", ("z",)),
         Reduction("l", "sum", "p", "n"),
         Elementwise("pn", "div", ("p", "l")),
         Contraction("o", "pn", "v", ("n",))]
  if not causal:
    ops = [o for o in ops if o.out not in ("im", "in", "keep", "sm")]
    ops = [Reduction("mx", "max", "sb", "n") if o.out == "mx" else
           Elementwise("z", "sub", ("sb", "mx")) if o.out == "z" else o for o in ops]
    vals = [v for v in vals if v.name not in ("im", "in", "keep", "sm")]
  bufs = (Buffer("q", (M, D), (("m", D), ("d", 1))), Buffer("k", (N, D), (("n", D), ("d", 1))),
          Buffer("v", (N, D), (("n", D), ("e", 1))), Buffer("bias", (N,), (("n", 1),)))
  return Region(loops, tuple(vals), bufs, (Buffer("o", (M, D), (("m", D), ("e", 1))),), tuple(ops))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_bias_and_causal_mask(causal):
  rng = np.random.default_rng(2)
  q, k, v, bias = rng.normal(size=(6, 4)), rng.normal(size=(9, 4)), rng.normal(size=(9, 4)), rng.normal(size=9)
  s = q @ k.T * 0.5 + bias
  if causal:
    s = np.where(np.arange(6)[:, None] >= np.arange(9)[None, :], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  ref = (p / p.sum(-1, keepdims=True)) @ v
  (out,) = ir.evaluate(_attention(causal=causal), [q, k, v, bias])
  np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_split_dims_and_broadcast_in_buffers():
  # x[m, (h d)] read as loops m, h, d: a reshape that splits a dim is a stride map.
  M, H, Dd, N = 3, 2, 4, 5
  loops = (Loop("m", M), Loop("h", H), Loop("d", Dd), Loop("n", N))
  f = "float32"
  vals = (Value("x", ("h", "m", "d"), f), Value("y", ("h", "n", "d"), f),
          Value("s", ("h", "m", "n"), f), Value("z", ("h", "n", "d"), f),
          Value("o", ("h", "m", "d"), f))
  r = Region(loops, vals,
             (Buffer("x", (M, H * Dd), (("h", Dd), ("m", H * Dd), ("d", 1))),
              Buffer("y", (N, Dd), (("n", Dd), ("d", 1))),   # broadcast over h
              Buffer("z", (N, H * Dd), (("h", Dd), ("n", H * Dd), ("d", 1)))),
             (Buffer("o", (H, M, Dd), (("h", M * Dd), ("m", Dd), ("d", 1))),),
             (Contraction("s", "x", "y", ("d",)), Contraction("o", "s", "z", ("n",))))
  rng = np.random.default_rng(3)
  x, y, z = rng.normal(size=(M, H * Dd)), rng.normal(size=(N, Dd)), rng.normal(size=(N, H * Dd))
  xs = x.reshape(M, H, Dd).transpose(1, 0, 2)
  zs = z.reshape(N, H, Dd).transpose(1, 0, 2)
  ref = np.einsum("hmd,nd->hmn", xs, y) @ zs
  (out,) = ir.evaluate(r, [x, y, z])
  np.testing.assert_allclose(out, ref, rtol=1e-12)


@pytest.mark.parametrize("mutate,msg", [
    (lambda r: r.ops[::-1], "before it is defined"),
    (lambda r: (Contraction("C", "A", "Bt", ("h",)),) + r.ops[1:], "reduces a loop"),
])
def test_invalid_regions_are_rejected(mutate, msg):
  r = _chain()
  with pytest.raises(ir.IRError, match=msg):
    Region(r.loops, r.values, r.inputs, r.outputs, mutate(r))


def test_buffer_past_shape_rejected():
  r = _chain()
  bad = Buffer("A", (2, 5, 3), (("b", 15), ("m", 3), ("k", 2)))
  with pytest.raises(ir.IRError, match="past its shape"):
    Region(r.loops, r.values, (bad,) + r.inputs[1:], r.outputs, r.ops)


def test_evaluate_checks_arguments():
  r = _chain()
  with pytest.raises(ValueError, match="takes 3 inputs"):
    ir.evaluate(r, [np.zeros((2, 5, 3))])
  with pytest.raises(ValueError, match="shape"):
    ir.evaluate(r, [np.ones((2, 5, 4)), np.ones((2, 7, 3)), np.ones((2, 7, 4))])
  with pytest.raises(ValueError, match="precision"):
    ir.evaluate(r, [np.ones((2, 5, 3)), np.ones((2, 7, 3)), np.ones((2, 7, 4))], precision="fp8")


def test_jax_reference_matches_numpy_evaluator():
  """jaxfuse.runtime.reference (the GPU self-check's reference) agrees with
  the NumPy ground truth, split/broadcast buffers and causal masks included."""
  import jax.numpy as jnp
  from jaxfuse.runtime import reference
  rng = np.random.default_rng(5)
  r = _chain()
  # The output stored transposed ([b, h, m]): the scatter path, not a reshape.
  e_t = Buffer("E", (2, 4, 5), (("b", 20), ("m", 1), ("h", 5)))
  transposed_out = Region(r.loops, r.values, r.inputs, (e_t,), r.ops)
  for region in (r, transposed_out, _attention(causal=True)):
    xs = [rng.normal(size=b.shape).astype(np.float32) for b in region.inputs]
    want = ir.evaluate(region, xs)
    got = reference.evaluate(region, [jnp.asarray(x) for x in xs])
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5)


def test_unfused_intensity_counts_intermediates():
  r = _chain(B=2, M=5, N=7, K=3, H=4)
  c_bytes = 2 * 5 * 7 * 4  # C[b,m,n] float32, written and read once
  assert r.unfused_bytes() == r.min_bytes() + 2 * c_bytes
  assert r.unfused_intensity() == r.flops() / r.unfused_bytes()
  assert r.unfused_intensity() < r.arithmetic_intensity()


def test_xla_epilogue_split_finds_the_value_read_twice():
  """GELU reads the biased GEMM result twice: XLA cuts its epilogue there.
  A single-use epilogue (relu) and a chain of two contractions have no cut."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)
  gelu = lambda x, w, b: jax.nn.gelu(x @ w + b)
  [r] = capture.find_regions(jax.make_jaxpr(gelu)(sd(8, 16), sd(16, 32), sd(32)))
  cut = ir.xla_epilogue_split(r.region)
  add = next(op for op in r.region.ops if isinstance(op, ir.Elementwise))
  assert add.fn == "add" and cut == add.out
  dot = r.region.contractions[0]
  relu = (dot, ir.Elementwise(add.out, "max", (dot.out, ir.Literal(0.0, "float16"))))
  region = dataclasses.replace(r.region, ops=relu, outputs=(
      dataclasses.replace(r.region.outputs[0], value=add.out),))
  assert ir.xla_epilogue_split(region) is None
  chain = lambda a, b, d: jax.nn.gelu(a @ b) @ d
  [c] = capture.find_regions(jax.make_jaxpr(chain)(sd(8, 16), sd(16, 32), sd(32, 8)))
  assert ir.xla_epilogue_split(c.region) is None


@pytest.mark.parametrize("fn,args,dropped", [
    ("and", (Literal(True, "bool"), "p"), True),
    ("and", ("p", Literal(True, "bool")), True),
    ("or", ("p", Literal(False, "bool")), True),
    ("select", ("p", Literal(False, "bool"), Literal(True, "bool")), True),
    ("select", ("p", Literal(True, "bool"), Literal(False, "bool")), False),   # not p
    ("and", ("p", Literal(False, "bool")), False),
    ("or", (Literal(True, "bool"), "p"), False),
])
def test_simplify_drops_boolean_identities(fn, args, dropped):
  """``jax.nn.dot_product_attention`` masks with ``and(True, select_n(tril,
  False, True))``: the identities go, leaving the compare of two iotas that
  the code generator reads as a causal mask; other boolean ops stay, and the
  evaluator agrees either way."""
  loops = (Loop("m", 3), Loop("n", 4))
  vals = (Value("x", ("m", "n"), "float32"), Value("i", ("m",), "int32"),
          Value("j", ("n",), "int32"), Value("p", ("m", "n"), "bool"),
          Value("q", ("m", "n"), "bool"), Value("y", ("m", "n"), "float32"))
  x = Buffer("x", (3, 4), (("m", 4), ("n", 1)))
  r = Region(loops, vals, (x,), (Buffer("y", (3, 4), (("m", 4), ("n", 1))),),
             (Iota("i", "m"), Iota("j", "n"), Elementwise("p", "ge", ("i", "j")),
              Elementwise("q", fn, args),
              Elementwise("y", "select", ("q", Literal(-np.inf, "float32"), "x"))))
  s = ir.simplify(r)
  assert ("q" not in {op.out for op in s.ops}) == dropped
  if dropped:
    assert s.producer("y").args[0] == "p"
  xs = [np.arange(12, dtype=np.float32).reshape(3, 4)]
  np.testing.assert_array_equal(ir.evaluate(s, xs)[0], ir.evaluate(r, xs)[0])


def test_vector_dot_dims():
  """XLA runs an unbatched dot with one output row or column as a reduction."""
  assert ir.vector_dot_dims(1, 3072, 1)
  assert ir.vector_dot_dims(3072, 1, 1)
  assert not ir.vector_dot_dims(8, 3072, 1)
  assert not ir.vector_dot_dims(1, 3072, 4)   # batched: not measured, not counted


def test_simplify_renames_an_output_to_its_identity_operand():
  """A training step's forward writes softmax's ``max(-inf, max_n s)`` for
  its backward: the output becomes ``max_n s`` itself, so the running max
  stays visible to the streaming analysis; not where that operand is
  written already (one value is never two outputs)."""
  loops = (Loop("m", 3), Loop("n", 4))
  vals = (Value("x", ("m", "n"), "float32"), Value("r", ("m",), "float32"),
          Value("y", ("m",), "float32"))
  x = Buffer("x", (3, 4), (("m", 4), ("n", 1)))
  ops = (Reduction("r", "max", "x", "n"),
         Elementwise("y", "max", (Literal(-np.inf, "float32"), "r")))
  out_y = Buffer("y", (3,), (("m", 1),))
  r = Region(loops, vals, (x,), (out_y,), ops)
  s = ir.simplify(r)
  assert s.output_names == ("r",) and [op.out for op in s.ops] == ["r"]
  xs = [np.arange(12, dtype=np.float32).reshape(3, 4)]
  np.testing.assert_array_equal(ir.evaluate(s, xs)[0], ir.evaluate(r, xs)[0])
  both = Region(loops, vals, (x,), (Buffer("r", (3,), (("m", 1),)), out_y), ops)
  assert ir.simplify(both).output_names == ("r", "y")


def test_shared_array_labels():
  """with_shared_arrays labels the inputs that receive one array; only
  equal plain buffers join, the label keys the signature, and the array
  counts once in min_bytes."""
  from jaxfuse.codegen import testing  # pylint: disable=g-import-not-at-top
  plain = testing.reread_chain(M=32, N=48, K=32, H=32, one_array=False)
  r = ir.with_shared_arrays(plain, (0, 1, 1))
  assert [b.array for b in r.inputs] == [0, 2, 2]
  assert r.same_array() == {"W2": "W"}
  assert plain.same_array() == {}
  assert "array(1)" in r.canonical().to_text() and "array(2)" not in r.canonical().to_text()
  assert r.signature() != plain.signature()
  assert plain.min_bytes() - r.min_bytes() == 48 * 32 * 4
  # Labels on buffers of another shape join nothing.
  other = ir.with_shared_arrays(testing.reread_chain(K=32, H=16, one_array=False), (0, 1, 1))
  assert other.same_array() == {}
  with pytest.raises(ir.IRError, match="earlier first use"):
    ir.with_shared_arrays(plain, (0, 2, 2))
  with pytest.raises(ir.IRError, match="2 entries for 3 inputs"):
    ir.with_shared_arrays(plain, (0, 1))
  out = dataclasses.replace(plain.outputs[0], array=1)
  with pytest.raises(ir.IRError, match="array label"):
    dataclasses.replace(plain, outputs=(out,))


def test_lookups_are_built_once_and_handed_out_as_copies():
  """A Region builds its value and extent maps, its ops' loops and its
  signature once (the planner asks hundreds of thousands of times per
  search). A caller that edits a returned map changes nothing, and a
  pickled region, caches and all, is the same region."""
  import pickle  # pylint: disable=g-import-not-at-top
  r = _chain()
  sig = r.signature()
  ext, vm = r.loop_extents, r.value_map
  ext["m"] = 99
  vm.pop("A")
  assert r.extent("m") == 5 and r.loop_extents["m"] == 5
  assert "A" in r.value_map and r.value("A").loops == ("b", "m", "k")
  c0 = r.contractions[0]
  assert r.op_loops(c0) == ("b", "m", "n", "k") and r.op_loops(c0) is r.op_loops(c0)
  assert ir.contraction_loops(r, c0) == (("m",), ("n",), ("b",), ("k",))
  back = pickle.loads(pickle.dumps(r))
  assert back.signature() == sig and back == r
  assert back.value_map == r.value_map and back.op_loops(c0) == r.op_loops(c0)
  # dataclasses.replace builds a new region with its own lookups.
  wider = dataclasses.replace(r, loops=tuple(Loop(l.name, 6 if l.name == "m" else l.extent)
                                             for l in r.loops),
                              inputs=(Buffer("A", (2, 6, 3), (("b", 18), ("m", 3), ("k", 1))),)
                              + r.inputs[1:],
                              outputs=(Buffer("E", (2, 6, 4), (("b", 24), ("m", 4), ("h", 1))),))
  assert wider.extent("m") == 6 and r.extent("m") == 5 and wider.signature() != sig


@pytest.mark.parametrize("sizes, kept", [
    (dict(B=1), ()),                  # a batch of one: no loop
    (dict(B=1, M=1), ("m",)),         # a one-row GEMM chain keeps its row loop
    (dict(B=1, H=1), ("h",)),         # ... and a one-column one its column loop
    (dict(B=1, K=1), ("k",)),         # a dot's only reduced loop
    (dict(B=2, M=1, N=1), ("m", "n")),
])
def test_drop_unit_loops_keeps_the_loops_a_dot_needs(sizes, kept):
  """``drop_unit_loops`` removes a size-1 loop unless it is a dot's only
  row, column or reduced loop; the region computes the same."""
  r = _chain(**sizes)
  d = ir.drop_unit_loops(r)
  d.validate()
  assert {l.name for l in d.loops if l.extent == 1} == set(kept)
  assert {l.name for l in r.loops} - {l.name for l in d.loops} == {
      l.name for l in r.loops if l.extent == 1} - set(kept)
  rng = np.random.default_rng(3)
  xs = [rng.normal(size=b.shape) for b in r.inputs]
  np.testing.assert_allclose(ir.evaluate(d, xs)[0], ir.evaluate(r, xs)[0], rtol=1e-12)
  assert ir.drop_unit_loops(d) == d


def test_drop_unit_loops_keeps_a_reduction_loop_and_a_lone_loop():
  """A row max over a size-1 loop and a value indexed by that loop alone
  keep it: the reduction needs a loop to run along, a value needs one."""
  loops = (Loop("m", 8), Loop("n", 1), Loop("k", 4))
  vals = (Value("A", ("m", "k"), "float32"), Value("B", ("k", "n"), "float32"),
          Value("C", ("m", "n"), "float32"), Value("R", ("m",), "float32"))
  r = Region(loops, vals, (Buffer("A", (8, 4), (("m", 4), ("k", 1))),
                           Buffer("B", (4, 1), (("k", 1), ("n", 1)))),
             (Buffer("R", (8,), (("m", 1),)),),
             (Contraction("C", "A", "B", ("k",)), Reduction("R", "max", "C", "n")))
  assert ir.drop_unit_loops(r) == r
