"""GEMM-chain benchmark: MCFuser Table II, Chimera Table IV, custom shapes.

The chain is ``E = epilogue(A @ B) @ D`` with ``A: (batch, M, K)``,
``B: (batch, K, N)``, ``D: (batch, N, H)`` (MCFuser's naming). Chimera's
Table IV writes the same chain as ``(batch,M,K) x (batch,K,L)`` then
``(batch,M,L) x (batch,L,N)``: its ``L`` is our ``N`` and its ``N`` our ``H``;
the cases below are converted and keep Chimera's numbers in ``params``.

Compared, in one run: ``jaxfuse.jit`` and ``jax.jit`` of the same plain
``jnp`` function, and PyTorch (``torch.bmm`` twice) when torch has CUDA.

Example::

    python -m benchmarks.gemm_chain --cases=mcfuser --dtype=float16 --plot
    python benchmarks/gemm_chain.py --shapes=8x2048x2048x64x64 --epilogue=softmax
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
from jaxfuse.planner import examples

harness.define_flags(default_cases="tables",
                     shapes_help="Extra chains 'BxMxNxKxH' (MCFuser naming), "
                     "comma-separated; with --cases unset only these run.")
flags.DEFINE_enum("epilogue", "none", ["none", "softmax", "relu", "gelu"],
                  "Elementwise/row op between the two GEMMs (Chimera evaluates "
                  "'none' and 'softmax').")

FLAGS = flags.FLAGS

# The paper tables live once, in jaxfuse.planner.examples.
# (batch, M, N, K, H), MCFuser Table II.
MCFUSER = {name: tuple(dims) for name, *dims in examples.MCFUSER_TABLE_II}

_CHIMERA_NETWORKS = {
    "G1": "Bert-Small", "G2": "Bert-Base", "G3": "Bert-Large", "G4": "ViT-Base/14",
    "G5": "ViT-Large/14", "G6": "ViT-Huge/14", "G7": "ViT-Base/16", "G8": "ViT-Large/16",
    "G9": "ViT-Huge/16", "G10": "MLP-Mixer", "G11": "MLP-Mixer", "G12": "MLP-Mixer"}
# (batch, M, N, K, L, network), Chimera Table IV in Chimera's naming.
CHIMERA = {name: (*dims, _CHIMERA_NETWORKS[name]) for name, *dims in examples.CHIMERA_TABLE_IV}


def _epilogue(name: str) -> Callable[[jax.Array], jax.Array]:
  return {
      "none": lambda c: c,
      "softmax": lambda c: jax.nn.softmax(c, axis=-1),
      "relu": jax.nn.relu,
      "gelu": jax.nn.gelu,
  }[name]


def make_chain(epilogue: str) -> Callable:
  """The plain JAX function both jax.jit and jaxfuse.jit compile."""
  ep = _epilogue(epilogue)

  def chain(a, b, d):
    c = jnp.matmul(a, b)          # (batch, M, N)
    return jnp.matmul(ep(c), d)   # (batch, M, H)
  return chain


def make_case(name: str, batch: int, m: int, n: int, k: int, h: int, *,
              epilogue: str = "none", group: str = "", extra: dict | None = None,
              dtype: str = "float16") -> harness.Case:
  """A GEMM-chain case in MCFuser's naming."""
  fn = make_chain(epilogue)

  def make_inputs(key, dt):
    ka, kb, kd = jax.random.split(key, 3)
    # Weights scaled by 1/sqrt(fan-in) keep values O(1) in float16.
    return (harness.normal(ka, (batch, m, k), dt),
            harness.normal(kb, (batch, k, n), dt, 1 / math.sqrt(k)),
            harness.normal(kd, (batch, n, h), dt, 1 / math.sqrt(n)))

  item = jnp.dtype(dtype).itemsize
  flops = 2.0 * batch * m * n * (k + h)
  nbytes = float(item * batch * (m * k + k * n + n * h + m * h))
  params = {"batch": batch, "M": m, "N": n, "K": k, "H": h, "epilogue": epilogue}
  params.update(extra or {})
  suffix = "" if epilogue == "none" else f"+{epilogue}"
  return harness.Case(name + suffix, fn, make_inputs, flops, nbytes, params,
                      group=group)


def all_cases(epilogue: str, dtype: str, shapes: str = "") -> tuple[dict, dict]:
  cases, groups = {}, {"mcfuser": [], "chimera": [], "tables": [], "shapes": []}
  for g, (b, m, n, k, h) in MCFUSER.items():
    c = make_case(f"MC-{g}", b, m, n, k, h, epilogue=epilogue, group="MCFuser Table II",
                  dtype=dtype)
    cases[f"MC-{g}"] = c   # selected by table name; c.name carries the epilogue
    groups["mcfuser"].append(f"MC-{g}")
  for g, (b, m, n_ch, k, l, net) in CHIMERA.items():
    c = make_case(f"CH-{g}", b, m, l, k, n_ch, epilogue=epilogue, dtype=dtype,
                  group="Chimera Table IV",
                  extra={"chimera": {"batch": b, "M": m, "N": n_ch, "K": k, "L": l},
                         "network": net})
    cases[f"CH-{g}"] = c
    groups["chimera"].append(f"CH-{g}")
  groups["tables"] = groups["mcfuser"] + groups["chimera"]
  for (b, m, n, k, h) in (d for d, _ in harness.parse_shapes(shapes, "BxMxNxKxH")):
    key = f"B{b}-M{m}-N{n}-K{k}-H{h}"
    c = make_case(key, b, m, n, k, h, epilogue=epilogue, group="custom", dtype=dtype)
    cases[key] = c
    groups["shapes"].append(key)
  return cases, groups


def torch_chain(epilogue: str):
  import torch  # pylint: disable=g-import-not-at-top
  ep = {"none": lambda c: c, "softmax": lambda c: torch.softmax(c, -1),
        "relu": torch.relu,
        "gelu": lambda c: torch.nn.functional.gelu(c, approximate="tanh")}[epilogue]
  return lambda a, b, d: torch.bmm(ep(torch.bmm(a, b)), d)


def impls_for(case: harness.Case) -> list[harness.Impl]:
  ep = case.params["epilogue"]
  return [
      harness.jaxfuse_impl(case.fn),
      harness.xla_impl(case.fn),
      harness.TorchImpl(
          "torch", lambda a, b, d: torch_chain(ep)(a, b, d),
          prepare=lambda a, b, d: tuple(harness.jax_to_torch(x) for x in (a, b, d)),
          note="torch.bmm x2 (eager)"),
  ]


def main(argv) -> int:
  del argv
  cases, groups = all_cases(FLAGS.epilogue, FLAGS.dtype, FLAGS.shapes)
  names = harness.select_from_flags(cases, groups)
  return harness.main("gemm_chain", [cases[n] for n in names], impls_for,
                      title=f"GEMM chains ({FLAGS.dtype})")


if __name__ == "__main__":
  app.run(main)
