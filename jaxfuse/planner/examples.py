"""Chain IR regions of the papers' workloads, built directly with the IR.

Used by the planner's tests and ``benchmarks/plan_time.py``; handy for
readers who want to plan a region without tracing a JAX function.

Example::

    from jaxfuse.planner import examples
    r = examples.gemm_chain(1, 1024, 1024, 512, 512, batch=False)
    print(r)
"""

from __future__ import annotations

from typing import Optional, Sequence

from jaxfuse import ir

__all__ = ["gemm_chain", "attention", "mlp_chain", "MCFUSER_TABLE_II",
           "MCFUSER_TABLE_III", "CHIMERA_TABLE_IV", "paper_cases"]


def _buf(name: str, loops: Sequence[str], ext: dict[str, int]) -> ir.Buffer:
  shape = tuple(ext[l] for l in loops)
  return ir.Buffer(name, shape, tuple(zip(loops, ir.contiguous_strides(shape))))


def gemm_chain(b: int, m: int, n: int, k: int, h: int, *, dtype: str = "float16",
               batch: bool = True) -> ir.Region:
  """MCFuser's chain ``C = A·B, E = C·D`` with ``A:[b,M,K] B:[b,K,N] D:[b,N,H]``.

  ``batch=False`` drops the batch loop (the four-loop form of the paper).
  """
  ext = {"m": m, "n": n, "k": k, "h": h}
  bl: tuple[str, ...] = ()
  if batch:
    ext = {"b": b, **ext}
    bl = ("b",)
  loops = tuple(ir.Loop(l, e) for l, e in ext.items())
  vals = (ir.Value("a", bl + ("m", "k"), dtype), ir.Value("bb", bl + ("k", "n"), dtype),
          ir.Value("c", bl + ("m", "n"), dtype), ir.Value("d", bl + ("n", "h"), dtype),
          ir.Value("e", bl + ("m", "h"), dtype))
  ins = (_buf("a", bl + ("m", "k"), ext), _buf("bb", bl + ("k", "n"), ext),
         _buf("d", bl + ("n", "h"), ext))
  ops = (ir.Contraction("c", "a", "bb", ("k",)), ir.Contraction("e", "c", "d", ("n",)))
  return ir.Region(loops, vals, ins, (_buf("e", bl + ("m", "h"), ext),), ops,
                   name="gemm_chain")


def attention(b: int, heads: int, m: int, n: int, d: int, dv: Optional[int] = None, *,
              dtype: str = "float16", scale: Optional[float] = None) -> ir.Region:
  """Self-attention ``softmax(q·kᵀ·scale)·v`` as the IR writes it: a row
  max, ``exp(s - max)``, a row sum, the second contraction, one division."""
  dv = d if dv is None else dv
  scale = d ** -0.5 if scale is None else scale
  ext = {"b": b, "g": heads, "m": m, "n": n, "d": d, "e": dv}
  loops = tuple(ir.Loop(l, x) for l, x in ext.items())
  f32 = "float32"
  vals = (
      ir.Value("q", ("b", "g", "m", "d"), dtype), ir.Value("k", ("b", "g", "n", "d"), dtype),
      ir.Value("v", ("b", "g", "n", "e"), dtype),
      ir.Value("s0", ("b", "g", "m", "n"), f32), ir.Value("s", ("b", "g", "m", "n"), f32),
      ir.Value("mx", ("b", "g", "m"), f32), ir.Value("t", ("b", "g", "m", "n"), f32),
      ir.Value("p", ("b", "g", "m", "n"), f32), ir.Value("l", ("b", "g", "m"), f32),
      ir.Value("ph", ("b", "g", "m", "n"), dtype),
      ir.Value("o", ("b", "g", "m", "e"), f32), ir.Value("out", ("b", "g", "m", "e"), dtype),
  )
  ins = (_buf("q", ("b", "g", "m", "d"), ext), _buf("k", ("b", "g", "n", "d"), ext),
         _buf("v", ("b", "g", "n", "e"), ext))
  ops = (
      ir.Contraction("s0", "q", "k", ("d",)),
      ir.Elementwise("s", "mul", ("s0", ir.Literal(float(scale), f32))),
      ir.Reduction("mx", "max", "s", "n"),
      ir.Elementwise("t", "sub", ("s", "mx")),
      ir.Elementwise("p", "exp", ("t",)),
      ir.Reduction("l", "sum", "p", "n"),
      ir.Elementwise("ph", "convert", ("p",)),
      ir.Contraction("o", "ph", "v", ("n",)),
      ir.Elementwise("out", "div", ("o", "l")),
  )
  return ir.Region(loops, vals, ins, (_buf("out", ("b", "g", "m", "e"), ext),), ops,
                   name="attention")


def mlp_chain(b: int, m: int, dims: Sequence[int], *, dtype: str = "float16",
              act: str = "tanh") -> ir.Region:
  """``x·W1 → act → ·W2 → act → ... ·Wn``: len(dims)-1 GEMMs over ``m`` rows."""
  if len(dims) < 3:
    raise ValueError("dims needs at least 3 entries (two GEMMs)")
  names = [f"k{i}" for i in range(len(dims))]
  ext = {"b": b, "m": m, **dict(zip(names, dims))}
  loops = tuple(ir.Loop(l, x) for l, x in ext.items())
  vals = [ir.Value("x", ("b", "m", names[0]), dtype)]
  ins = [_buf("x", ("b", "m", names[0]), ext)]
  ops = []
  prev = "x"
  for i in range(1, len(dims)):
    w = f"w{i}"
    vals.append(ir.Value(w, ("b", names[i - 1], names[i]), dtype))
    ins.append(_buf(w, ("b", names[i - 1], names[i]), ext))
    y = f"y{i}"
    vals.append(ir.Value(y, ("b", "m", names[i]), dtype))
    ops.append(ir.Contraction(y, prev, w, (names[i - 1],)))
    prev = y
    if i < len(dims) - 1 and act:
      z = f"z{i}"
      vals.append(ir.Value(z, ("b", "m", names[i]), dtype))
      ops.append(ir.Elementwise(z, act, (y,)))
      prev = z
  return ir.Region(loops, tuple(vals), tuple(ins), (_buf(prev, ("b", "m", names[-1]), ext),),
                   tuple(ops), name="mlp_chain")


# (name, batch, M, N, K, H) -- MCFuser Table II, batch GEMM chains.
MCFUSER_TABLE_II = (
    ("G1", 1, 512, 256, 64, 64), ("G2", 1, 512, 256, 64, 128),
    ("G3", 1, 512, 256, 64, 256), ("G4", 1, 512, 512, 256, 256),
    ("G5", 1, 512, 512, 512, 256), ("G6", 1, 512, 512, 1024, 256),
    ("G7", 1, 512, 512, 128, 128), ("G8", 1, 1024, 512, 128, 128),
    ("G9", 1, 2048, 512, 128, 128), ("G10", 1, 1024, 1024, 128, 128),
    ("G11", 4, 1024, 1024, 128, 128), ("G12", 8, 1024, 1024, 128, 128),
)
# (name, heads, M, N, K, H) -- MCFuser Table III, self-attention.
MCFUSER_TABLE_III = (
    ("S1", 8, 512, 512, 64, 64), ("S2", 12, 512, 512, 64, 64),
    ("S3", 16, 512, 512, 64, 64), ("S4", 12, 256, 256, 64, 64),
    ("S5", 16, 256, 256, 64, 64), ("S6", 16, 256, 256, 80, 80),
    ("S7", 1, 512, 256, 64, 64), ("S8", 1, 768, 384, 64, 64),
    ("S9", 1, 1024, 512, 64, 64),
)
# (name, batch, M, N, K, L) -- Chimera Table IV (A:MxK, B:KxL, D:LxN).
CHIMERA_TABLE_IV = (
    ("G1", 8, 512, 64, 64, 512), ("G2", 12, 512, 64, 64, 512),
    ("G3", 16, 512, 64, 64, 512), ("G4", 12, 256, 64, 64, 256),
    ("G5", 16, 256, 64, 64, 256), ("G6", 16, 256, 80, 80, 256),
    ("G7", 12, 208, 64, 64, 208), ("G8", 16, 208, 64, 64, 208),
    ("G9", 16, 208, 80, 80, 208), ("G10", 1, 512, 64, 64, 256),
    ("G11", 1, 768, 64, 64, 384), ("G12", 1, 1024, 64, 64, 512),
)


def paper_cases(dtype: str = "float16") -> list[tuple[str, ir.Region]]:
  """Every case of MCFuser Tables II/III and Chimera Table IV as regions.

  MCFuser's S7-S9 (MLP-Mixer) are attention-shaped with M != N; Chimera's
  chains map to ``gemm_chain(b, M, L, K, N)`` in MCFuser's letters.
  """
  out = []
  for name, b, m, n, k, h in MCFUSER_TABLE_II:
    out.append((f"mcfuser/{name}", gemm_chain(b, m, n, k, h, dtype=dtype)))
  for name, g, m, n, k, h in MCFUSER_TABLE_III:
    out.append((f"mcfuser/{name}", attention(1, g, m, n, k, h, dtype=dtype)))
  for name, b, m, n, k, l in CHIMERA_TABLE_IV:
    out.append((f"chimera/{name}", gemm_chain(b, m, l, k, n, dtype=dtype)))
  return out
