"""End-to-end BERT encoder forward pass (or training step): ``jax.jit`` against ``jaxfuse.jit``.

A post-LayerNorm BERT encoder written in plain JAX (no Flax): per layer, Q/K/V
projections, multi-head softmax attention, output projection, residual and
LayerNorm, a GELU feed-forward block, residual and LayerNorm. The embedding
lookup is left out (the input is the embedded sequence). Sizes follow
MCFuser's end-to-end evaluation (Table III networks, sequence 512):

=========== ====== ====== ===== =====
model       layers hidden heads FFN
=========== ====== ====== ===== =====
BERT-Small  4      512    8     2048
BERT-Base   12     768    12    3072
BERT-Large  24     1024   16    4096
=========== ====== ====== ===== =====

Cases ``small-b1``, ``small-b8``, ``base-b1``, ... (batch 1 and 8), or
``--models=base --batch=1,2`` for any batch. ``--step=train`` times a
training step instead: the loss ``sum(encoder(x) * g)`` (``g`` a random
cotangent, float32 products; the softmax in float32, see
``make_train_step``) and its gradient with respect to every weight,
``jax.value_and_grad`` inside the compiled function (cases named
``...-train``; FLOPs counted as three forward passes; ``--calls=1`` keeps
the unrolled programs at 1 and 4 steps: on an H100, Base b1 took 3.5
minutes so, and had not finished in 5.5 at 2 and 8 steps). Every call
of the timed function gets its own random input *and* its own weights, so
weights cannot stay in L2 between calls. ``tiny`` (2 layers, hidden 64,
sequence 32) is a smoke test for CI and not part of ``all``.

Example::

    python -m benchmarks.bert --cases=base-b1 --dtype=float16 --plot
    python -m benchmarks.bert --models=base --batch=1
    python -m benchmarks.bert --cases=base-b1 --step=train --calls=1
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import harness

harness.define_flags(default_cases="all")
flags.DEFINE_integer("seq", 512, "Sequence length of the built-in models.")
flags.DEFINE_list("models", [], "Shorthand with --batch for --cases: models "
                  "(small, base, large, tiny), e.g. --models=base --batch=1.")
flags.DEFINE_list("batch", [], "Batch sizes for --models (default 1,8).")
harness.define_step_flag()   # train: the gradient with respect to the weights

FLAGS = flags.FLAGS

# name -> (layers, hidden, heads, ffn)
MODELS = {"small": (4, 512, 8, 2048), "base": (12, 768, 12, 3072),
          "large": (24, 1024, 16, 4096)}
TINY = (2, 64, 2, 128)
TINY_SEQ = 32
BATCHES = (1, 8)


def layer_norm(x, g, b, eps: float = 1e-12):
  # Statistics in float32 whatever the activations' dtype, as BERT ports do.
  x32 = x.astype(jnp.float32)
  mu = jnp.mean(x32, -1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
  y = (x32 - mu) * jax.lax.rsqrt(var + eps)
  return (y * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def make_encoder(heads: int, softmax_dtype=None) -> Callable:
  """``encoder(x, params)``: x (batch, seq, hidden); params: a list of layers.

  ``softmax_dtype``: the attention softmax's dtype (default: the scores').
  """

  def layer(x, p):
    bsz, seq, d = x.shape
    dh = d // heads

    def split(t):
      return t.reshape(bsz, seq, heads, dh).transpose(0, 2, 1, 3)

    q = split(x @ p["wq"] + p["bq"])
    k = split(x @ p["wk"] + p["bk"])
    v = split(x @ p["wv"] + p["bv"])
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / math.sqrt(dh))
    if softmax_dtype is None:
      a = jax.nn.softmax(s, axis=-1)
    else:
      a = jax.nn.softmax(s.astype(softmax_dtype), axis=-1).astype(s.dtype)
    o = jnp.einsum("bhqk,bhkd->bhqd", a, v).transpose(0, 2, 1, 3).reshape(bsz, seq, d)
    x = layer_norm(x + o @ p["wo"] + p["bo"], p["ln1_g"], p["ln1_b"])
    h = jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False)
    return layer_norm(x + h @ p["w2"] + p["b2"], p["ln2_g"], p["ln2_b"])

  def encoder(x, params):
    for p in params:
      x = layer(x, p)
    return x
  return encoder


def make_train_step(heads: int) -> Callable:
  """``step(x, params, g) -> (loss, grads)``: the loss ``sum(encoder(x,
  params) * g)`` in float32 and its gradient with respect to ``params``.

  The softmax runs in float32, as mixed-precision training does: its
  backward in float16 (``p * (dp - sum(p * dp))``) cancels. At BERT-Base's
  12 layers that left ``jax.jit``'s own float16 gradients at a relative
  error of 2.4 against float32 (CPU, 2026-11-25; 1.4e-3 with the softmax in
  float32), and a reference check that could not fail.
  """
  encoder = make_encoder(heads, softmax_dtype=jnp.float32)

  def loss(x, params, g):
    return jnp.sum(encoder(x, params).astype(jnp.float32) * g.astype(jnp.float32))

  def step(x, params, g):
    return jax.value_and_grad(loss, argnums=1)(x, params, g)
  return step


def make_params(key, layers: int, d: int, ffn: int, dtype: str) -> list[dict]:
  out = []
  for i in range(layers):
    ks = jax.random.split(jax.random.fold_in(key, i), 12)
    w = lambda kk, a, b: harness.normal(kk, (a, b), dtype, 1 / math.sqrt(a))
    bias = lambda kk, n: harness.normal(kk, (n,), dtype, 0.02)
    out.append({
        "wq": w(ks[0], d, d), "bq": bias(ks[1], d), "wk": w(ks[2], d, d),
        "bk": bias(ks[3], d), "wv": w(ks[4], d, d), "bv": bias(ks[5], d),
        "wo": w(ks[6], d, d), "bo": bias(ks[7], d),
        "ln1_g": (1 + harness.normal(ks[8], (d,), "float32", 0.05)).astype(dtype),
        "ln1_b": bias(ks[8], d),
        "w1": w(ks[9], d, ffn), "b1": bias(ks[10], ffn), "w2": w(ks[11], ffn, d),
        "b2": bias(ks[10], d),
        "ln2_g": (1 + harness.normal(ks[11], (d,), "float32", 0.05)).astype(dtype),
        "ln2_b": bias(ks[9], d),
    })
  return out


def make_case(name: str, cfg: tuple[int, int, int, int], batch: int, seq: int,
              dtype: str, group: str, step: str = "forward") -> harness.Case:
  """``step``: ``forward`` (the encoder) or ``train`` (``make_train_step``;
  the name gets ``-train``)."""
  if step not in ("forward", "train"):
    raise ValueError(f"step: {step!r} is not 'forward' or 'train'")
  layers, d, heads, ffn = cfg
  train = step == "train"
  fn = make_train_step(heads) if train else make_encoder(heads)

  def make_inputs(key, dt):
    kx, kp, kg = jax.random.split(key, 3)
    x = harness.normal(kx, (batch, seq, d), dt)
    params = make_params(kp, layers, d, ffn, dt)
    if train:
      return (x, params, harness.normal(kg, (batch, seq, d), dt))
    return (x, params)

  m = batch * seq
  item = jnp.dtype(dtype).itemsize
  per_layer = 2.0 * m * d * d * 4 + 2.0 * m * d * ffn * 2 + 4.0 * batch * seq * seq * d
  weights = layers * (4 * d * d + 2 * d * ffn + 9 * d + ffn)
  # A training step reads the weights, input and cotangent and writes the
  # gradients: the fewest bytes, at 3x the forward's FLOPs (the backward's
  # two products per forward product).
  nbytes = float(item * ((2 if train else 1) * weights + 2 * m * d))
  flops = layers * per_layer * (3 if train else 1)
  params = {"layers": layers, "hidden": d, "heads": heads, "ffn": ffn, "batch": batch,
            "seq": seq, "step": step}
  return harness.Case(name + ("-train" if train else ""), fn, make_inputs, flops, nbytes,
                      params, group=group)


def all_cases(dtype: str, seq: int, step: str = "forward") -> tuple[dict, dict]:
  """Cases by their selection name (``base-b1``, ``tiny``; a case's own
  name gets ``-train`` under ``step='train'``) and the named groups."""
  cases, groups = {}, {}
  for model, cfg in MODELS.items():
    groups[model] = []
    for b in BATCHES:
      c = make_case(f"{model}-b{b}", cfg, b, seq, dtype, f"BERT-{model}", step)
      cases[f"{model}-b{b}"] = c
      groups[model].append(f"{model}-b{b}")
  groups["all"] = [n for g in MODELS for n in groups[g]]
  cases["tiny"] = make_case("tiny", TINY, 1, TINY_SEQ, dtype, "smoke test", step)
  return cases, groups


def impls_for(case: harness.Case) -> list[harness.Impl]:
  return [harness.jaxfuse_impl(case.fn), harness.xla_impl(case.fn)]


def main(argv) -> int:
  del argv
  cases, groups = all_cases(FLAGS.dtype, FLAGS.seq, FLAGS.step)
  spec = FLAGS.cases
  if FLAGS.models or FLAGS.batch:
    models = FLAGS.models or list(MODELS)
    batches = [int(b) for b in FLAGS.batch] or list(BATCHES)
    names = []
    for m in models:
      if m != "tiny" and m not in MODELS:
        raise ValueError(f"--models: unknown {m!r}; known: {', '.join(MODELS)}, tiny")
      for b in batches:
        if b < 1:
          raise ValueError(f"--batch: {b} must be >= 1")
        name = "tiny" if m == "tiny" else f"{m}-b{b}"
        if name not in cases:
          cases[name] = make_case(name, MODELS[m], b, FLAGS.seq, FLAGS.dtype, f"BERT-{m}",
                                  FLAGS.step)
        if name not in names:
          names.append(name)
    spec = ",".join(names)
  names = harness.select(cases, spec, groups)
  return harness.main("bert", [cases[n] for n in names], impls_for,
                      title=f"BERT encoder {FLAGS.step} ({FLAGS.dtype})")


if __name__ == "__main__":
  app.run(main)
