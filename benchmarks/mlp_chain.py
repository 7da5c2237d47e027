"""MLP-chain benchmark: three GEMMs with bias and activations between.

The chain is ``y = act2(act1(x @ W1 + b1) @ W2 + b2) @ W3 + b3`` with
``x: (M, D0)``, ``W1: (D0, D1)``, ``W2: (D1, D2)``, ``W3: (D2, D3)``. The
built-in cases are a transformer MLP block (``D0 -> 4*D0 -> D0``) followed by
a ``D0 x D0`` projection, at the hidden sizes of BERT-Small/Base/Large
(512/768/1024) and ViT-Huge (1280), with few tokens ``M`` (1, 8, 32, 128; one
token is a decoding step at batch 1): the
weights dominate the traffic, so the chain is memory-bound (intensity ~ M
FLOP/byte against a ridge near 260 on an H100) and one fused kernel saves
the launches and the intermediates' round trips.

Gated cases (``--cases=gated`` or a model name below) are the SwiGLU MLP
of LLaMA-style models, ``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` without bias,
at the widths of Qwen2-0.5B, TinyLlama-1.1B and Llama-2-7B: two sibling
GEMMs that read ``x`` and meet in the gate, then the down projection.
Packed cases (``--cases=packed``, named ``<model>-packed-M<tokens>``) are the
same MLPs with gate and up in one weight, split after one GEMM
(``g, u = jnp.split(x @ Wgu, 2, -1)``), as models with a ``gate_up_proj``
write them.

Compared, in one run: ``jaxfuse.jit`` and ``jax.jit`` of the same plain JAX
function, and PyTorch eager (``addmm`` + activations) when torch has CUDA.

Example::

    python -m benchmarks.mlp_chain --cases=bert-base-M8 --dtype=bfloat16
    python benchmarks/mlp_chain.py --shapes=16x768x3072x768x768 --acts=silu,gelu
    python -m benchmarks.mlp_chain --cases=gated --tune=measure
    python -m benchmarks.mlp_chain --cases=packed
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

harness.define_flags(default_cases="all",
                     shapes_help="Extra chains 'MxD0xD1xD2xD3', comma-separated; "
                     "with --cases unset only these run.")
flags.DEFINE_string("acts", "gelu,relu", "Activations after GEMM 1 and GEMM 2 "
                    "(gelu = tanh form, gelu_exact, relu, silu, tanh, none).")
flags.DEFINE_bool("bias", True, "Add a bias after each GEMM.")

FLAGS = flags.FLAGS

MODELS = {"bert-small": 512, "bert-base": 768, "bert-large": 1024, "vit-huge": 1280}
TOKENS = (1, 8, 32, 128)
# Gated (SwiGLU) MLPs: hidden size, intermediate size.
GATED_MODELS = {"qwen2-0.5b": (896, 4864), "tinyllama-1.1b": (2048, 5632),
                "llama2-7b": (4096, 11008)}

_JAX_ACTS: dict[str, Callable] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu, "silu": jax.nn.silu, "tanh": jnp.tanh, "none": lambda x: x,
}


def parse_acts(spec: str) -> tuple[str, str]:
  acts = tuple(a.strip() for a in spec.split(","))
  if len(acts) != 2 or any(a not in _JAX_ACTS for a in acts):
    raise ValueError(f"--acts: want two of {sorted(_JAX_ACTS)}, got {spec!r}")
  return acts  # type: ignore[return-value]


def make_mlp(acts: tuple[str, str], bias: bool) -> Callable:
  a1, a2 = _JAX_ACTS[acts[0]], _JAX_ACTS[acts[1]]

  if bias:
    def mlp(x, w1, b1, w2, b2, w3, b3):
      h = a1(x @ w1 + b1)
      h = a2(h @ w2 + b2)
      return h @ w3 + b3
  else:
    def mlp(x, w1, w2, w3):
      return a2(a1(x @ w1) @ w2) @ w3
  return mlp


def gated_mlp(x, wg, wu, wd):
  return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def packed_gated_mlp(x, wgu, wd):
  g, u = jnp.split(x @ wgu, 2, axis=-1)
  return (jax.nn.silu(g) * u) @ wd


def make_gated_case(name: str, m: int, d: int, f: int, *, dtype: str, group: str,
                    extra: dict | None = None, packed: bool = False) -> harness.Case:
  def make_inputs(key, dt):
    ks = jax.random.split(key, 4)
    x = harness.normal(ks[0], (m, d), dt)
    wg = harness.normal(ks[1], (d, f), dt, 1 / math.sqrt(d))
    wu = harness.normal(ks[2], (d, f), dt, 1 / math.sqrt(d))
    wd = harness.normal(ks[3], (f, d), dt, 1 / math.sqrt(f))
    if packed:
      return x, jnp.concatenate([wg, wu], axis=1), wd
    return x, wg, wu, wd

  item = jnp.dtype(dtype).itemsize
  params = {"M": m, "D": d, "F": f, "acts": "silu", "bias": False, "gated": True,
            "packed": packed}
  params.update(extra or {})
  return harness.Case(name, packed_gated_mlp if packed else gated_mlp, make_inputs,
                      2.0 * m * 3 * d * f, float(item * (2 * m * d + 3 * d * f)), params,
                      group=group)


def make_case(name: str, m: int, dims: tuple[int, int, int, int], *,
              acts: tuple[str, str], bias: bool, dtype: str, group: str,
              extra: dict | None = None) -> harness.Case:
  d0, d1, d2, d3 = dims
  fn = make_mlp(acts, bias)

  def make_inputs(key, dt):
    ks = jax.random.split(key, 7)
    x = harness.normal(ks[0], (m, d0), dt)
    ws = [harness.normal(ks[1 + i], (a, b), dt, 1 / math.sqrt(a))
          for i, (a, b) in enumerate(((d0, d1), (d1, d2), (d2, d3)))]
    if not bias:
      return (x, *ws)
    bs = [harness.normal(ks[4 + i], (b,), dt, 0.1) for i, b in enumerate((d1, d2, d3))]
    return (x, ws[0], bs[0], ws[1], bs[1], ws[2], bs[2])

  item = jnp.dtype(dtype).itemsize
  flops = 2.0 * m * (d0 * d1 + d1 * d2 + d2 * d3)
  nbytes = float(item * (m * d0 + d0 * d1 + d1 * d2 + d2 * d3 + m * d3
                         + ((d1 + d2 + d3) if bias else 0)))
  params = {"M": m, "D0": d0, "D1": d1, "D2": d2, "D3": d3, "acts": ",".join(acts),
            "bias": bias}
  params.update(extra or {})
  return harness.Case(name, fn, make_inputs, flops, nbytes, params, group=group)


def all_cases(acts, bias, dtype, shapes="") -> tuple[dict, dict]:
  cases, groups = {}, {"shapes": []}
  for model, d in MODELS.items():
    groups[model] = []
    for m in TOKENS:
      c = make_case(f"{model}-M{m}", m, (d, 4 * d, d, d), acts=acts, bias=bias,
                    dtype=dtype, group=model, extra={"model": model})
      cases[c.name] = c
      groups[model].append(c.name)
  groups["gated"], groups["packed"] = [], []
  for model, (d, f) in GATED_MODELS.items():
    groups[model] = []
    for m in TOKENS:
      c = make_gated_case(f"{model}-M{m}", m, d, f, dtype=dtype, group=model,
                          extra={"model": model})
      cases[c.name] = c
      groups[model].append(c.name)
      groups["gated"].append(c.name)
    for m in TOKENS:
      c = make_gated_case(f"{model}-packed-M{m}", m, d, f, dtype=dtype, group=model,
                          extra={"model": model}, packed=True)
      cases[c.name] = c
      groups["packed"].append(c.name)
  for (m, d0, d1, d2, d3) in (d for d, _ in harness.parse_shapes(shapes, "MxD0xD1xD2xD3")):
    c = make_case(f"M{m}-{d0}x{d1}x{d2}x{d3}", m, (d0, d1, d2, d3), acts=acts,
                  bias=bias, dtype=dtype, group="custom")
    cases[c.name] = c
    groups["shapes"].append(c.name)
  return cases, groups


def torch_mlp(acts: tuple[str, str], bias: bool):
  import torch  # pylint: disable=g-import-not-at-top
  F = torch.nn.functional
  t_acts = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "gelu_exact": F.gelu,
            "relu": torch.relu, "silu": F.silu, "tanh": torch.tanh, "none": lambda x: x}
  a1, a2 = t_acts[acts[0]], t_acts[acts[1]]
  if bias:
    return lambda x, w1, b1, w2, b2, w3, b3: torch.addmm(
        b3, a2(torch.addmm(b2, a1(torch.addmm(b1, x, w1)), w2)), w3)
  return lambda x, w1, w2, w3: a2(a1(x @ w1) @ w2) @ w3


def impls_for(case: harness.Case) -> list[harness.Impl]:
  acts = tuple(case.params["acts"].split(","))
  bias = case.params["bias"]
  gated = case.params.get("gated", False)

  def run_torch(*args):
    import torch  # pylint: disable=g-import-not-at-top
    with torch.inference_mode():
      if gated and case.params.get("packed"):
        x, wgu, wd = args
        g, u = (x @ wgu).chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u) @ wd
      if gated:
        x, wg, wu, wd = args
        return (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd
      return torch_mlp(acts, bias)(*args)

  return [
      harness.jaxfuse_impl(case.fn),
      harness.xla_impl(case.fn),
      harness.TorchImpl("torch", run_torch,
                        prepare=lambda *a: tuple(harness.jax_to_torch(x) for x in a),
                        note="torch matmuls + activations (eager)"),
  ]


def main(argv) -> int:
  del argv
  acts = parse_acts(FLAGS.acts)
  cases, groups = all_cases(acts, FLAGS.bias, FLAGS.dtype, FLAGS.shapes)
  names = harness.select_from_flags(cases, groups)
  return harness.main("mlp_chain", [cases[n] for n in names], impls_for,
                      title=f"MLP chains ({FLAGS.dtype}, {','.join(acts)})")


if __name__ == "__main__":
  app.run(main)
