"""jaxfuse demo: fuse an attention block and an MLP chain, show what was fused.

Run: ``python examples/demo.py``. On a machine without a GPU the fused regions
run their original ops through XLA (the CPU path); on an NVIDIA GPU they run
as planned Triton kernels.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse


def attention(q, k, v, bias):
  """Multi-head self-attention core, [batch, heads, tokens, head_dim]."""
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s + bias, axis=-1), v)


def mlp(x, w1, b1, w2, b2, w3):
  """A 3-GEMM MLP chain with activations between."""
  h = jax.nn.gelu(x @ w1 + b1)
  h = jax.nn.relu(h @ w2 + b2)
  return h @ w3


def main():
  dtype = jnp.float16 if jax.default_backend() == "gpu" else jnp.float32
  keys = iter(jax.random.split(jax.random.key(0), 16))

  def rand(*shape, scale=1.0):
    return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

  q, k, v = (rand(1, 8, 256, 64) for _ in range(3))
  bias = rand(1, 1, 1, 256, scale=0.1)
  x = rand(64, 256)
  w1, w2, w3 = rand(256, 512, scale=0.05), rand(512, 512, scale=0.05), rand(512, 256, scale=0.05)
  b1, b2 = rand(512, scale=0.1), rand(512, scale=0.1)

  print(f"backend: {jax.default_backend()}  (jaxfuse backend setting: {jaxfuse.config.backend})")
  for name, fn, args in [("attention", attention, (q, k, v, bias)),
                         ("mlp", mlp, (x, w1, b1, w2, b2, w3))]:
    fused = jaxfuse.jit(fn)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fused(*args))
    t1 = time.perf_counter()
    ref = jax.jit(fn)(*[a.astype(jnp.float32) for a in args])
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    print(f"\n=== {name}: first call {1e3 * (t1 - t0):.0f} ms, "
          f"relative error vs float32 jax.jit {err:.2e}")
    jaxpr = jaxfuse.fused_jaxpr(fn)(*args)
    n = sum(e.primitive.name == "jaxfuse_region" for e in jaxpr.jaxpr.eqns)
    print(f"fused regions in the rewritten jaxpr: {n}")
    print(jaxfuse.inspect(fn, *args))


if __name__ == "__main__":
  main()
