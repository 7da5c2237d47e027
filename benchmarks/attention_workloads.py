"""The attention workloads the benchmarks time, as plain JAX functions.

Flag-free, so that any binary or test can build them: ``benchmarks.attention``
defines absl flags when it is imported, which clash with another binary's
(``plan_time`` plans the regions of the attention training step).

* ``make_attention``: plain attention as users write it (einsum, softmax),
  in a layout, with a causal mask or window, grouped heads, a soft cap,
  padded sequences, or its softmax in float32;
* ``make_flash_attention``: the same with a FlashAttention-2-style backward
  written in plain JAX (``jax.custom_vjp``);
* ``make_train_step``: a training step of either, the float32 loss
  ``sum(attention(q, k, v) * g)`` and its q, k, v gradients.

Example::

    step = make_train_step(make_attention(True, 0.125, "bthd",
                                          softmax_dtype=jnp.float32))
    loss, (dq, dk, dv) = jax.jit(step)(q, k, v, g)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["causal_keep", "make_attention", "make_flash_attention", "make_train_step",
           "unpack_qkv"]


def unpack_qkv(qkv, heads: int):
  """[B, T, 3*heads*D] -> q, k, v of [B, T, heads, D] (jnp.split: views of
  the packed array that jaxfuse reads in place)."""
  b, t, _ = qkv.shape
  return tuple(x.reshape(b, t, heads, -1) for x in jnp.split(qkv, 3, axis=-1))


def causal_keep(m: int, n: int, window: int = 0) -> jax.Array:
  """[m, n] bool: query i sees key j <= i (top-left aligned), and with
  ``window`` only keys i - window .. i."""
  qi = jax.lax.broadcasted_iota(jnp.int32, (m, n), 0)
  ki = jax.lax.broadcasted_iota(jnp.int32, (m, n), 1)
  keep = qi >= ki
  return keep & (qi - ki <= window) if window else keep


def make_attention(causal: bool, scale: float, layout: str, heads: int = 0,
                   kv_heads: int = 0, window: int = 0, softcap: float = 0.0,
                   padded: bool = False, softmax_dtype=None) -> Callable:
  """Plain JAX attention in ``layout`` (what jax.jit and jaxfuse.jit compile).

  ``kv_heads`` below ``heads``: grouped-query attention; k and v have
  ``kv_heads`` heads, each shared by ``heads // kv_heads`` query heads.
  ``window`` (with ``causal``): query i sees keys i - window .. i.
  ``softcap``: scaled scores become ``softcap * tanh(s / softcap)`` before
  the mask (Gemma 2). ``padded``: the function takes a fourth argument, the
  int32 length of each sequence [B]; keys at or past it are masked and the
  result's rows at or past it are zero. ``softmax_dtype``: the softmax runs
  in it (a training step's float32), its result cast back to q's dtype."""
  if layout == "packed":
    inner = make_attention(causal, scale, "bthd", window=window, softcap=softcap)
    return lambda qkv: inner(*unpack_qkv(qkv, heads))
  grouped = bool(kv_heads) and kv_heads != heads
  if grouped:
    # q as [.., kv, group, ..]: each key/value head meets its query heads.
    qk = "bkgqd,bksd->bkgqs" if layout == "bhtd" else "bqkgd,bskd->bkgqs"
    pv = "bkgqs,bksd->bkgqd" if layout == "bhtd" else "bkgqs,bskd->bqkgd"
  else:
    qk = "bhqd,bhkd->bhqk" if layout == "bhtd" else "bqhd,bkhd->bhqk"
    pv = "bhqk,bhkd->bhqd" if layout == "bhtd" else "bhqk,bkhd->bqhd"

  def attention(q, k, v, lengths=None):
    shape = q.shape
    if grouped:
      b = shape[0]
      q = (q.reshape(b, kv_heads, heads // kv_heads, *shape[2:]) if layout == "bhtd"
           else q.reshape(b, shape[1], kv_heads, heads // kv_heads, shape[3]))
    s = jnp.einsum(qk, q, k) * scale
    if softcap:
      s = softcap * jnp.tanh(s / softcap)
    if causal:
      s = jnp.where(causal_keep(*s.shape[-2:], window), s, -jnp.inf)
    if padded:
      # [B, 1.., N] against the scores' [B, .., M, N]: key j of sequence b
      # counts while j < lengths[b].
      ki = jax.lax.broadcasted_iota(jnp.int32, (1,) * (s.ndim - 1) + (s.shape[-1],), s.ndim - 1)
      s = jnp.where(ki < lengths.reshape((-1,) + (1,) * (s.ndim - 1)), s, -jnp.inf)
    if softmax_dtype is not None:
      p = jax.nn.softmax(s.astype(softmax_dtype), axis=-1).astype(q.dtype)
    else:
      p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum(pv, p, v).reshape(shape[:-1] + (v.shape[-1],))
    if padded:
      t_axis = 2 if layout == "bhtd" else 1
      qi = jax.lax.broadcasted_iota(jnp.int32, o.shape, t_axis)
      o = jnp.where(qi < lengths.reshape((-1,) + (1,) * (o.ndim - 1)), o, 0).astype(o.dtype)
    return o
  return attention


def make_flash_attention(causal: bool, scale: float, layout: str) -> Callable:
  """Attention with a hand-written FlashAttention-2-style backward, in plain
  JAX (``jax.custom_vjp``): the forward saves its row max and sum; the
  backward recomputes the probabilities from them and q, k, and forms each
  gradient from its own recomputation. Written as users do who want
  attention's [T, T] intermediates out of a training step's memory; under
  ``jax.jit`` XLA still writes them, under ``jaxfuse.jit`` each gradient's
  chain is one kernel."""
  qk = "bhqd,bhkd->bhqk" if layout == "bhtd" else "bqhd,bkhd->bhqk"
  pv = "bhqk,bhkd->bhqd" if layout == "bhtd" else "bhqk,bkhd->bqhd"
  dk_ = "bhqk,bhqd->bhkd" if layout == "bhtd" else "bhqk,bqhd->bkhd"
  rows = "bhqd,bhqd->bhq" if layout == "bhtd" else "bqhd,bqhd->bhq"
  f32 = jnp.float32

  def scores(q, k):
    s = jnp.einsum(qk, q, k).astype(f32) * scale
    if causal:
      s = jnp.where(causal_keep(*s.shape[-2:]), s, -jnp.inf)
    return s

  def probs(q, k, mx, total):
    return jnp.exp(scores(q, k) - mx[..., None]) / total[..., None]

  def forward(q, k, v):
    s = scores(q, k)
    mx = s.max(-1)
    e = jnp.exp(s - mx[..., None])
    total = e.sum(-1)
    o = jnp.einsum(pv, (e / total[..., None]).astype(q.dtype), v)
    return o, (q, k, v, o, mx, total)

  def backward(res, do):
    q, k, v, o, mx, total = res
    # rowsum(p * dp) = rowsum(do * o): FlashAttention-2's D.
    d = jnp.einsum(rows, do.astype(f32), o.astype(f32))

    def ds():
      dp = jnp.einsum(qk, do, v).astype(f32)
      return (probs(q, k, mx, total) * (dp - d[..., None]) * scale).astype(q.dtype)
    dq = jnp.einsum(pv, ds(), k)
    dk = jnp.einsum(dk_, ds(), q)
    dv = jnp.einsum(dk_, probs(q, k, mx, total).astype(q.dtype), do)
    return dq, dk, dv

  @jax.custom_vjp
  def attention(q, k, v):
    return forward(q, k, v)[0]
  attention.defvjp(forward, backward)
  return attention


def make_train_step(attention: Callable) -> Callable:
  """``step(q, k, v, g) -> (loss, (dq, dk, dv))``: the loss
  ``sum(attention(q, k, v) * g)`` in float32 and its gradients."""
  def loss(q, k, v, g):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) * g)

  def step(q, k, v, g):
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, g)
  return step
