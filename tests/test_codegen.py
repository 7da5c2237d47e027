"""Generated Triton kernels, run in Triton's interpreter, against the IR evaluator.

Every kernel runs on fresh random inputs with NaN-poisoned outputs (so an
element the kernel forgets to write fails) and is compared in float64.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from jaxfuse import ir
from jaxfuse.codegen import CodegenError, generate, testing as T
from jaxfuse.codegen.compile import interpret_env
from jaxfuse.ir import Contraction, Elementwise, Literal, Value, Region
from jaxfuse.planner import pruning, tiling
from jaxfuse.planner.plan import Plan
from jaxfuse.runtime import launch


def run_and_check(region, plan, seed=0, tol=None):
  k = generate(region, plan, interpret=True)
  xs = launch.random_inputs(region, seed)
  outs = launch.run_interpreted(k, xs)
  refs = ir.evaluate(region, xs)
  err = launch.compare(region, outs, refs)
  tol = launch.tolerance(region) if tol is None else tol
  assert err <= tol, f"relative error {err:.3g} > {tol:g}\nplan: {plan}\n{k.source}"
  return k


# ----------------------------------------------------------------- GEMM chains
GEMM = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)

GEMM_PLANS = [
    (("b", "m"), [("n", [("k", [])])], dict(b=1, m=16, n=16, k=16)),        # deep n(k)
    (("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64)),                 # K in one tile
    (("b", "m", "h"), [("n", [("k", [])])], dict(b=1, m=16, n=16, k=16, h=16)),  # 2nd grid loop
    (("b", "m"), [], dict(b=1, m=32, n=64, k=64, h=32)),                    # everything in tiles
    (("b",), [("m", [("n", [("k", [])])])], dict(b=1, m=32, n=32, k=32)),   # m sequential
    (("m", "b"), [("n", [])], dict(b=1, m=4, n=16, k=64, h=32)),            # tiny m: no tl.dot
    (("b", "m"), [("n", [])], dict(b=1, m=1, n=8, k=64, h=32)),             # m scalar
    (("b", "m"), [("k", [])], dict(b=1, m=16, n=64, k=16, h=32)),           # only k sequential
]


@pytest.mark.parametrize("grid,tree,tiles", GEMM_PLANS)
def test_gemm_chain_plans(grid, tree, tiles):
  run_and_check(GEMM, T.simple_plan(GEMM, grid, tree, tiles))


def test_one_array_read_twice_is_loaded_once():
  """W and W2 receive one array: the kernel loads its tile once and reads
  it for both dots; random_inputs draws one array for both; with W2's loop
  split over programs, or without the label, it loads both."""
  r = T.reread_chain(M=40, N=48, K=32, H=32)
  plan = T.simple_plan(r, ("m",), [("n", [])], dict(m=16, n=16, k=32, h=32))
  k = run_and_check(r, plan)
  assert "tl.load(W2_ptr" not in k.source and k.source.count("tl.load(W_ptr") == 1
  xs = launch.random_inputs(r, 0)
  assert xs[1] is xs[2]
  split_h = T.simple_plan(r, ("m", "h"), [("n", [])], dict(m=16, n=16, k=32, h=16))
  assert "tl.load(W2_ptr" in run_and_check(r, split_h).source
  plain = T.reread_chain(M=40, N=48, K=32, H=32, one_array=False)
  assert "tl.load(W2_ptr" in run_and_check(plain, plan).source


def test_division_by_a_broadcast_vector_multiplies_by_its_reciprocal():
  """(A @ B) / s[m] prints one reciprocal per row and a multiply per
  element, and computes the quotient; a division of equal tiles divides."""
  ext = dict(m=40, n=24, k=16)
  f32 = "float32"
  buf = lambda v, ls: ir.Buffer(v, tuple(ext[l] for l in ls), tuple(
      zip(ls, ir.contiguous_strides([ext[l] for l in ls]))))
  r = Region(tuple(ir.Loop(l, e) for l, e in ext.items()),
             (Value("A", ("m", "k"), f32), Value("B", ("k", "n"), f32), Value("S", ("m",), f32),
              Value("D", ("m", "n"), f32), Value("C", ("m", "n"), f32), Value("Y", ("m", "n"), f32),
              Value("Z", ("m", "n"), f32)),
             (buf("A", "mk"), buf("B", "kn"), buf("S", "m"), buf("D", "mn")),
             (buf("Y", "mn"), buf("Z", "mn")),
             (Contraction("C", "A", "B", ("k",)), Elementwise("Y", "div", ("C", "S")),
              Elementwise("Z", "div", ("C", "D"))))
  k = run_and_check(r, T.simple_plan(r, ("m",), [("k", [])], dict(m=16, n=32, k=8)))
  assert "(1.0 / S)[:, None]" in k.source
  assert re.search(r"= \(\w+ / D\)", k.source)


def test_gemm_chain_plans_from_planner_placement():
  """Every skeleton the planner can place at these tiles generates a correct kernel."""
  tiles = dict(b=1, m=16, n=16, k=16, h=16)
  placed = 0
  for sk in tiling.enumerate_skeletons(GEMM):
    try:
      expr = tiling.place(GEMM, sk, tiles, grid=("b", "m"))
    except Exception:  # pylint: disable=broad-except  (the planner rejects it)
      continue
    plan = Plan(expr=expr, grid=("b", "m"), tiles=tuple((l.name, tiles[l.name]) for l in GEMM.loops))
    run_and_check(GEMM, plan)
    placed += 1
  assert placed >= 1


def test_plan_shows_up_in_source():
  k = generate(GEMM, T.simple_plan(GEMM, ("b", "m"), [("n", [("k", [])])], dict(b=1, m=16, n=16, k=16)),
               interpret=True)
  src = k.source
  assert "for start_n in range(0, N, BLOCK_N):" in src
  assert "    for start_k in range(0, K, BLOCK_K):" in src
  assert "acc_E = tl.dot(" in src and "tl.program_id(1)" in src
  assert k.grid == (3, 2) and k.constexprs["BLOCK_M"] == 16


def test_broadcast_product_over_tritons_tensor_limit_is_refused():
  # m=4 keeps the first contraction off tl.dot: its broadcast product is
  # 4 x 512 x 1024 = 2M elements, which Triton cannot compile.
  from jaxfuse.codegen import source
  r = T.gemm_chain(M=64, N=512, K=1024, H=16, B=1)
  plan = T.simple_plan(r, ("b", "m"), [], dict(b=1, m=4, n=512, k=1024, h=16))
  with pytest.raises(CodegenError, match="exceeds Triton's tensor limit"):
    source(r, plan)
  source(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=4, n=128, k=1024, h=16)))


def test_transposed_operands_and_unaligned_dims():
  r = T.gemm_chain(M=77, N=200, K=24, H=80, B=1, transpose_b=True, transpose_d=True)
  run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=32, n=64)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gemm_chain_dtypes(dtype):
  r = T.gemm_chain(M=33, N=48, K=32, H=16, dtype=dtype)
  run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))


@pytest.mark.parametrize("precision, printed", [
    ("default", "tf32"), ("tf32x3", "tf32x3"), ("ieee", "ieee")])
def test_float32_dots_print_the_regions_precision(precision, printed):
  # jax's DEFAULT precision runs float32 dots on TF32 tensor cores, as XLA
  # does; HIGHEST needs IEEE products (the interpreter computes both in fp32).
  r = T.with_precision(T.gemm_chain(M=33, N=48, K=32, H=16, dtype="float32"), precision)
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))
  assert k.source.count("input_precision=") == 2
  assert k.source.count(f'input_precision="{printed}"') == 2


def _tf32(x) -> np.ndarray:
  """float32 rounded to TF32's 10 mantissa bits, to nearest, ties away."""
  b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


_PRINTED_TF32 = None   # the generated module's tf32_ helper, for _tf32_probe


@triton.jit
def _tf32_probe(x_ptr, y_ptr, N: tl.constexpr):
  o = tl.arange(0, N)
  tl.store(y_ptr + o, _PRINTED_TF32(tl.load(x_ptr + o)))


def test_float32_dot_operands_are_rounded_to_tf32_at_default_precision():
  global _PRINTED_TF32
  r = T.gemm_chain(M=33, N=48, K=32, H=16, dtype="float32")
  k = generate(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)),
               interpret=True)
  # The printed helper on edge values: ties round away from zero, the low
  # bits drop, overflow goes to infinity, NaNs (a payload in the low bits
  # too) and infinities stay.
  one, ulp = 1.0, 2.0 ** -10             # TF32's spacing at 1
  bits = np.array([0x7F7FFFFF, 0x7F800001], np.uint32).view(np.float32)
  xs = np.array([one + ulp / 2, -(one + ulp / 2), one + ulp / 4, 3.0, 0.0, 1e-40,
                 np.inf, -np.inf, np.nan, *bits], np.float32)
  want = np.array([one + ulp, -(one + ulp), one, 3.0, 0.0, _tf32(np.float32(1e-40)),
                   np.inf, -np.inf, np.nan, np.inf, np.nan], np.float32)
  _PRINTED_TF32 = k.fn.fn.__globals__["tf32_"]
  x = torch.from_numpy(np.resize(xs, 16).copy())
  y = torch.empty_like(x)
  with interpret_env(True):
    _tf32_probe[(1,)](x, y, N=16)
  np.testing.assert_array_equal(y.numpy()[:len(xs)], want)
  a, b, d = launch.random_inputs(r, seed=2)
  (got,) = launch.run_interpreted(k, [a, b, d])
  # Every operand of both dots is rounded, the computed one (C) included.
  c = (_tf32(a).astype(np.float64) @ _tf32(b)).astype(np.float32)
  want = _tf32(c).astype(np.float64) @ _tf32(d)
  unrounded = (a.astype(np.float64) @ b) @ d
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < 1e-6 < np.linalg.norm(got - unrounded) / np.linalg.norm(unrounded)


def test_size_one_dims():
  r = T.gemm_chain(M=1, N=48, K=1, H=5, B=3, transpose_b=True, dtype="float16")
  run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))
  run_and_check(r, T.simple_plan(r, ("b",), [("n", [])], dict(b=1, m=1, n=16, k=1, h=8)))


def test_split_reduction_gemm_chain():
  plan = T.simple_plan(GEMM, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64), split=("n", 3))
  k = run_and_check(GEMM, plan)
  assert k.combine_fn is not None and k.scratch and "part * " in k.source


# ------------------------------------------------------------------ attention
@pytest.mark.parametrize("bias,mask,causal", [(False, False, False), (True, False, False),
                                              (False, True, False), (False, False, True),
                                              (True, True, True)])
def test_attention_streamed(bias, mask, causal):
  r = T.attention(M=40, N=72, D=24, B=2, heads=2, bias=bias, mask=mask, causal=causal)
  k = run_and_check(r, T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16)))
  assert "mx_prev" in k.source          # online softmax
  if causal:
    assert "tl.minimum(N, (pid_m + 1) * BLOCK_M)" in k.source   # tiles above the diagonal skipped


def test_softmax_max_reduces_unscaled_scores():
  """max(c*x) is printed as c*max(x) (exact for c > 0), so c*x keeps one use
  and fuses into the FMA of the shift; the kernel still matches the IR."""
  r = T.attention(M=40, N=72, D=24, B=2, heads=2)
  scale = next(op for op in r.ops if isinstance(op, Elementwise) and op.fn == "mul")
  x = next(a for a in scale.args if isinstance(a, str))
  k = run_and_check(r, T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16)))
  line = next(l for l in k.source.splitlines() if "tl.max(" in l)
  assert f"{x}, float(\"-inf\")), axis=1) * " in line, line


def test_attention_plans():
  r = T.attention(M=33, N=40, D=16, B=1, heads=2, causal=True, bias=True)
  g = ("b", "g", "m")
  run_and_check(r, T.simple_plan(r, g, [], dict(b=1, g=1, m=16)))                    # n in one tile
  run_and_check(r, T.simple_plan(r, ("b", "g"), [("m", [("n", [])])], dict(b=1, g=1, m=16, n=16)))
  run_and_check(r, T.simple_plan(r, g, [("n", [("d", [])])], dict(b=1, g=1, m=16, n=16, d=8)))
  run_and_check(r, T.simple_plan(r, g, [("n", [])], dict(b=1, g=1, m=1, n=16)))      # one row


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_attention_unaligned_head_dim_80(dtype):
  r = T.attention(M=77, N=200, D=80, heads=1, causal=True, dtype=dtype)
  k = run_and_check(r, T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=32, n=64)))
  assert k.constexprs["BLOCK_D"] == 128 and k.constexprs["BLOCK_E"] == 128
  # q.k reduces d: 64 + 16 pieces, one dot each; the output's e stays one masked tile.
  assert "# d in pieces of 64 + 16" in k.source and "offs_d_1 = 64 + tl.arange(0, 16)" in k.source
  assert "mask_e" in k.source and "offs_e_0" not in k.source and "mask_d" not in k.source


def test_split_causal_attention_with_a_pieced_head_dim():
  """Pieces in a split plan: the main kernel's q and k load in pieces; the
  combine pass, re-tiled, loads none of them."""
  r = T.attention(M=40, N=96, D=80, Dv=48, heads=2, causal=True, dtype="float16")
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16), split=("n", 3))
  k = run_and_check(r, plan)
  main, combine = k.source.split("_combine(")
  assert "# d in pieces of 64 + 16" in main and "offs_d_1" in main
  assert "Q_ptr +" not in combine


@pytest.mark.parametrize("K,pieces", [(80, (64, 16)), (72, (64, 16)), (208, (128, 64, 16))])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_single_k_tile_prints_as_pieces(K, pieces, dtype):
  """A K loop held in one tile whose extent is not a power of two prints as
  power-of-two pieces, one load and one chained tl.dot each; a piece
  padded past the extent (72 = 64 + 8 of 16) is masked."""
  r = T.gemm_chain(M=40, N=48, K=K, H=24, B=2, dtype=dtype)
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])],
                                     dict(b=1, m=16, n=16, k=tiling.next_pow2(K), h=32)))
  assert "# k in pieces of " + " + ".join(map(str, pieces)) in k.source, k.source
  assert k.source.count("tl.dot(") == len(pieces) + 1
  assert ("mask_k_1" in k.source) == (sum(pieces) > K)
  # Sequential k tiles (k=16) do not piece.
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [("k", [])])], dict(b=1, m=16, n=16, k=16, h=32)))
  assert "pieces" not in k.source


def test_split_attention_combines_max_sum_and_acc():
  r = T.attention(M=24, N=80, D=16, causal=True, mask=True)
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=16, n=16), split=("n", 3))
  k = run_and_check(r, plan)
  assert "part_mx_ptr" in k.source and "part_l_ptr" in k.source


def _programs(grid):
  return math.prod(grid)


def test_split_combine_pass_retiles_small_grids():
  """The combine pass of a split plan tiles the outputs finer than the main
  kernel when the main grid is small (masked edges on both loops), loads
  nothing it does not use, and still matches the IR."""
  r = T.gemm_chain(M=77, N=200, K=24, H=80, B=1)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=64, n=16), split=("n", 3))
  k = run_and_check(r, plan)
  assert k.constexprs["BLOCK_M"] == 64 and k.constexprs["BLOCK_H"] == 128
  assert k.combine_constexprs["BLOCK_M"] * k.combine_constexprs["BLOCK_H"] <= 1024
  assert _programs(k.combine_grid) > _programs(k.grid) // 3
  combine = k.source.split("_combine(")[1]
  assert "a_ptr +" not in combine and "bb_ptr +" not in combine


def test_split_combine_falls_back_to_main_tiles(monkeypatch):
  """When the re-tiled combine cannot be printed, the combine pass keeps
  the main kernel's tiles and statements, and still matches the IR."""
  from jaxfuse.codegen import triton_printer

  def fail(self, body, specs):
    raise CodegenError("forced")
  monkeypatch.setattr(triton_printer._Printer, "_combine_tiles", fail)
  r = T.gemm_chain(M=77, N=200, K=24, H=80, B=1)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=64, n=16), split=("n", 3))
  k = run_and_check(r, plan)
  assert k.combine_constexprs == k.constexprs
  assert _programs(k.combine_grid) == _programs(k.grid) // 3


def test_split_attention_combine_retiles_with_deferred_division():
  r = T.attention(M=100, N=72, D=40, B=2, heads=2)
  plan = T.simple_plan(r, ("b", "g", "m"), [("n", [])], dict(b=1, g=1, m=64, n=16), split=("n", 2))
  k = run_and_check(r, plan)
  assert _programs(k.combine_grid) > _programs(k.grid) // 2


# ------------------------------------------------------------------------ MLP
@pytest.mark.parametrize("acts,dtype", [(("gelu", "silu"), "float32"), (("tanh", "relu"), "float16"),
                                        (("relu", "gelu"), "bfloat16")])
def test_mlp_three_gemms(acts, dtype):
  r = T.mlp(M=37, dims=(24, 80, 40, 16), acts=acts, dtype=dtype)
  run_and_check(r, T.simple_plan(r, ("m",), [], dict(m=16)))
  run_and_check(r, T.simple_plan(r, ("m",), [("k0", [])], dict(m=16, k0=16)))


# ----------------------------------------------------- every elementwise fn
def _fn_region(fn: str) -> Region:
  """C = A@B; X = fn(C[, 0.7]) (as float); E = X@D."""
  f = "float32"
  base = T.gemm_chain(M=16, N=16, K=8, H=16)
  arity = ir.ELEMENTWISE_FNS[fn][0]
  lo = ("b", "m", "n")
  vals = list(base.values)
  ops = [base.ops[0]]
  boolean = fn in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not")
  if fn in ("and", "or", "not"):
    vals += [Value("P", lo, "bool"), Value("Y", lo, "bool")]
    ops.append(Elementwise("P", "gt", ("C", Literal(0.5, f))))
    args = ("P",) if arity == 1 else ("P", "P")
    ops.append(Elementwise("Y", fn, args))
  elif fn == "select":
    vals += [Value("P", lo, "bool"), Value("Y", lo, f)]
    ops += [Elementwise("P", "gt", ("C", Literal(0.5, f))),
            Elementwise("Y", "select", ("P", "C", Literal(-1.0, f)))]
  else:
    vals.append(Value("Y", lo, "bool" if boolean else f))
    args = ("C",) if arity == 1 else ("C", Literal(0.7, f))
    ops.append(Elementwise("Y", fn, args))
  if boolean:
    vals.append(Value("Yf", lo, f))
    ops.append(Elementwise("Yf", "convert", ("Y",)))
    y = "Yf"
  else:
    y = "Y"
  ops.append(Contraction("E", y, "D", ("n",)))
  return Region(base.loops, tuple(vals), base.inputs, base.outputs, tuple(ops))


@pytest.mark.parametrize("fn", sorted(ir.ELEMENTWISE_FNS))
def test_every_elementwise_fn(fn):
  # IEEE dots: the check is on the elementwise fn, at 2e-5.
  r = T.with_precision(_fn_region(fn), "ieee")
  k = generate(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)), interpret=True)
  rng = np.random.default_rng(5)
  # Positive inputs keep log/sqrt/pow in their domain; values cross 0.7 and 0.5.
  xs = [rng.uniform(0.05, 0.5, size=b.shape).astype(np.float32) for b in r.inputs]
  outs = launch.run_interpreted(k, xs)
  refs = ir.evaluate(r, xs)
  assert launch.compare(r, outs, refs) <= 2e-5


# ------------------------------------------------------------------ fallback
def test_broken_plan_falls_back_to_next():
  good = T.simple_plan(GEMM, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64))
  # k has several tiles but no place in the plan: cannot be generated.
  broken = Plan(expr=good.expr, grid=good.grid, tiles=tuple((l, 16 if l == "k" else t) for l, t in good.tiles))
  with pytest.raises(CodegenError, match="neither"):
    generate(GEMM, broken)
  k = launch.select_kernel(GEMM, [broken, good], backend="interpret")
  assert k.plan is good
  with pytest.raises(CodegenError, match="no plan produced a working kernel"):
    launch.select_kernel(GEMM, [broken], backend="interpret")


def test_numerical_self_check_rejects_wrong_kernel():
  plan = T.simple_plan(GEMM, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64))
  k = generate(GEMM, plan, interpret=True)

  def wrong(kernel, xs):
    return [o * 1.01 for o in launch.run_interpreted(kernel, xs)]

  with pytest.raises(CodegenError, match="self-check"):
    launch.self_check(k, wrong)
  launch.self_check(k, launch.run_interpreted)


def test_rule2_plan_rejected_clearly():
  plan = T.simple_plan(GEMM, ("b", "m"), [("n", [("k", []), ("h", [])])], dict(b=1, m=16, n=16, k=16, h=16))
  with pytest.raises(CodegenError, match="partial tiles"):
    generate(GEMM, plan)


def test_batched_dot_and_broadcast_operand():
  """Heads as a tile dim (3-D tl.dot), a split reshape as strides, an operand
  broadcast over heads (stride 0), no grid at all."""
  from jaxfuse.ir import Buffer, Loop  # pylint: disable=g-import-not-at-top
  M, H, Dd, N = 3, 2, 4, 5
  f = "float32"
  r = Region((Loop("m", M), Loop("h", H), Loop("d", Dd), Loop("n", N)),
             (Value("x", ("h", "m", "d"), f), Value("y", ("h", "n", "d"), f),
              Value("s", ("h", "m", "n"), f), Value("z", ("h", "n", "d"), f),
              Value("o", ("h", "m", "d"), f)),
             (Buffer("x", (M, H * Dd), (("h", Dd), ("m", H * Dd), ("d", 1))),
              Buffer("y", (N, Dd), (("n", Dd), ("d", 1))),
              Buffer("z", (N, H * Dd), (("h", Dd), ("n", H * Dd), ("d", 1)))),
             (Buffer("o", (H, M, Dd), (("h", M * Dd), ("m", Dd), ("d", 1))),),
             (Contraction("s", "x", "y", ("d",)), Contraction("o", "s", "z", ("n",))))
  k = run_and_check(r, T.simple_plan(r, (), [], dict(h=2, m=16, n=16, d=16)))
  assert "tl.broadcast_to(" in k.source and k.grid == (1,)
  run_and_check(r, T.simple_plan(r, ("h",), [], dict(h=1, m=16, n=16, d=16)))
  g = T.gemm_chain(M=40, N=48, K=40, H=24, B=3)
  run_and_check(g, T.simple_plan(g, ("m",), [("n", [])], dict(b=4, m=16, n=16, k=64)))


# ------------------------------------------------- Triton miscompile guard
def test_dot_hazard_matches_the_measured_miscompiles():
  """The tiles Triton got wrong on the H100 (rows 128, reduction 256, 16 or
  32 columns) are refused; the measured-correct neighbours are not."""
  from jaxfuse.codegen.triton_printer import dot_hazard
  r = T.gemm_chain(M=256, N=256, K=80, H=80, B=16)
  bad = [dict(b=1, m=128, n=256, k=128, h=16), dict(b=1, m=128, n=256, k=128, h=32)]
  good = [dict(b=1, m=128, n=256, k=128, h=64),
          dict(b=1, m=128, n=128, k=128, h=16), dict(b=1, m=256, n=64, k=128, h=16)]
  for t in bad:
    assert dot_hazard(r, t, tf32=False), t
  for t in good:   # float32 chain: its TF32 spill check is tested in test_planner
    assert dot_hazard(r, t, tf32=False) is None, t
  # Measured correct in the eleventh session, but straight-line code of the
  # family MCFuser G3 later failed in (64 rows, a whole 256-wide middle, 16
  # columns): refused since the seventy-third session.
  assert "no reduction loop" in dot_hazard(r, dict(b=1, m=64, n=256, k=128, h=16), tf32=False)


def test_hazardous_plan_is_refused_and_the_next_plan_runs():
  r = T.gemm_chain(M=256, N=256, K=80, H=80, B=1)
  bad = T.simple_plan(r, ("b", "m", "h"), [], dict(b=1, m=128, n=256, k=128, h=16))
  good = T.simple_plan(r, ("b", "m", "h"), [], dict(b=1, m=128, n=256, k=128, h=64))
  with pytest.raises(CodegenError, match="miscompiles"):
    generate(r, bad, interpret=True)
  k = launch.select_kernel(r, [bad, good], backend="interpret")
  assert k.plan is good


def test_chained_dot_of_an_elementwise_accumulator_is_refused():
  """MCFuser G1 at m=64, n=16, h=16 returned an error of 0.34 on the H100
  (forty-sixth session); the interpreter runs it correctly, so only the
  printer's refusal keeps it off the GPU."""
  r = T.gemm_chain(M=512, N=256, K=64, H=64, dtype="float16")
  bad = T.simple_plan(r, ("b", "m", "h"), [("n", [])], dict(b=1, m=64, n=16, k=64, h=16))
  with pytest.raises(CodegenError, match="accumulator.*miscompiles"):
    generate(r, bad, interpret=True)
  generate(r, T.simple_plan(r, ("b", "m", "h"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=16)),
           interpret=True)


def test_straight_line_chained_dot_is_refused():
  """Short middle loops (attention over 128 keys, a GEMM chain 64 wide in
  the middle) with every reduction one whole tile: a dot of the computed
  tile at >= 64 rows into <= 32 columns returned errors of 1.2-1.4 or an
  illegal memory access on the H100 (fiftieth session). A reduction loop
  in the first dot, or 64 columns, or fewer rows, was correct."""
  att = T.attention(M=128, N=128, D=64, B=1, heads=8, dtype="float16", scale=0.125)
  chain = T.gemm_chain(M=512, N=64, K=64, H=64, B=2, dtype="float16")
  # MCFuser G3: a whole 256-wide middle, 16 columns wrong (1.34), 32 columns
  # an illegal memory access (H100, sixty-ninth to seventy-third sessions).
  g3 = T.gemm_chain(M=512, N=256, K=64, H=256, B=1, dtype="float16")
  bad = [(att, dict(b=1, g=1, m=64, n=128, d=64, e=16)),
         (att, dict(b=1, g=1, m=128, n=128, d=64, e=32)),
         (chain, dict(b=1, m=64, n=64, k=64, h=32)),
         (g3, dict(b=1, m=64, n=256, k=64, h=16)),
         (g3, dict(b=1, m=64, n=256, k=64, h=32))]
  good = [(att, dict(b=1, g=1, m=64, n=128, d=32, e=16)),    # a d loop before the dot
          (att, dict(b=1, g=1, m=64, n=64, d=64, e=16)),     # an n loop (streaming)
          (att, dict(b=1, g=1, m=64, n=128, d=64, e=64)),
          (att, dict(b=1, g=1, m=32, n=128, d=64, e=32)),
          (chain, dict(b=1, m=64, n=64, k=32, h=32)),
          (g3, dict(b=1, m=64, n=128, k=64, h=16)),            # G3's pick: an n loop
          (g3, dict(b=1, m=64, n=256, k=64, h=64))]
  for r, t in bad:
    assert "no reduction loop" in (pruning.dot_hazard(r, t) or ""), t
  for r, t in good:
    assert pruning.dot_hazard(r, t) is None, t
  plan = T.simple_plan(chain, ("b", "m", "h"), [], dict(b=1, m=64, n=64, k=64, h=32))
  with pytest.raises(CodegenError, match="no reduction loop"):
    generate(chain, plan, interpret=True)
  # The planner's pick for 128-token attention avoids the corner.
  from jaxfuse.planner import plan_region   # pylint: disable=import-outside-toplevel
  for r in (att, g3):
    best = plan_region(r, "h100", use_cache=False).best
    assert pruning.dot_hazard(r, best.tile_map) is None, best


def test_planner_pick_with_a_batch_of_one_uses_tl_dot(monkeypatch):
  """BERT's FFN chain at batch 1: the activations carry a loop of extent 1
  that the weights do not. Its tile is 1 (a scalar index); it was 16, which
  ran 16x the work and turned both contractions into broadcast-and-sum code
  that Triton refused to compile (a 2M-element product tensor). Capture now
  drops that loop (ir.drop_unit_loops); the planner still takes a region
  that has one."""
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.planner import plan_region
  # x is a transposed view, so its size-1 loop does not merge into m
  # (ir.coalesce_loops), as it does for a contiguous [1, 64, 32] array.
  x = jnp.zeros((64, 1, 32), jnp.float16)
  w1 = jnp.zeros((32, 64), jnp.float16)
  w2 = jnp.zeros((64, 32), jnp.float16)
  fn = lambda x, a, b: jnp.tanh(x.transpose(1, 0, 2) @ a) @ b
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(x, w1, w2))
  assert all(l.extent > 1 for l in cap.region.loops)
  monkeypatch.setattr(ir, "drop_unit_loops", lambda r: r)
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(x, w1, w2))
  r = cap.region
  one = [l.name for l in r.loops if l.extent == 1]
  assert one and not set(one) & set(tiling.batch_loops(r))
  best = plan_region(r, "h100", use_cache=False).best
  assert all(best.tile_map[l] == 1 for l in one), best
  k = run_and_check(r, best)
  assert k.source.count("tl.dot(") == 2


def test_planner_pick_with_padded_tiles_runs():
  """Rule 3 keeps tiles that pad a non-power-of-two extent by up to a
  quarter (64 on 208, 32 on 80): the planner's pick for Chimera G9's shapes
  (one batch) uses them, with ragged last tiles on a grid axis (m) and a
  loop axis (n), and matches."""
  from jaxfuse.planner import examples, plan_region
  r = examples.gemm_chain(1, 208, 208, 80, 80, dtype="float16")
  best = plan_region(r, "h100", use_cache=False).best
  t = best.tile_map
  assert 208 % t["m"] and t["n"] < 208 and 208 % t["n"], best
  run_and_check(r, best)


def _captured(fn, *shapes):
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  args = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(*args))
  return cap.region


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_dot_product_attention_causal_skips_hidden_key_tiles(kv_heads):
  """``jax.nn.dot_product_attention(is_causal=True)`` masks with a finite
  fill (-0.7 x float32's max) through ``and(True, select(tril, False,
  True))``. The IR drops the boolean identities; since every query keeps
  key 0 the fill acts as -inf, so the kernel stops each query tile's key
  loop at the diagonal (before: every key tile ran); it matches the IR in
  Triton's interpreter."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  r = _captured(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
                (1, 200, 4, 16), (1, 200, kv_heads, 16), (1, 200, kv_heads, 16))
  assert not [op for op in r.ops if isinstance(op, Elementwise) and op.fn == "and"]
  [(loop, band)] = streaming.masked_tile_relations(r).items()
  assert (band.lower, band.upper) == (None, 0)
  other = band.other
  best = plan_region(r, "h100", use_cache=False).best
  assert other in best.grid and best.tile(loop) < r.extent(loop)
  k = run_and_check(r, best)
  assert f"tl.minimum({loop.upper()}, (pid_{other} + 1) * BLOCK_{other.upper()})" in k.source
  # The finite fill is rescaled with the softmax scale (exp2 fold), as -inf is.
  assert "tl.exp2(" in k.source and "tl.exp(" not in k.source


@pytest.mark.parametrize("fill,cmp,skips", [
    ("min", "ge", True),     # finfo.min (Flax's fill); every query keeps key 0
    ("min", "gt", False),    # query 0 keeps no key: it averages every value, skipped tiles too
    ("-inf", "gt", True),    # ... which -inf makes NaN either way
    ("-1e3", "ge", False),   # not far enough below a score to weigh 0
])
def test_finite_mask_fill_skips_tiles_only_where_exact(fill, cmp, skips):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  value = {"min": float(np.finfo(np.float32).min), "-inf": -np.inf, "-1e3": -1e3}[fill]

  def attend(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    qi, ki = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    s = jnp.where(qi >= ki if cmp == "ge" else qi > ki, s, value)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

  r = _captured(attend, (2, 70, 16), (2, 70, 16), (2, 70, 16))
  assert streaming.masked_tile_relations(r) == (
      {"n": streaming.Band("m", upper=0 if cmp == "ge" else -1)} if skips else {})
  if fill == "-inf":
    return   # query 0's row is NaN in the reference too
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))
  # The key loop stops at the query tile's last index only where it skips.
  assert ("(pid_m + 1) * BLOCK_M" in k.source) == skips


_T = 70
_IDIOMS = {
    # keep where the lower triangle is set
    "where(tril(bool), s, -inf)": lambda s, jnp: jnp.where(jnp.tril(jnp.ones((_T, _T), bool)), s, -jnp.inf),
    # PyTorch's masked_fill(tril == 0, -inf), as nanoGPT writes it
    "where(tril == 0, -inf, s)": lambda s, jnp: jnp.where(jnp.tril(jnp.ones((_T, _T))) == 0, -jnp.inf, s),
    # hide where the strict upper triangle is set
    "where(triu(bool, 1), -inf, s)": lambda s, jnp: jnp.where(jnp.triu(jnp.ones((_T, _T), bool), 1), -jnp.inf, s),
    # an additive mask
    "s + where(tril, 0, -1e9)": lambda s, jnp: s + jnp.where(jnp.tril(jnp.ones((_T, _T), bool)), 0.0, -1e9),
    # the fill where a bare compare holds
    "where(i < j, -inf, s)": lambda s, jnp: jnp.where(
        jnp.arange(_T)[:, None] < jnp.arange(_T)[None, :], -jnp.inf, s),
    "where(~(i < j), s, min)": lambda s, jnp: jnp.where(
        ~(jnp.arange(_T)[:, None] < jnp.arange(_T)[None, :]), s, jnp.finfo(jnp.float32).min),
}


@pytest.mark.parametrize("cmp", ["ge", "gt"])
def test_a_backward_under_a_finite_fill_skips_tiles_where_every_row_keeps_one(cmp):
  """``jax.nn.dot_product_attention``'s backward recomputes ``p =
  exp(where(keep, s, fill) - m) / l`` with ``fill`` -0.7 x float32's max,
  and dv = p^T do streams the queries. exp(fill - m) is 0 where the
  forward's row max m is a kept score: every query keeps a key ('ge'), and
  the kernel starts each key tile's query loop at the diagonal. Under 'gt'
  query 0 keeps none (its m is the fill, its p weighs every key): every
  tile runs. Both match the IR in Triton's interpreter."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner.plan import parse_plan  # pylint: disable=g-import-not-at-top

  def dv(q, k, do, m, l):
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    i = jnp.arange(_T)
    keep = i[:, None] >= i[None, :] if cmp == "ge" else i[:, None] > i[None, :]
    s = jnp.where(keep, s, -0.7 * jnp.finfo(jnp.float32).max)
    p = jnp.exp(s - m[..., None]) / l[..., None]
    return jnp.einsum("bqk,bqd->bkd", p, do)

  r = _captured(dv, (2, _T, 16), (2, _T, 16), (2, _T, 16), (2, _T), (2, _T))
  want = {"n": streaming.Band("m", lower=0)} if cmp == "ge" else {}
  assert streaming.masked_tile_relations(r) == want
  text = ("grid(b,m) (Lx1,n(Lx0,Cc0,Ct0,Ci0,Ci1,Ct1,Ct2,Lx2,Ct3,Ct4,Lx3,Ct5,Lx4,Cc1),Sc1)  "
          "tiles(b=1, m=16, n=16, k=16, h=16)  warps=4 stages=2")
  k = run_and_check(r, parse_plan(text, [l.name for l in r.loops]))
  first = next(l for l in k.source.splitlines() if "for start_n in range(" in l)
  assert first.strip().startswith("for start_n in range(0,") == (cmp == "gt"), first


@pytest.mark.parametrize("idiom", sorted(_IDIOMS))
def test_causal_mask_idioms_skip_hidden_key_tiles(idiom):
  """Causal masks as user code writes them all reach the key loop's bound
  (and issue the longest query tiles first): the predicate is read through
  not, two-valued selects and compares of a float triangle with a literal;
  the fill may sit on either side of the select or be added. Each kernel
  matches the IR in Triton's interpreter."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top

  def attend(q, k, v):
    s = _IDIOMS[idiom](jnp.einsum("bqd,bkd->bqk", q, k) * 0.25, jnp)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

  r = _captured(attend, (2, _T, 16), (2, _T, 16), (2, _T, 16))
  assert streaming.masked_tile_relations(r) == {"n": streaming.Band("m", upper=0)}
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))
  assert "(pid_m + 1) * BLOCK_M" in k.source
  assert "pid_m = 4 - tl.program_id(" in k.source     # longest query tiles issued first
  # Tiles below the diagonal are printed without the mask: the score goes
  # to the softmax as it is (no select, no added mask), and its scale is
  # folded into exp2 with the fill.
  whole, edge = k.source.split("# tiles the mask keeps whole")[1].split("# tiles on the mask's edge")

  def causal_wheres(src):
    # Selects of a score: not the ragged last tile's, the -inf guard, or the
    # mask's own selects of literals (dead where the mask is elided).
    lit = re.compile(r"^(True|False|-?[0-9.e+-]+|float\(\"-?inf\"\))$")
    return [w for w in re.findall(r"tl\.where\(([^,]+), ([^,]+), ([^)]+)\)", src)
            if not w[0].startswith("mask_") and "float(\"-inf\")" not in w[0]
            and not (lit.match(w[1].strip()) and lit.match(w[2].strip()))]
  def added_masks(src):
    return re.findall(r"= \(\w+ \+ \w+\)", src)
  masking = added_masks if idiom.startswith("s + ") else causal_wheres
  assert not masking(whole) and masking(edge), k.source
  assert "tl.exp2(" in k.source and "tl.exp(" not in k.source


_WINDOWS = {
    "(i >= j) & (i - j < 8)": ((-7, 0), lambda i, j, jnp: (i >= j) & (i - j < 8)),
    "abs(i - j) <= 20": ((-20, 20), lambda i, j, jnp: jnp.abs(i - j) <= 20),
    "(j <= i + 3) & (j + 40 > i)": ((-39, 3), lambda i, j, jnp: (j <= i + 3) & (j + 40 > i)),
    "~(j > i) & (i - 33 <= j)": ((-33, 0), lambda i, j, jnp: ~(j > i) & (i - 33 <= j)),
}


@pytest.mark.parametrize("window", sorted(_WINDOWS))
def test_sliding_window_masks_skip_the_key_tiles_outside(window):
  """Sliding windows as user code writes them (two compares of iotas plus
  constants, an ``abs`` of their difference) bound the key loop on both
  sides: each query tile runs the key tiles that hold its window, the
  middle ones without the mask and the edges with it. Each kernel matches
  the IR in Triton's interpreter."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  (lower, upper), mask = _WINDOWS[window]
  t = 160

  def attend(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.where(mask(i, j, jnp), s, -jnp.inf)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

  r = _captured(attend, (2, t, 16), (2, t, 16), (2, t, 16))
  assert streaming.masked_tile_relations(r) == {"n": streaming.Band("m", lower, upper)}
  k = run_and_check(r, T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)))
  assert "tl.maximum(0, (pid_m * BLOCK_M" in k.source   # the first key tile
  assert "tl.minimum(N, (pid_m + 1) * BLOCK_M" in k.source   # past the last
  if upper - lower >= 30:   # a whole 16-key tile fits beside a 16-query tile
    assert k.source.count("# tiles on the mask's edge") == 2
    assert k.source.count("# tiles the mask keeps whole") == 1


@pytest.mark.parametrize("left,right", [(24, 0), (40, 8), (3, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_dot_product_attention_local_window_runs_the_window_only(left, right, causal):
  """``jax.nn.dot_product_attention(local_window_size=..)`` builds its
  window from ``jnp.array(range(T))`` constants; capture reads them as
  iotas, so the window is a compare the kernel computes (not a T x T mask
  it reads) and bounds the key loop. Matches the IR in Triton's
  interpreter."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  r = _captured(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, local_window_size=(left, right)),
      (1, 200, 4, 16), (1, 200, 2, 16), (1, 200, 2, 16))
  assert not [b for b in r.inputs if r.value_map[b.value].dtype == "bool"]   # no mask input
  [(loop, band)] = streaming.masked_tile_relations(r).items()
  assert (band.lower, band.upper) == (-left, 0 if causal else right)
  best = plan_region(r, "h100", use_cache=False).best
  assert band.other in best.grid and best.tile(loop) < r.extent(loop), best
  k = run_and_check(r, best)
  o, n = band.other, loop.upper()
  assert f"tl.maximum(0, (pid_{o} * BLOCK_{o.upper()} - {left}) // BLOCK_{n}" in k.source


def _attention_with_epilogue(name):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  dpa = jax.nn.dot_product_attention
  return {
      "residual": lambda q, k, v, n: dpa(q, k, v) + q,
      "scale": lambda q, k, v, n: dpa(q, k, v) * 2.0,
      "tanh": lambda q, k, v, n: jnp.tanh(dpa(q, k, v, is_causal=True)),
      # Padded queries: the result's rows past each sequence's length are zeroed.
      "query_lengths": lambda q, k, v, n: dpa(q, k, v, query_seq_lengths=n,
                                              key_value_seq_lengths=n),
  }[name]


@pytest.mark.parametrize("epilogue", ["residual", "scale", "tanh", "query_lengths"])
def test_attention_with_an_epilogue_on_its_result_streams_the_keys(epilogue):
  """Ops on attention's result (a residual add, a scale, an activation, the
  query-padding mask of ``query_seq_lengths``) read P.V after the key loop
  divides it by the softmax sum. Placement treated them as producers of that
  deferred sum, so no plan was legal and the whole region went to XLA. Now
  planned with the keys streamed, and the kernels match the IR."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  sd = jax.ShapeDtypeStruct((2, 200, 4, 16), np.float32)
  lengths = jax.ShapeDtypeStruct((2,), np.int32)
  fn = _attention_with_epilogue(epilogue)
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(sd, sd, sd, lengths))
  r = cap.region
  res = plan_region(r, "h100", use_cache=False)
  assert res.best is not None, res.why_not
  streamed = [p for p in res.ranked if p.tile("n") < r.extent("n")]
  assert streamed, res.ranked
  for plan in streamed[:2]:
    run_and_check(r, plan)


def test_decoding_attention_with_an_epilogue_splits_its_keys():
  """One query per head over 4096 keys: the keys are split across programs,
  and the combine pass applies the residual add after the division."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  q = jax.ShapeDtypeStruct((1, 1, 8, 64), np.float32)
  kv = jax.ShapeDtypeStruct((1, 4096, 8, 64), np.float32)
  lengths = jax.ShapeDtypeStruct((1,), np.int32)
  fn = _attention_with_epilogue("residual")
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(q, kv, kv, lengths))
  best = plan_region(cap.region, "h100", use_cache=False).best
  assert best is not None and best.split, best
  run_and_check(cap.region, best)


def _padded_attention(fill, cmp="lt", rows=""):
  """Attention over padded sequences ([B, T, heads, D], lengths [B]); with
  ``rows`` 'select' or 'mul' the result's rows past the length are zeroed
  by a select or by a product with the mask."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def attend(q, k, v, lengths):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    ki = jnp.arange(k.shape[1])[None, None, None, :]
    n = lengths[:, None, None, None]
    keep = {"lt": lambda: ki < n, "le": lambda: ki + 1 <= n, "ge": lambda: ki >= n}[cmp]()
    s = jnp.where(keep, s, fill)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    qi = jnp.arange(q.shape[1])[None, :, None, None]
    if rows == "select":
      o = jnp.where(qi < n, o, 0.0)
    elif rows == "mul":
      o = o * (qi < n).astype(o.dtype)
    return o
  return attend


def _capture_padded(fn, b, m, n, heads=2, d=16):
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  q = jax.ShapeDtypeStruct((b, m, heads, d), np.float32)
  kv = jax.ShapeDtypeStruct((b, n, heads, d), np.float32)
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(q, kv, kv, jax.ShapeDtypeStruct((b,), np.int32)))
  return cap.region


def _run_with_lengths(r, plan, lengths):
  """The kernel against the IR on random inputs with the given lengths."""
  k = generate(r, plan, interpret=True)
  xs = launch.random_inputs(r, 0)
  [i] = [j for j, b in enumerate(r.inputs) if r.value_map[b.value].dtype == "int32"]
  xs[i] = np.asarray(lengths, np.int32)
  err = launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs))
  assert err <= launch.tolerance(r), f"relative error {err:.3g}\nplan: {plan}\n{k.source}"
  return k


@pytest.mark.parametrize("fill", [-np.inf, -1e30])
def test_padded_attention_stops_each_sequence_at_its_length(fill):
  """Keys at or past each sequence's length (an int32 input) are masked:
  the key loop stops at the length, which the kernel loads per program.
  Where a length is 0 or below no key is kept; with a finite fill the IR
  then averages every value, so those programs run every tile. Matches the
  IR in Triton's interpreter for lengths that are empty, one key, inside
  a tile, whole and past the end."""
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  r = _capture_padded(_padded_attention(fill), 6, 48, 200)
  lb = streaming.length_bound(r, streaming.analyze(r).streamed["n"])
  assert lb is not None and r.value_map[lb.length].dtype == "int32" and lb.offset == 0
  plans = [p for p in plan_region(r, "h100", use_cache=False).ranked if p.tile("n") < 200]
  assert plans
  k = _run_with_lengths(r, plans[0], [0, 1, 57, 200, 300, -3])
  assert "tl.where(len_n > 0, tl.minimum(N, len_n), N)" in k.source


@pytest.mark.parametrize("rows", ["select", "mul"])
def test_padded_attention_runs_no_tile_for_rows_past_the_length(rows):
  """The result's rows past each length are zeroed. Where that is a select,
  a program whose query tile lies wholly past the length keeps nothing the
  key loop computes (the select drops even an empty softmax's NaN), so its
  key loop runs no tile. A product with the mask would turn that NaN into
  the result (NaN x 0): there the loop runs one tile."""
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  r = _capture_padded(_padded_attention(-np.inf, rows=rows), 6, 200, 200)
  loop, _, how = streaming.output_length_bound(r)
  assert loop == "m" and how == rows
  plans = [p for p in plan_region(r, "h100", use_cache=False).ranked
           if p.tile("n") < 200 and 1 < p.tile("m") < 200]
  assert plans
  k = _run_with_lengths(r, plans[0], [0, 1, 57, 200, 300, -3])
  past = "0, " if rows == "select" else "tl.minimum("
  assert f"tl.where(pid_m * BLOCK_M >= len_n, {past}" in k.source
  assert ("0 + BLOCK_N)" in k.source) == (rows == "mul")


@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min) * 0.7])
def test_dot_product_attention_with_lengths_stops_at_them(fill):
  """``jax.nn.dot_product_attention(query_seq_lengths=n,
  key_value_seq_lengths=n)`` masks with ``and(i < n, j < n)`` and a finite
  fill, and multiplies the result by ``i < n``. Capture computes the mask
  in the kernel (it was a [B, T, T] input XLA wrote); the key loop stops at
  the length, which changes only the rows the product zeroes, and query
  tiles past it run one key tile. Matches the IR in Triton's interpreter,
  and against the library call itself."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  if np.isinf(fill):
    def fn(q, k, v, n):   # the library's masks with -inf
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
      qi, ki = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
      keep = (qi[None, :, None] < n[:, None, None]) & (ki[None, None, :] < n[:, None, None])
      o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep[:, None], s, fill), -1), v)
      return o * (qi[None, :, None, None] < n[:, None, None, None]).astype(o.dtype)
  else:
    def fn(q, k, v, n):
      return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=n, key_value_seq_lengths=n)
  r = _capture_padded(fn, 6, 200, 200)
  assert all(r.value_map[b.value].dtype != "bool" for b in r.inputs)   # no mask input
  lb = streaming.length_bound(r, streaming.analyze(r).streamed["n"])
  assert lb is not None and lb.offset == 0
  assert streaming.output_length_bound(r)[2] == "mul"
  plans = [p for p in plan_region(r, "h100", use_cache=False).ranked
           if p.tile("n") < 200 and 1 < p.tile("m") < 200]
  k = _run_with_lengths(r, plans[0], [0, 1, 57, 200, 300, -3])
  assert "tl.minimum(N, len_n)" in k.source


@pytest.mark.parametrize("fill", [-np.inf, -1e30])
@pytest.mark.parametrize("join", ["and", "nested"])
def test_causal_padded_attention_skips_both_masks_only_under_minus_inf(fill, join):
  """A causal mask and a padding mask, joined by ``and`` (one ``jnp.arange``
  read as rows and as columns) or applied one after the other (two
  ``jnp.where``): with -inf, the key loop skips the tiles past the diagonal
  and past the length, as either mask alone would; a row the two leave
  empty is NaN whatever runs. With a finite fill such a row (length 0)
  averages every value: joined by ``and`` the skips apply only where the
  length is positive, and over another mask none applies. Matches the IR
  in Triton's interpreter."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top

  def fn(q, k, v, n):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    i = jnp.arange(q.shape[1])
    causal = (i[:, None] >= i[None, :])[None, None]
    padded = i[None, None, None, :] < n[:, None, None, None]
    if join == "and":
      s = jnp.where(causal & padded, s, fill)
    else:
      s = jnp.where(padded, jnp.where(causal, s, fill), fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
  r = _capture_padded(fn, 6, 200, 200)
  st = streaming.analyze(r).streamed["n"]
  band, length = streaming.masked_tile_relation(r, st), streaming.length_bound(r, st)
  guarded = streaming.guarded_band(r, st)
  if np.isinf(fill):
    assert (band.lower, band.upper) == (None, 0) and length is not None and guarded is None
  elif join == "and":
    # Both skips, where the length is positive (see the next test).
    assert band is None and length is not None and guarded[0].upper == 0
  else:
    # A finite fill over another mask: no skip.
    assert band is None and length is None and guarded is None
  plans = [p for p in plan_region(r, "h100", use_cache=False).ranked
           if p.tile("n") < 200 and 1 < p.tile("m") < 200]
  k = _run_with_lengths(r, plans[0], [0, 1, 57, 200, 300, -3])
  assert ("len_n" in k.source) == (np.isinf(fill) or join == "and")


@pytest.mark.parametrize("lengths", ["key", "query and key"])
def test_causal_dot_product_attention_with_lengths_skips_where_the_length_is_positive(lengths):
  """``jax.nn.dot_product_attention(is_causal=True, ..lengths)``: a causal
  band joined to the lengths under a finite fill. Where the key length is
  positive every row keeps key 0, the fill weighs nothing, and the key loop
  skips the tiles past the diagonal and past the length; where it is not,
  it runs every tile, as the IR averages them. A sliding window keeps no
  fixed key in every row: no skip. Matches the IR in Triton's interpreter
  on lengths 0, 1, 57, 200, 300 and -3."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  kw = {"key_value_seq_lengths": None}
  if lengths != "key":
    kw["query_seq_lengths"] = None

  def fn(q, k, v, n, window=None):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=window, **{a: n for a in kw})
  r = _capture_padded(fn, 6, 200, 200)
  st = streaming.analyze(r).streamed["n"]
  assert streaming.masked_tile_relation(r, st) is None
  band, bound = streaming.guarded_band(r, st)
  assert (band.lower, band.upper) == (None, 0) and bound == streaming.length_bound(r, st)
  plans = [p for p in plan_region(r, "h100", use_cache=False).ranked
           if p.tile("n") < 200 and 1 < p.tile("m") < 200]
  k = _run_with_lengths(r, plans[0], [0, 1, 57, 200, 300, -3])
  assert "tl.where(len_n > 0, tl.minimum(tl.minimum(N, len_n), (pid_m + 1) * BLOCK_M), N)" in k.source
  w = _capture_padded(lambda q, k, v, n: fn(q, k, v, n, (20, 0)), 2, 64, 64)
  assert streaming.guarded_band(w, streaming.analyze(w).streamed["n"]) is None


def test_a_row_length_the_outputs_keep_stops_no_key_loop():
  """A mask ``and(i < n, j < n)`` whose rows past the length reach the
  result (no product or select discards them): those rows average every
  value under the finite fill, so the key loop may not stop at the length."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top

  def fn(q, k, v, n):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    qi, ki = jnp.arange(q.shape[1]), jnp.arange(k.shape[1])
    keep = (qi[None, :, None] < n[:, None, None]) & (ki[None, None, :] < n[:, None, None])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep[:, None], s, -1e30), -1), v)
  r = _capture_padded(fn, 2, 64, 64)
  assert streaming.output_length_bound(r) is None
  assert streaming.length_bound(r, streaming.analyze(r).streamed["n"]) is None


def test_padded_attention_length_forms():
  """``k + 1 <= n`` is the same bound as ``k < n``; keys kept from the
  length on (``k >= n``) are not a length, and the loop runs whole."""
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top

  def bound(cmp):
    r = _capture_padded(_padded_attention(-np.inf, cmp), 2, 16, 64)
    return streaming.length_bound(r, streaming.analyze(r).streamed["n"])
  assert bound("le") == bound("lt") and bound("lt").offset == 0
  assert bound("ge") is None


def test_tuning_times_padded_attention_on_whole_lengths():
  """Random inputs give a length input a value that keeps every key: timed
  on small random integers, a kernel that stops at the length would skip
  nearly all of its work, and tuning would rank and keep it on that."""
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  r = _capture_padded(_padded_attention(-np.inf, rows="select"), 3, 40, 200)
  [name] = streaming.length_inputs(r)
  xs = launch.random_inputs(r, 0)
  [lengths] = [x for x, b in zip(xs, r.inputs) if b.value == name]
  assert (lengths >= 200).all()
  r2 = _capture_padded(_padded_attention(-np.inf, cmp="ge"), 3, 40, 200)
  assert streaming.length_inputs(r2) == {}


def test_padded_decoding_step_splits_its_keys_past_the_length():
  """One query over 4096 keys, split across programs: parts wholly past a
  sequence's length run no tile, and the combine pass skips them."""
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  r = _capture_padded(_padded_attention(-np.inf, rows="select"), 5, 1, 4096, heads=4, d=64)
  best = plan_region(r, "h100", use_cache=False).best
  assert best is not None and best.split, best
  k = _run_with_lengths(r, best, [1, 700, 4096, 2049, 0])
  assert "len_n" in k.source


@pytest.mark.parametrize("mask", ["or", "additive -1e3", "data"])
def test_masks_that_do_not_hide_whole_tiles_run_every_tile(mask):
  """A disjunction of compares, an additive fill too close to the scores
  and a mask read from memory leave every key tile to the kernel."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top

  def attend(q, k, v, keep):
    s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.25
    i, j = jnp.arange(_T)[:, None], jnp.arange(_T)[None, :]
    if mask == "or":
      s = jnp.where((i >= j) | (j - i > 40), s, -jnp.inf)
    elif mask == "additive -1e3":
      s = s + jnp.where(i >= j, 0.0, -1e3)
    else:
      s = jnp.where(keep > 0, s, -jnp.inf)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

  r = _captured(attend, (2, _T, 16), (2, _T, 16), (2, _T, 16), (_T, _T))
  assert streaming.masked_tile_relations(r) == {}


def test_kernels_are_named_after_their_contractions():
  """A profile names jaxfuse's kernels and what each computes; regions that
  share a kernel share its name."""
  from jaxfuse.codegen.triton_printer import kernel_name_for, print_kernel
  att = T.attention(M=64, N=64, heads=2, dtype="float16")
  chain = T.gemm_chain(M=64, N=128, K=64, H=64, dtype="float16")
  assert kernel_name_for(att) == "jaxfuse_" + "__".join(
      s.replace(",", "_").replace("->", "_") for s in att.einsum_summary().split(" ; "))
  assert kernel_name_for(chain) != kernel_name_for(att)
  assert kernel_name_for(T.gemm_chain(M=128, N=64, K=32, H=16, dtype="float16")) == \
      kernel_name_for(chain)
  plan = T.simple_plan(chain, ("b", "m"), [("n", [])], dict(b=1, m=64, n=64, k=64, h=64),
                       split=("n", 2))
  pk = print_kernel(chain, plan)
  assert pk.kernel_name == kernel_name_for(chain) and pk.kernel_name.isidentifier()
  assert pk.combine_name == pk.kernel_name + "_combine"
  assert f"def {pk.kernel_name}(" in pk.source and f"def {pk.combine_name}(" in pk.source
  assert print_kernel(chain, plan, kernel_name="custom").kernel_name == "custom"


@pytest.mark.parametrize("form", ["row", "vector", "column"])
def test_one_row_gemm_plans_run_correctly(form):
  """A vector-matrix region (one row, a 1-D vector, or one column; now
  captured on its own): the planner's first plans, split ones among them,
  in the interpreter against the IR evaluator."""
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.devices import get_device
  from jaxfuse.planner import plan_region
  w, b = jnp.ones((256, 96), jnp.float16), jnp.ones((96,), jnp.float16)
  if form == "column":
    f, args = (lambda w, v: jax.nn.gelu(w.T @ v)), (w, jnp.ones((256, 1), jnp.float16))
  else:
    x = jnp.ones((1, 256) if form == "row" else (256,), jnp.float16)
    f, args = (lambda x, w, b: jax.nn.gelu(x @ w + b)), (x, w, b)
  [r] = capture.find_regions(jax.make_jaxpr(f)(*args))
  res = plan_region(r.region, get_device("h100"), use_cache=False, top=24)
  plans = list(res.ranked[:2]) + [p for p in res.ranked if p.split][:2]
  assert any(p.split for p in plans), [str(p) for p in res.ranked]
  for p in plans:
    run_and_check(r.region, p)


@pytest.mark.parametrize("tiles,split,warps,deferred", [
    (dict(m=1, n=16, k=32), None, 4, True),       # 200 = 6 whole k tiles + a masked one
    (dict(m=1, n=16, k=32), ("k", 3), 4, True),   # parts sum their product tiles, then store
    (dict(m=1, n=128, k=128), None, 4, True),     # 16384 products = 128 registers x 128 threads
    (dict(m=1, n=128, k=128), None, 2, False),    # over 128 registers x 64 threads
    (dict(m=1, n=64, k=200), None, 4, False),     # k in one tile: no loop to defer past
])
def test_broadcast_product_sums_after_its_loop(tiles, split, warps, deferred):
  """A broadcast-product contraction (here a one-row GEMM) accumulated over
  a k loop keeps its whole product tile and sums it once after the loop,
  when the tile fits the register cap; the sum is right with masked k
  tiles and in split plans' partial results."""
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.codegen.triton_printer import print_kernel
  [r] = capture.find_regions(jax.make_jaxpr(lambda x, w: x @ w)(
      jnp.ones((1, 200), jnp.float16), jnp.ones((200, 160), jnp.float16)))
  tree = [("k", [])] if tiles["k"] < 200 else []
  plan = T.simple_plan(r.region, ("m", "n"), tree, tiles, split=split, num_warps=warps)
  src = print_kernel(r.region, plan).source
  main = src.split("_combine(")[0]
  loop = main[main.index("for start_k"):] if tree else ""
  body = loop.split("\n    tl.store")[0].split("\n")
  in_loop = [ln for ln in body[1:] if ln.startswith("      ")]
  after = [ln for ln in body[1:] if not ln.startswith("      ")]
  if deferred:
    assert "(BLOCK_N, BLOCK_K), 0.0, tl.float32)" in main, main
    assert not any("tl.sum" in ln for ln in in_loop), main
    assert any("tl.sum(acc_" in ln for ln in after), main
  else:
    assert "(BLOCK_N, BLOCK_K), 0.0, tl.float32)" not in main, main
  run_and_check(r.region, plan)


@pytest.mark.parametrize("warps,deferred", [(4, ("c0", "c1")), (2, ("c0",))])
def test_products_sharing_a_loop_share_the_deferred_sum_cap(warps, deferred):
  """A gated part's gate and up products live in one k loop: they share the
  register cap, so at 2 warps only the first is kept whole (the other sums
  every step). The printer defers exactly what ``pruning.deferred_sums``
  says, which the planner prices, and both forms compute the right values."""
  import jax
  import jax.numpy as jnp
  from jaxfuse import capture
  from jaxfuse.codegen.triton_printer import print_kernel
  from jaxfuse.planner import pruning
  x = jnp.ones((1, 200), jnp.float16)
  w = jnp.ones((200, 160), jnp.float16)
  [r] = capture.find_regions(jax.make_jaxpr(
      lambda x, wg, wu: jax.nn.silu(x @ wg) * (x @ wu))(x, w, w))
  tiles = dict(m=1, n=64, k=128)   # 8192 products each: 64 registers per thread at 4 warps
  plan = T.simple_plan(r.region, ("m", "n"), [("k", [])], tiles, num_warps=warps)
  assert pruning.deferred_sums(r.region, plan.expr, plan.tile_map, warps) == set(deferred)
  assert pruning.summed_every_step(r.region, plan.expr, plan.tile_map, warps) == tuple(
      v for v in ("c0", "c1") if v not in deferred)
  src = print_kernel(r.region, plan).source
  for v in ("c0", "c1"):
    kept = f"acc_{v} = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)" in src
    assert kept == (v in deferred), src
  run_and_check(r.region, plan)


@pytest.mark.parametrize("keys,n,warps,split,deferred", [
    (512, 64, 4, None, True),       # 64 x 64 products: 32 registers per thread
    (512, 128, 4, None, True),      # 64 registers: the rescaled cap
    (512, 256, 4, None, False),     # 128 registers: under the general cap, over the rescaled one
    (512, 128, 2, None, False),     # 128 registers at 2 warps
    (512, 64, 4, ("n", 2), True),   # parts sum their product tiles, then store
    (500, 128, 4, None, True),      # a masked last key tile
])
def test_one_row_attention_sums_its_rescaled_product_after_the_loop(keys, n, warps, split,
                                                                    deferred):
  """One query row (multi-head decoding): P.V is a broadcast product that
  the online softmax rescales. Within RESCALED_SUM_REGS_PER_THREAD the
  kernel keeps the whole [keys, e] product, rescales it each step and sums
  it once after the key loop, where summing every step reduced across warps
  each step (105.1 against 94.7 us at 64-key tiles, H100, sixty-ninth
  session); the values are right either way."""
  import dataclasses
  from jaxfuse.codegen.triton_printer import print_kernel
  from jaxfuse.planner import examples, plan_region
  region = examples.attention(2, 4, 1, keys, 64)
  base = next(p for p in plan_region(region, "h100", use_cache=False, top=24).ranked
              if p.grid == ("b", "g", "m") and str(p.expr).startswith("(Lq,n("))
  plan = dataclasses.replace(base, tiles=tuple({**base.tile_map, "n": n, "e": 64}.items()),
                             num_warps=warps, split=split)
  assert pruning.deferred_sums(region, plan.expr, plan.tile_map, warps, {"o"}) == (
      {"o"} if deferred else set())
  main = print_kernel(region, plan).source.split("_combine(")[0]
  loop = main[main.index("for start_n"):].split("\n  # ")[0].split("\n  tl.store")[0]
  assert ("acc_o = tl.full((BLOCK_N, BLOCK_E), 0.0, tl.float32)" in main) == deferred, main
  assert ("tl.sum(ph[:, None] * v" in loop) != deferred, main
  run_and_check(region, plan)


def test_mixed_contraction_reads_its_16bit_operand_rounded():
  """``relu(x @ w.astype(bfloat16)) @ w2`` in float32: the kernel keeps the
  convert's result in float32 registers (excess precision, as for every
  elementwise op), but the dot that mixes it with the float32 ``x`` reads
  it rounded to bfloat16, as the program does; and the self-check's
  tolerance counts the bfloat16 intermediate (before, a correct kernel that
  skipped the rounding read 2.1e-3 against float32's 2e-3 and fell back)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import examples, plan_region  # pylint: disable=g-import-not-at-top
  S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
  [cap] = capture.find_regions(jax.make_jaxpr(
      lambda x, w1, w2: jax.nn.relu(x @ w1.astype("bfloat16")) @ w2)(S(4, 96), S(96, 96), S(96, 8)))
  r = cap.region
  assert any(isinstance(op, Elementwise) and op.fn == "convert" and
             r.value_map[op.out].dtype == "bfloat16" for op in r.ops)
  assert launch.tolerance(r) == launch.tolerance(T.gemm_chain(dtype="bfloat16")) > 2e-3
  best = plan_region(r, "h100", use_cache=False).best
  k = run_and_check(r, best)
  assert ".to(tl.bfloat16).to(tl.float32)" in k.source
  # A 16-bit product of 16-bit operands keeps its float32 intermediates.
  r16 = examples.gemm_chain(1, 1, 64, 64, 64, dtype="float16")
  p16 = plan_region(r16, "h100", use_cache=False).best
  assert p16.tile_map["m"] == 1
  assert ".to(tl.float16).to(tl.float32)" not in run_and_check(r16, p16).source


@pytest.mark.parametrize("scale,loose", [(1.0, True), (80 ** -0.5, False)])
def test_tolerance_allows_for_exp_of_rounded_large_scores(scale, loose):
  """Unscaled float16 scores over an 80-wide head (std ~9): the IR rounds
  them to float16 before ``exp``, an error of up to ~9 ulps that ``exp``
  makes relative, while the kernel keeps them in float32. The self-check's
  tolerance allows for it: this grouped one-query attention with a bias
  (from the fuzzing) read 3.2e-3 against 2e-3 at the self-check's seed, and
  the correct kernel fell back. At the usual 1/sqrt(d) scale it stays
  float16's tolerance."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float16)

  def fn(q, k, v, bias):
    k, v = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(S(2, 1, 4, 80), S(2, 128, 1, 80),
                                                 S(2, 128, 1, 80), S(1, 128)))
  r = cap.region
  tol = launch.tolerance(r)
  assert (tol > 4e-3) if loose else (tol == 2e-3)
  k = generate(r, plan_region(r, "h100", use_cache=False).best, interpret=True)
  errs = [launch.compare(r, launch.run_interpreted(k, xs), ir.evaluate(r, xs, precision="native"))
          for xs in (launch.shared_inputs(r, s) for s in (0, 1, launch.MEASURE_SEED))]
  assert max(errs) <= tol
  if loose:
    assert max(errs) > 2e-3   # over float16's own tolerance: the case this is for


def test_numerical_self_check_rejects_a_wrong_kernel_too_large_for_float64(monkeypatch):
  """Over ``EXACT_RECHECK_MAX_FLOPS`` the recheck is the region in float32
  without rounding, not float64: a kernel outside tolerance of both fails
  (with no recheck at all it passed silently, or crashed on the log line,
  before)."""
  plan = T.simple_plan(GEMM, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64))
  k = generate(GEMM, plan, interpret=True)
  monkeypatch.setattr(launch, "EXACT_RECHECK_MAX_FLOPS", 0)

  def wrong(kernel, xs):
    return [o * 1.01 for o in launch.run_interpreted(kernel, xs)]
  with pytest.raises(CodegenError, match="against float32 unrounded"):
    launch.self_check(k, wrong)
  launch.self_check(k, launch.run_interpreted)


def test_self_check_accepts_a_kernel_closer_to_exact_than_its_reference():
  """bfloat16 one-query attention over 200 keys, unscaled scores plus a bias
  (from the fuzzing): the reference rounds the scores to bfloat16 (its own
  error against float64 0.02), the kernel keeps them in float32, and the
  two differ by more than bfloat16's tolerance, so the correct kernel fell
  back. The self-check now also measures both against float64 and passes a
  kernel within tolerance of it; a wrong kernel (its output scaled by 1.1)
  still fails."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  S = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)

  # (The fuzzed program repeated one key/value head; the region now reads
  # that head in place, whose other inputs' draws no longer show the case.)
  def fn(q, k, v, bias):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(v.dtype), v)
  [cap] = capture.find_regions(jax.make_jaxpr(fn)(S(1, 1, 2, 16), S(1, 200, 2, 16),
                                                 S(1, 200, 2, 16), S(1, 200)))
  r = cap.region
  k = generate(r, plan_region(r, "h100", use_cache=False).best, interpret=True)
  xs = launch.shared_inputs(r, launch.MEASURE_SEED)
  outs = launch.run_interpreted(k, xs)
  exact = ir.evaluate(r, xs, precision="float64")
  native = ir.evaluate(r, xs, precision="native")
  tol = launch.tolerance(r)
  assert launch.compare(r, outs, native) > tol          # the case this is for
  assert launch.compare(r, outs, exact) <= tol < launch.compare(r, native, exact)
  launch.self_check(k, launch.run_interpreted)          # passes
  wrong = lambda kern, inputs: [o * 1.1 for o in launch.run_interpreted(kern, inputs)]
  with pytest.raises(CodegenError, match="against float64"):
    launch.self_check(k, wrong)
