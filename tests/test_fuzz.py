"""Differential fuzzing of ``jaxfuse.jit`` end to end: random MBCI programs
(GEMM chains with activations and biases, attention in both layouts with
grouped heads, causal, window and bias masks, ``jax.nn.dot_product_attention``,
3-GEMM MLPs, gated MLPs, sibling projections, packed-QKV attention blocks,
transposed weights, masks passed in, hand-written softmax, LayerNorm FFNs,
stacked and vmapped attention, mixed-precision weights; and, from current
LLM code, soft-capped scores up to head dimension 256, ALiBi biases, rotary
embeddings, padding masks from sequence lengths, probabilities returned,
whole attention blocks with their projections, LoRA adapters, RMSNorm gated
MLPs, float32 scores of 16-bit inputs, batched GEMM chains) at odd sizes and in float16,
bfloat16 and float32, each captured, planned for the H100, printed and run in
Triton's interpreter, then compared with ``jax.jit`` and a float32 reference.

The keep-or-drop verdict is forced to keep, so that the kernels run even
where the model would leave a tiny region to XLA: the point is correctness.

``JAXFUSE_FUZZ_SEEDS`` (default 40) sets how many programs run; on a GPU
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

SEEDS = int(os.environ.get("JAXFUSE_FUZZ_SEEDS", "40"))
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
  extra = rng.choice(["none", "none", "bias", "mask"])
  scale = rng.choice([None, 0.2])

  def fn(q, k, v, *arg):
    kw = {} if not arg else ({"bias": arg[0]} if extra == "bias" else {"mask": arg[0] > 0})
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        local_window_size=window, **kw)
  shapes = [(b, tq, heads, d), (b, tk, kv, d), (b, tk, kv, d)]
  if extra != "none":
    shapes.append((1, 1, tq, tk))   # broadcast over batch and heads
  return Program(fn, shapes, dtype, dict(b=b, heads=heads, kv=kv, tq=tq, tk=tk, d=d, causal=causal,
                                         window=window, extra=extra, scale=scale))


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


def _packed_qkv_block(rng, dtype):
  """A self-attention block: one packed QKV projection, ``jnp.split``,
  heads by reshape, optional causal mask, the output projection."""
  m, heads, d = rng.choice([1, 16, 33, 64]), rng.choice([1, 2, 4]), rng.choice([16, 32, 64])
  e, causal = heads * d, rng.random() < 0.5

  def fn(x, wqkv, bqkv, wo):
    q, k, v = jnp.split(x @ wqkv + bqkv, 3, axis=-1)
    q, k, v = (t.reshape(m, heads, d).transpose(1, 0, 2) for t in (q, k, v))
    s = jnp.einsum("hqd,hkd->hqk", q, k) / math.sqrt(d)
    if causal:
      s = jnp.where(jnp.tril(jnp.ones((m, m), bool)), s, -jnp.inf)
    o = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, -1), v)
    return o.transpose(1, 0, 2).reshape(m, e) @ wo
  return Program(fn, [(m, e), (e, 3 * e), (3 * e,), (e, e)], dtype,
                 dict(m=m, heads=heads, d=d, causal=causal), True)


def _transposed_weights(rng, dtype):
  m, k, n, h = rng.choice([1, 8, 33, 64]), _dim(rng), _dim(rng), _dim(rng)
  act, form = rng.choice(sorted(ACTIVATIONS)), rng.choice(["w.T", "einsum"])

  def fn(x, w1, w2):
    if form == "w.T":
      return ACTIVATIONS[act](x @ w1.T) @ w2
    return jnp.einsum("mn,hn->mh", ACTIVATIONS[act](jnp.einsum("mk,nk->mn", x, w1)), w2)
  return Program(fn, [(m, k), (n, k), (n, h) if form == "w.T" else (h, n)], dtype,
                 dict(m=m, k=k, n=n, h=h, act=act, form=form), True)


def _mask_argument(rng, dtype):
  """Attention masked by an input array (``where(mask > 0, s, fill)``)."""
  b, heads = rng.choice([1, 2]), rng.choice([1, 2])
  t, d = rng.choice([16, 33, 64]), rng.choice([16, 32, 64])
  fill = rng.choice(["-inf", "min", "-1e4"])

  def fn(q, k, v, mask):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    f = {"-inf": -jnp.inf, "min": jnp.finfo(s.dtype).min, "-1e4": -1e4}[fill]
    s = jnp.where(mask > 0, s, f)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)
  return Program(fn, [(b, heads, t, d)] * 3 + [(t, t)], dtype,
                 dict(b=b, heads=heads, t=t, d=d, fill=fill))


def _hand_written_softmax(rng, dtype):
  b, t, s_, d = rng.choice([1, 3]), rng.choice([16, 64, 100]), rng.choice([16, 64, 200]), rng.choice([32, 64])
  prescale = rng.random() < 0.5

  def fn(q, k, v):
    if prescale:
      q = q * (1 / math.sqrt(d))
    s = jnp.einsum("btd,bsd->bts", q, k)
    if not prescale:
      s = s / math.sqrt(d)
    e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
    return jnp.einsum("bts,bsd->btd", e / jnp.sum(e, -1, keepdims=True), v)
  return Program(fn, [(b, t, d), (b, s_, d), (b, s_, d)], dtype,
                 dict(b=b, t=t, s=s_, d=d, prescale=prescale))


def _layer_norm_ffn(rng, dtype):
  """LayerNorm, an FFN with biases and GELU, a residual, a second output."""
  m, d, f = rng.choice([1, 8, 64]), rng.choice([32, 64, 128]), rng.choice([64, 128, 256])

  def fn(x, g, w1, b1, w2, b2):
    mu, var = jnp.mean(x, -1, keepdims=True), jnp.var(x, -1, keepdims=True)
    y = jax.nn.gelu(((x - mu) / jnp.sqrt(var + 1e-5) * g) @ w1 + b1) @ w2 + b2
    return x + y, jnp.sum(y, -1)
  return Program(fn, [(m, d), (d,), (d, f), (f,), (f, d), (d,)], dtype, dict(m=m, d=d, f=f), True)


def _stacked_attention(rng, dtype):
  """Two attentions, the second reading the first's output as queries and values."""
  heads, t, d = rng.choice([1, 2]), rng.choice([16, 64]), rng.choice([16, 32])

  def attn(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

  def fn(q, k, v):
    o = attn(q, k, v)
    return attn(o, k, o)
  return Program(fn, [(1, heads, t, d)] * 3, dtype, dict(heads=heads, t=t, d=d))


def _mixed_precision(rng, dtype):
  """A weight cast to another float type before the dot (promotion)."""
  m, k, n, h = rng.choice([4, 33, 64]), _dim(rng), _dim(rng), _dim(rng)
  wdt = rng.choice(["float32", "bfloat16", "float16"])

  def fn(x, w1, w2):
    return jax.nn.relu(x @ w1.astype(wdt)) @ w2
  return Program(fn, [(m, k), (k, n), (n, h)], dtype, dict(m=m, k=k, n=n, h=h, wdt=wdt), True)


def _vmapped_attention(rng, dtype):
  heads, t, d = rng.choice([2, 4]), rng.choice([16, 64]), rng.choice([16, 64])

  def one(q, k, v):
    return jax.nn.softmax(q @ k.T / math.sqrt(d), -1) @ v
  return Program(jax.vmap(one), [(heads, t, d)] * 3, dtype, dict(heads=heads, t=t, d=d))


def _softcap_attention(rng, dtype):
  """Scores soft-capped as ``cap * tanh(s / cap)`` (Gemma 2)."""
  b, h, t = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([7, 16, 64, 100])
  d = rng.choice([16, 32, 64, 128, 160, 192, 256])   # 160-256: the register floor
  cap, causal = rng.choice([5.0, 30.0, 50.0]), rng.random() < 0.5

  def fn(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    s = cap * jnp.tanh(s / cap)
    if causal:
      s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1).astype(v.dtype), v)
  return Program(fn, [(b, h, t, d)] * 3, dtype, dict(b=b, h=h, t=t, d=d, cap=cap, causal=causal))


def _alibi_attention(rng, dtype):
  """Causal attention with ALiBi's per-head linear bias, built from iotas."""
  b, h = rng.choice([1, 2]), rng.choice([2, 4, 8])
  t, d = rng.choice([16, 33, 64]), rng.choice([32, 64])

  def fn(q, k, v):
    slopes = 2.0 ** (-8.0 * (jnp.arange(h) + 1) / h)
    rel = jnp.arange(t)[None, :] - jnp.arange(t)[:, None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    s = s + (slopes[:, None, None] * rel).astype(s.dtype)
    s = jnp.where(rel <= 0, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(v.dtype), v)
  return Program(fn, [(b, t, h, d)] * 3, dtype, dict(b=b, h=h, t=t, d=d))


def _lora(rng, dtype):
  """A projection plus its low-rank adapter, ``x @ w + (x @ a) @ b * alpha``."""
  m, k, n, r = rng.choice([1, 5, 16, 64, 100]), _dim(rng), _dim(rng), rng.choice([4, 8, 16])
  alpha = rng.choice([0.5, 2.0])

  def fn(x, w, a, bb):
    return x @ w + (x @ a) @ bb * alpha
  return Program(fn, [(m, k), (k, n), (k, r), (r, n)], dtype, dict(m=m, k=k, n=n, r=r), True)


def _rope_attention(rng, dtype):
  """Rotary embeddings on q and k (split halves, concatenate), then causal attention."""
  b, h = rng.choice([1, 2]), rng.choice([1, 2, 4])
  t, d = rng.choice([16, 64, 100]), rng.choice([32, 64, 128])

  def rot(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin

  def fn(q, k, v, ang):
    cos, sin = jnp.cos(ang).astype(q.dtype), jnp.sin(ang).astype(q.dtype)
    q, k = rot(q, cos, sin), rot(k, cos, sin)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1).astype(v.dtype), v)
  return Program(fn, [(b, h, t, d)] * 3 + [(t, d)], dtype, dict(b=b, h=h, t=t, d=d))


def _padding_mask(rng, dtype):
  """Keys past each sequence's length (an input) masked with the finite minimum."""
  b, h, d = rng.choice([2, 3]), rng.choice([1, 4]), rng.choice([32, 64])
  tq, tk = rng.choice([1, 16, 64]), rng.choice([16, 33, 128])

  def fn(q, k, v, lens):
    lengths = (jnp.abs(lens[:, 0]) * tk).astype(jnp.int32) % tk + 1
    keep = jnp.arange(tk)[None, :] < lengths[:, None]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d)
    s = jnp.where(keep[:, None, None, :], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1).astype(v.dtype), v)
  return Program(fn, [(b, h, tq, d), (b, h, tk, d), (b, h, tk, d), (b, 1)], dtype, dict(b=b, h=h, tq=tq, tk=tk, d=d))


def _attention_with_probs(rng, dtype):
  """Attention that also returns its probabilities."""
  b, h, t, d = 1, rng.choice([1, 2]), rng.choice([16, 64]), rng.choice([32, 64])

  def fn(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d), -1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v), p
  return Program(fn, [(b, h, t, d)] * 3, dtype, dict(b=b, h=h, t=t, d=d))


def _attention_block(rng, dtype):
  """x -> q/k/v projections per head -> attention -> output projection."""
  b, t = rng.choice([1, 2]), rng.choice([8, 16, 64])
  h, d = rng.choice([1, 2, 4]), rng.choice([16, 32, 64])
  D = h * d

  def fn(x, wq, wk, wv, wo):
    q, k, v = ((x @ w).reshape(b, t, h, d) for w in (wq, wk, wv))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(v.dtype), v)
    return o.reshape(b, t, D) @ wo
  return Program(fn, [(b, t, D)] + [(D, D)] * 4, dtype, dict(b=b, t=t, h=h, d=d), True)


def _llama_mlp(rng, dtype):
  """RMSNorm, then a gated SiLU MLP and a residual (LLaMA)."""
  m, D, f = rng.choice([1, 4, 16, 64]), rng.choice([32, 64, 128]), rng.choice([64, 96, 256])

  def fn(x, g, wg, wu, wd):
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype) * g
    return x + (jax.nn.silu(y @ wg) * (y @ wu)) @ wd
  return Program(fn, [(m, D), (D,), (D, f), (D, f), (f, D)], dtype, dict(m=m, D=D, f=f), True)


def _f32_softmax(rng, dtype):
  """Scores accumulated in float32 (``preferred_element_type``), the softmax cast back."""
  b, h = rng.choice([1, 2]), rng.choice([2, 4])
  t, d = rng.choice([16, 64, 128]), rng.choice([32, 64])

  def fn(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    p = jax.nn.softmax(s, -1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)
  return Program(fn, [(b, t, h, d)] * 3, dtype, dict(b=b, h=h, t=t, d=d))


def _batched_gemm_chain(rng, dtype):
  """A GEMM chain with batched weights (``einsum`` over a leading batch)."""
  b, m = rng.choice([2, 3]), rng.choice([5, 16, 64])
  k, n, hh = _dim(rng), _dim(rng), _dim(rng)
  act = rng.choice(sorted(ACTIVATIONS))

  def fn(x, w1, w2):
    return jnp.einsum("bmn,bnh->bmh", ACTIVATIONS[act](jnp.einsum("bmk,bkn->bmn", x, w1)), w2)
  return Program(fn, [(b, m, k), (b, k, n), (b, n, hh)], dtype, dict(b=b, m=m, k=k, n=n, h=hh, act=act), True)


# kind -> (generator, weight)
KINDS = {"gemm_chain": (_gemm_chain, 2), "attention": (_attention, 3),
         "dot_product_attention": (_dot_product_attention, 1), "mlp3": (_mlp3, 1),
         "gated_mlp": (_gated_mlp, 1), "sibling_projections": (_sibling_projections, 1),
         "packed_qkv_block": (_packed_qkv_block, 2), "transposed_weights": (_transposed_weights, 1),
         "mask_argument": (_mask_argument, 1), "hand_written_softmax": (_hand_written_softmax, 1),
         "layer_norm_ffn": (_layer_norm_ffn, 1), "stacked_attention": (_stacked_attention, 1),
         "mixed_precision": (_mixed_precision, 1), "vmapped_attention": (_vmapped_attention, 1),
         "softcap_attention": (_softcap_attention, 1), "alibi_attention": (_alibi_attention, 1),
         "lora": (_lora, 1), "rope_attention": (_rope_attention, 1),
         "padding_mask": (_padding_mask, 1), "attention_with_probs": (_attention_with_probs, 1),
         "attention_block": (_attention_block, 1), "llama_mlp": (_llama_mlp, 1),
         "f32_softmax": (_f32_softmax, 1), "batched_gemm_chain": (_batched_gemm_chain, 1)}


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
  assert {random_program(s).desc["kind"] for s in range(200)} == set(KINDS)
