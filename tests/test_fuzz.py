"""Differential fuzzing of ``jaxfuse.jit`` end to end: random MBCI programs
(GEMM chains with activations and biases, attention in both layouts with
grouped heads, causal, window and bias masks, ``jax.nn.dot_product_attention``,
3-GEMM MLPs, gated MLPs, sibling projections) at odd sizes and in float16,
bfloat16 and float32, each captured, planned for the H100, printed and run in
Triton's interpreter, then compared with ``jax.jit`` and a float32 reference.

The keep-or-drop verdict is forced to keep, so that the kernels run even
where the model would leave a tiny region to XLA: the point is correctness.

``JAXFUSE_FUZZ_SEEDS`` (default 32) sets how many programs run; on a GPU
machine (``JAXFUSE_FUZZ_GPU=1``, outside the interpreter) the same programs
run through the real Triton backend::

    JAX_PLATFORMS=cuda TRITON_INTERPRET=0 JAXFUSE_FUZZ_GPU=1 JAXFUSE_FUZZ_SEEDS=300 \\
        python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from typing import Any, Callable

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.config import config
from jaxfuse.planner import cost_model

SEEDS = int(os.environ.get("JAXFUSE_FUZZ_SEEDS", "32"))
ON_GPU = os.environ.get("JAXFUSE_FUZZ_GPU") == "1"

ACTIVATIONS: dict[str, Callable] = {
    "none": lambda x: x,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": jax.nn.gelu,
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "half": lambda x: x * 0.5,
}
# Relative error (norm) against the float32 reference allowed beyond 4x
# jax.jit's own: float32 dots run as TF32 on the GPU, as XLA's do there.
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-2}


@dataclasses.dataclass
class Program:
  fn: Callable
  shapes: list[tuple[int, ...]]
  dtype: str
  desc: dict[str, Any]
  weights: bool = False   # scale matrices after the first by 1/sqrt(rows)


def _dim(rng: random.Random) -> int:
  return rng.choice([8, 16, 24, 32, 48, 64, 80, 96, 128])


def _gemm_chain(rng, dtype):
  b = rng.choice([None, 1, 2, 3])
  m = rng.choice([1, 2, 5, 16, 33, 64, 100])
  k, n, h = _dim(rng), _dim(rng), _dim(rng)
  act, bias = rng.choice(sorted(ACTIVATIONS)), rng.random() < 0.3
  lead = () if b is None else (b,)
  shapes = [lead + (m, k), lead + (k, n) if rng.random() < 0.5 else (k, n), (n, h)]
  shapes += [(n,)] if bias else []

  def fn(x, w1, w2, *bias_):
    y = x @ w1
    if bias_:
      y = y + bias_[0]
    return ACTIVATIONS[act](y) @ w2
  return Program(fn, shapes, dtype, dict(b=b, m=m, k=k, n=n, h=h, act=act, bias=bias), True)


def _attention(rng, dtype):
  b, heads = rng.choice([1, 2]), rng.choice([1, 2, 4])
  kv = rng.choice([g for g in (1, 2, 4) if heads % g == 0])
  tq, tk = rng.choice([1, 7, 16, 64, 100, 128]), rng.choice([1, 16, 33, 64, 128, 200])
  d = rng.choice([16, 32, 64, 80, 128])
  layout = rng.choice(["bhtd", "bthd"])
  mask = rng.choice(["none", "causal", "bias", "window"])
  if mask in ("causal", "window"):
    tk = tq
  scale = rng.choice([1 / math.sqrt(d), 0.1, 1.0])
  fill_inf = rng.random() < 0.5
  if layout == "bhtd":
    shapes = [(b, heads, tq, d), (b, kv, tk, d), (b, kv, tk, d)]
    eq_s, eq_o, head_axis = "bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", 1
  else:
    shapes = [(b, tq, heads, d), (b, tk, kv, d), (b, tk, kv, d)]
    eq_s, eq_o, head_axis = "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", 2
  if mask == "bias":
    shapes.append((tq, tk))

  def fn(q, k, v, *bias_):
    if kv != heads:
      k = jnp.repeat(k, heads // kv, axis=head_axis)
      v = jnp.repeat(v, heads // kv, axis=head_axis)
    s = jnp.einsum(eq_s, q, k) * scale
    if bias_:
      s = s + bias_[0]
    if mask in ("causal", "window"):
      i, j = jnp.arange(tq)[:, None], jnp.arange(tk)[None, :]
      keep = (j <= i) if mask == "causal" else (j <= i) & (j > i - 8)
      s = jnp.where(keep, s, -jnp.inf if fill_inf else jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum(eq_o, p.astype(v.dtype), v)
  return Program(fn, shapes, dtype, dict(layout=layout, mask=mask, b=b, heads=heads, kv=kv,
                                         tq=tq, tk=tk, d=d, scale=scale, fill_inf=fill_inf))


def _dot_product_attention(rng, dtype):
  b, heads = rng.choice([1, 2]), rng.choice([1, 2, 4])
  kv = rng.choice([g for g in (1, 2, 4) if heads % g == 0])
  tq, tk = rng.choice([1, 7, 16, 64, 100, 128]), rng.choice([1, 16, 33, 64, 128, 200])
  d = rng.choice([16, 32, 64, 80, 128])
  causal = tq == tk and rng.random() < 0.5
  window = rng.choice([None, None, (8, 0), (16, 16)]) if tq == tk else None

  def fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=window)
  return Program(fn, [(b, tq, heads, d), (b, tk, kv, d), (b, tk, kv, d)], dtype,
                 dict(b=b, heads=heads, kv=kv, tq=tq, tk=tk, d=d, causal=causal, window=window))


def _mlp3(rng, dtype):
  m = rng.choice([1, 4, 16, 64])
  dims = [_dim(rng) for _ in range(4)]
  a1, a2 = rng.choice(sorted(ACTIVATIONS)), rng.choice(sorted(ACTIVATIONS))

  def fn(x, w1, w2, w3):
    return ACTIVATIONS[a2](ACTIVATIONS[a1](x @ w1) @ w2) @ w3
  return Program(fn, [(m, dims[0]), (dims[0], dims[1]), (dims[1], dims[2]), (dims[2], dims[3])],
                 dtype, dict(m=m, dims=dims, a1=a1, a2=a2), True)


def _gated_mlp(rng, dtype):
  m, d, f = rng.choice([1, 3, 8, 32]), _dim(rng), rng.choice([32, 64, 96, 128, 176])

  def fn(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
  return Program(fn, [(m, d), (d, f), (d, f), (f, d)], dtype, dict(m=m, d=d, f=f), True)


def _sibling_projections(rng, dtype):
  m, d, n = rng.choice([1, 8, 64]), _dim(rng), _dim(rng)

  def fn(x, wq, bq, wk, bk, wv, bv):
    return x @ wq + bq, x @ wk + bk, x @ wv + bv
  return Program(fn, [(m, d), (d, n), (n,), (d, n), (n,), (d, n), (n,)], dtype,
                 dict(m=m, d=d, n=n), True)


KINDS = {"gemm_chain": (_gemm_chain, 2), "attention": (_attention, 3),
         "dot_product_attention": (_dot_product_attention, 1), "mlp3": (_mlp3, 1),
         "gated_mlp": (_gated_mlp, 1), "sibling_projections": (_sibling_projections, 1)}


def random_program(seed: int) -> Program:
  """The program of ``seed``: a kind (weighted by ``KINDS``), a dtype, sizes."""
  rng = random.Random(seed)
  names = sorted(KINDS)
  kind = rng.choices(names, weights=[KINDS[n][1] for n in names])[0]
  dtype = rng.choice(["float16", "bfloat16", "float32"])
  if kind == "dot_product_attention" and dtype == "float16" and not ON_GPU:
    dtype = "bfloat16"   # XLA:CPU has no float16 x float16 -> float32 dot
  prog = KINDS[kind][0](rng, dtype)
  prog.desc = dict(kind=kind, dtype=dtype, **prog.desc)
  return prog


def program_inputs(prog: Program, seed: int) -> list[jax.Array]:
  keys = jax.random.split(jax.random.PRNGKey(seed), len(prog.shapes))
  out = []
  for i, (key, shape) in enumerate(zip(keys, prog.shapes)):
    x = jax.random.normal(key, shape, jnp.float32)
    if len(shape) == 1:
      x = x * 0.3                       # biases
    elif prog.weights and i > 0:
      x = x / math.sqrt(shape[-2])      # weights keep activations O(1)
    out.append(x.astype(prog.dtype))
  return out


def _relative_error(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(got)):
    return math.inf
  norm = np.linalg.norm(ref)
  return float(np.linalg.norm(got - ref) / (norm if norm > 0 else 1.0))


def check_program(seed: int) -> dict[str, Any]:
  """Runs program ``seed`` three ways; returns its description with the
  errors against the float32 reference and ``problem`` (None when sound)."""
  prog = random_program(seed)
  args = program_inputs(prog, seed)
  rec = dict(seed=seed, **prog.desc)
  with jax.default_matmul_precision("float32"):
    ref = jax.tree.leaves(jax.jit(prog.fn)(*[a.astype(jnp.float32) for a in args]))
  try:
    base = jax.tree.leaves(jax.jit(prog.fn)(*args))
  except Exception as e:  # pylint: disable=broad-except
    # jax.jit cannot run it here (XLA on the GPU rejects float16
    # dot_product_attention of one query: "Unsupported dot precision
    # algorithm"), so there is nothing to compare against.
    rec["problem"], rec["skipped"] = None, f"jax.jit raised {type(e).__name__}"
    return rec
  try:
    got = jax.tree.leaves(jaxfuse.jit(prog.fn)(*args))
  except Exception as e:  # pylint: disable=broad-except
    rec["problem"] = f"raised {type(e).__name__}: {e}"
    return rec
  if [(g.shape, g.dtype) for g in got] != [(b.shape, b.dtype) for b in base]:
    rec["problem"] = (f"outputs {[(g.shape, str(g.dtype)) for g in got]} != jax.jit's "
                      f"{[(b.shape, str(b.dtype)) for b in base]}")
    return rec
  rec["err"] = max(_relative_error(g, r) for g, r in zip(got, ref))
  rec["err_jax"] = max(_relative_error(b, r) for b, r in zip(base, ref))
  bound = max(TOLERANCE[prog.dtype], 4 * rec["err_jax"])
  rec["problem"] = (f"relative error {rec['err']:.3g} > {bound:.3g} (jax.jit: "
                    f"{rec['err_jax']:.3g})" if not rec["err"] <= bound else None)
  return rec


def test_random_programs_match_jax(monkeypatch, caplog):
  """Every random program runs, with jax.jit's output shapes and dtypes and
  an error against float32 within ``TOLERANCE`` or 4x jax.jit's own; no
  planned kernel falls back to the original ops (a failed self-check or
  compile: the safety net caught a plan the planner should not have made);
  and most programs really run fused kernels (else this tests nothing)."""
  monkeypatch.setattr(cost_model, "slower_than_unfused", lambda *a, **k: None)
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  fused = []
  real = launch._record_outcome  # pylint: disable=protected-access

  def recording(region, backend, out):
    fused.extend([1] if out.fused else [])
    return real(region, backend, out)
  monkeypatch.setattr(launch, "_record_outcome", recording)
  overrides = {} if ON_GPU else dict(backend="interpret", device="h100")
  problems, ran, skipped = [], 0, 0
  with config.override(tune="model", **overrides), caplog.at_level(logging.WARNING):
    for seed in range(SEEDS):
      before = len(fused)
      caplog.clear()
      rec = check_program(seed)
      fell_back = [r.getMessage() for r in caplog.records if "runs its original ops" in r.getMessage()]
      ran += len(fused) > before and not fell_back
      if fell_back and not rec["problem"]:
        rec["problem"] = f"fell back: {fell_back[0][:600]}"
      skipped += "skipped" in rec
      if rec["problem"]:
        problems.append(rec)
  print(f"[fuzz] {SEEDS} programs: {ran} ran fused kernels, {skipped} skipped, "
        f"{len(problems)} problems")
  assert not problems, "\n".join(str(p) for p in problems)
  if SEEDS >= 10:
    assert ran >= 0.8 * (SEEDS - skipped), f"only {ran} of {SEEDS} programs ran a fused kernel"


def test_random_programs_are_reproducible():
  a, b = random_program(7), random_program(7)
  assert a.desc == b.desc and a.shapes == b.shapes and a.dtype == b.dtype
  assert {random_program(s).desc["kind"] for s in range(40)} == set(KINDS)
