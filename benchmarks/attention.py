"""Attention benchmark: MCFuser Table III (S1-S9), causal variants, large cases.

The workload is plain JAX attention, ``softmax(q k^T * scale [+ causal mask])
v``, written with ``einsum`` and ``jax.nn.softmax``; ``jaxfuse.jit`` and
``jax.jit`` compile that same function. Also measured in the same run, on the
same values:

* ``dpa-cudnn`` / ``dpa-xla``: ``jax.nn.dot_product_attention`` with
  ``implementation='cudnn'`` / ``'xla'`` ([B, T, N, H] layout);
* ``jaxfuse-dpa``: ``jaxfuse.jit`` of that ``'xla'`` call, the library's
  form of the same attention (its own mask idiom and layout);
* ``pallas``: ``jax.experimental.pallas.ops.gpu.attention.mha`` when it
  imports (GPU only);
* ``torch-flash`` / ``torch-cudnn``: PyTorch ``scaled_dot_product_attention``
  pinned to the flash / cuDNN backend when torch has CUDA.

Layout changes a baseline needs are done once before timing. Case names:
``S1``..``S9`` (MCFuser: batch 1, heads, M queries, N keys, head dims K=H),
``S1-causal``.., ``L-T<seq>-d<dim>`` (batch 8, 16 heads) with causal
variants, and grouped-query attention (fewer key/value heads than query
heads, as in Llama 3, Mistral and Qwen2: ``GQA-T<seq>-h<heads>-kv<kv>``,
``MQA-...`` for one key/value head; groups ``gqa`` and ``gqa-causal``), and
decoding steps (one query token against a key/value cache,
``DEC-B<batch>-S<keys>-h<heads>-kv<kv>``; group ``decode``), and causal
sliding-window attention (each query sees itself and the ``w`` keys before
it, as in Mistral and Gemma: ``SWA-T<seq>-w<w>-h<heads>-kv<kv>``; group
``window``; ``jax.nn.dot_product_attention(local_window_size=(w, 0))`` for
the library baselines), and Gemma-2's attention: causal, grouped heads,
scores soft-capped as ``cap * tanh(s / cap)`` (``GEMMA2-<size>-T<seq>``,
group ``softcap``; no library call takes the cap, so ``jax.jit`` is the one
baseline), and head dimension 256 without the cap (``D256-T<seq>-h<heads>-
kv<kv>`` and its causal variant, group ``d256``), and batches of padded
sequences (``PAD-B<batch>-T<seq>-h<heads>-d<dim>[-causal]``, group ``padded``: each
sequence has its own length, drawn between a quarter of ``T`` and ``T``;
keys past it are masked and the result's rows past it are zeroed, as
``jax.nn.dot_product_attention(query_seq_lengths=..,
key_value_seq_lengths=..)`` does, which the library baselines call). The
plain function of a grouped case folds each key/value head's query heads
into a group axis (``q.reshape(b, t, kv, heads // kv, d)``), as
``jax.nn.dot_product_attention``'s XLA path does. Causal masks are top-left
aligned (query i sees keys j <= i), as in ``jax.nn.dot_product_attention``
and PyTorch.

``--step=train`` times training steps of the self-attention cases instead
(names ``...-train``): the loss ``sum(attention(q, k, v) * g)`` and its q,
k, v gradients, the plain function under ``jax.jit`` and ``jaxfuse.jit``
beside ``jaxfuse-flash`` / ``xla-flash`` (the same attention with a
FlashAttention-2-style backward written in plain JAX,
``make_flash_attention``), cuDNN's, XLA's and Pallas's own backward passes.

Example::

    python -m benchmarks.attention --cases=mcfuser --dtype=float16 --plot
    python -m benchmarks.attention --step=train --cases=large-causal --calls=1
    python benchmarks/attention.py --shapes=1x12x512x512x64,2x8x1024x1024x128c
"""

from __future__ import annotations

import math
import os
import sys

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.attention_workloads import (causal_keep, make_attention, make_flash_attention,
                                            make_train_step, unpack_qkv)
from jaxfuse.planner import examples

harness.define_flags(default_cases="all",
                     shapes_help="Extra cases 'BxHxMxNxD' (batch, heads, "
                     "queries, keys, head dim), suffix 'c' for causal; "
                     "comma-separated; with --cases unset only these run.")
flags.DEFINE_enum("layout", "bhtd", ["bhtd", "bthd", "packed"],
                  "Layout of q/k/v in the plain JAX function that jax.jit and "
                  "jaxfuse.jit compile: [B, heads, T, D], [B, T, heads, D], or "
                  "'packed': one [B, T, 3*heads*D] array (a fused QKV "
                  "projection's output) that the function splits with "
                  "jnp.split (self-attention cases only: S1-S6, the large "
                  "cases, --shapes with M == N).")

# train: the loss sum(attention(q, k, v) * g) (g a random float32 cotangent)
# and its gradients with respect to q, k and v, the softmax in float32
# (MCFuser and large self-attention cases, causal or not; names get '-train').
harness.define_step_flag()

flags.DEFINE_integer("kv_heads", 0, "Key/value heads of the --shapes cases "
                     "(grouped-query attention; must divide the heads); 0: as many "
                     "as query heads.")

FLAGS = flags.FLAGS

_MCFUSER_NETWORKS = {
    "S1": "Bert-Small", "S2": "Bert-Base", "S3": "Bert-Large", "S4": "ViT-Base",
    "S5": "ViT-Large", "S6": "ViT-Huge", "S7": "MLP-Mixer", "S8": "MLP-Mixer",
    "S9": "MLP-Mixer"}
# (heads, M, N, K, H, network), MCFuser Table III (from jaxfuse.planner.examples); batch 1.
MCFUSER = {name: (*dims, _MCFUSER_NETWORKS[name]) for name, *dims in examples.MCFUSER_TABLE_III}

# (batch, heads, T, d): the large cases.
LARGE = {f"L-T{t}-d{d}": (8, 16, t, d) for t in (2048, 4096) for d in (64, 128)}
# (batch, heads, kv heads, T, d): grouped-query attention at LLM prefill
# shapes (Llama-3-8B / Mistral-7B: 32 query heads over 8; Llama-2-70B: 64
# over 8) and multi-query attention (one key/value head).
GROUPED = {"GQA-T2048-h32-kv8": (2, 32, 8, 2048, 128),
           "GQA-T4096-h32-kv8": (1, 32, 8, 4096, 128),
           "GQA-T2048-h64-kv8": (1, 64, 8, 2048, 128),
           "MQA-T2048-h16-kv1": (4, 16, 1, 2048, 64)}

# (batch, heads, kv heads, T, d, window): causal sliding-window attention at
# prefill (Mistral-7B: 32 query heads over 8, a 4096-token window over longer
# contexts; narrower windows as Gemma's local layers use), and one
# multi-head case.
WINDOWED = {"SWA-T4096-w512-h32-kv8": (1, 32, 8, 4096, 128, 512),
            "SWA-T8192-w1024-h32-kv8": (1, 32, 8, 8192, 128, 1024),
            "SWA-T4096-w256-h16-kv16": (4, 16, 16, 4096, 64, 256)}

# (batch, heads, kv heads, keys, d): one decoding step, one query token per
# sequence against a key/value cache (Llama-3-8B's 32 query heads over 8 at
# 4096 and 16384 keys; multi-head attention with a 32-head cache). No causal
# variant: the new token attends to every cached key.
DECODE = {"DEC-B1-S4096-h32-kv8": (1, 32, 8, 4096, 128),
          "DEC-B8-S4096-h32-kv8": (8, 32, 8, 4096, 128),
          "DEC-B1-S16384-h32-kv8": (1, 32, 8, 16384, 128),
          "DEC-B4-S4096-h32-kv32": (4, 32, 32, 4096, 128)}


# (batch, heads, kv heads, T, d, query scale, score cap, window): Gemma-2 2B,
# 9B and 27B at prefill (Gemma 2 report, Table 1: 8/16/32 query heads over
# 4/8/16, head dimension 256/256/128, attention logits soft-capped at 50.0;
# queries scaled by 256^-0.5, and by 144^-0.5 on 27B), global layers, and
# 9B's local layers (a 4096-token sliding window) over 8192 tokens.
GEMMA2 = {"GEMMA2-2B-T4096": (1, 8, 4, 4096, 256, 256 ** -0.5, 50.0, 0),
          "GEMMA2-9B-T4096": (1, 16, 8, 4096, 256, 256 ** -0.5, 50.0, 0),
          "GEMMA2-27B-T4096": (1, 32, 16, 4096, 128, 144 ** -0.5, 50.0, 0),
          "GEMMA2-9B-T8192-local": (1, 16, 8, 8192, 256, 256 ** -0.5, 50.0, 4096)}
# (batch, heads, kv heads, T, d): head dimension 256 without the cap, where
# cuDNN competes.
D256 = {"D256-T4096-h16-kv8": (1, 16, 8, 4096, 256)}
# (batch, heads, T, d, causal): padded batches, sequences of their own
# lengths (BERT-Base's inference at 512 tokens, longer prompts at 2048, and
# a decoder's causal prefill of them).
PADDED = {"PAD-B8-T512-h12-d64": (8, 12, 512, 64, False),
          "PAD-B4-T2048-h16-d128": (4, 16, 2048, 128, False),
          "PAD-B4-T2048-h16-d128-causal": (4, 16, 2048, 128, True)}


def sequence_lengths(b: int, t: int) -> list[int]:
  """Lengths of a padded batch's ``b`` sequences, evenly spread from t/4 to
  t (the same in every input set, so each call does the same work)."""
  lo = max(1, t // 4)
  return [lo + (t - lo) * i // max(1, b - 1) for i in range(b)]


def causal_pairs(m: int, n: int, window: int = 0) -> int:
  """(query, key) pairs a top-left causal mask keeps (within ``window``
  keys before each query when it is set)."""
  return sum(min(i + 1, n) - (max(0, i - window) if window else 0) for i in range(m))


def make_case(name: str, b: int, h: int, m: int, n: int, dk: int, dv: int, *,
              causal: bool, layout: str, group: str, dtype: str, kv_heads: int = 0,
              window: int = 0, softcap: float = 0.0, scale: float = 0.0,
              padded: bool = False, extra: dict | None = None,
              step: str = "forward") -> harness.Case:
  scale = scale or 1.0 / math.sqrt(dk)
  kv = kv_heads or h
  if step not in ("forward", "train"):
    raise ValueError(f"step: {step!r} is not 'forward' or 'train'")
  train = step == "train"
  if train and (layout == "packed" or (kv_heads and kv_heads != h) or window or softcap
                or padded or m != n or dk != dv):
    raise ValueError(f"--step=train: case {name} is not self-attention with as many "
                     "key/value heads as query heads (M == N, K == H), causal or not, "
                     "in the bhtd or bthd layout")
  if h % kv:
    raise ValueError(f"--kv_heads: {kv} key/value heads do not divide {h} heads "
                     f"(case {name})")
  if layout == "packed" and (m != n or dk != dv or kv != h):
    raise ValueError(f"--layout=packed needs self-attention (M == N, K == H) with as "
                     f"many key/value heads as query heads; case {name} has M={m}, "
                     f"N={n}, K={dk}, H={dv}, {kv} of {h} heads")
  if window and not causal:
    raise ValueError(f"case {name}: a sliding window is measured with a causal mask")
  if padded and (layout == "packed" or m != n):
    raise ValueError(f"case {name}: padded sequences are measured as self-attention "
                     "(M == N) in the bhtd or bthd layout")
  if train:
    fn = make_train_step(make_attention(causal, scale, layout, softmax_dtype=jnp.float32))
  else:
    fn = make_attention(causal, scale, layout, h, kv, window, softcap, padded)

  def shape(heads, t, d):
    return (b, heads, t, d) if layout == "bhtd" else (b, t, heads, d)

  def make_inputs(key, dt):
    kq, kk, kvk, kg = jax.random.split(key, 4)
    if layout == "packed":
      return (harness.normal(kq, (b, m, 3 * h * dk), dt),)
    qkv = (harness.normal(kq, shape(h, m, dk), dt), harness.normal(kk, shape(kv, n, dk), dt),
           harness.normal(kvk, shape(kv, n, dv), dt))
    if train:
      return qkv + (harness.normal(kg, shape(h, m, dv), "float32"),)
    # An array, not a constant: the compiled programs cannot specialize on it.
    return qkv + (jnp.asarray(sequence_lengths(b, n), jnp.int32),) if padded else qkv

  if padded:   # useful work: each sequence's own length squared (causal: its triangle)
    pairs = sum(x * (x + 1) // 2 if causal else x * x for x in sequence_lengths(b, n)) / b
  else:
    pairs = causal_pairs(m, n, window) if causal else m * n
  item = jnp.dtype(dtype).itemsize
  # A training step: the forward's two products and the backward's four
  # (dv, dp, dq, dk), 3x the forward's FLOPs; it reads q, k, v and the
  # float32 cotangent and writes three gradients.
  flops = 2.0 * b * h * pairs * (dk + dv) * (3 if train else 1)
  kept = sum(sequence_lengths(b, n)) / (b * n) if padded else 1.0   # rows past a length are not read
  nbytes = float(item * b * (kept * (h * m * dk + kv * n * dk + kv * n * dv) + h * m * dv))
  if train:
    nbytes = float(b * h * m * dk * (6 * item + 4))
  params = {"batch": b, "heads": h, "kv_heads": kv, "M": m, "N": n, "K": dk, "H": dv,
            "causal": causal, "window": window, "layout": layout, "scale": scale,
            "softcap": softcap, "padded": padded, "step": step}
  params.update(extra or {})
  return harness.Case(name + ("-train" if train else ""), fn, make_inputs, flops, nbytes,
                      params, group=group + (" training step" if train else ""))


def all_cases(layout: str, dtype: str, shapes: str = "", kv_heads: int = 0,
              step: str = "forward") -> tuple[dict, dict]:
  """Every case (name -> Case) and the named groups; ``kv_heads`` applies to
  the ``shapes`` cases. ``step='train'``: training steps of the
  self-attention cases (MCFuser S1-S6, the large cases, ``shapes``), each
  causal or not."""
  train = step == "train"
  if train and layout == "packed":
    raise ValueError("--step=train takes --layout=bhtd or bthd")
  if train and kv_heads:
    raise ValueError("--step=train takes no --kv_heads: its cases have as many key/value "
                     "heads as query heads")
  cases = {}
  groups = {"mcfuser": [], "mcfuser-causal": [], "large": [], "large-causal": [],
            "gqa": [], "gqa-causal": [], "decode": [], "window": [], "softcap": [],
            "d256": [], "padded": [], "shapes": []}
  for causal in (False, True):
    sfx = "-causal" if causal else ""
    for s, (h, m, n, dk, dv, net) in MCFUSER.items():
      if (layout == "packed" or train) and (m != n or dk != dv):
        continue   # S7-S9 attend to fewer keys than queries: no packed form or train step
      c = make_case(s + sfx, 1, h, m, n, dk, dv, causal=causal, layout=layout,
                    group="MCFuser Table III" + (" causal" if causal else ""),
                    dtype=dtype, extra={"network": net}, step=step)
      cases[c.name] = c
      groups["mcfuser" + sfx].append(c.name)
    for s, (b, h, t, d) in LARGE.items():
      c = make_case(s + sfx, b, h, t, t, d, d, causal=causal, layout=layout,
                    group="large" + (" causal" if causal else ""), dtype=dtype, step=step)
      cases[c.name] = c
      groups["large" + sfx].append(c.name)
    if layout == "packed" or train:
      continue   # a packed QKV of grouped heads is not [B, T, 3*heads*D]
    for s, (b, h, kv, t, d) in GROUPED.items():
      c = make_case(s + sfx, b, h, t, t, d, d, causal=causal, layout=layout, kv_heads=kv,
                    group="grouped-query" + (" causal" if causal else ""), dtype=dtype)
      cases[c.name] = c
      groups["gqa" + sfx].append(c.name)
  if layout != "packed" and not train:
    for s, (b, h, kv, n, d) in DECODE.items():
      c = make_case(s, b, h, 1, n, d, d, causal=False, layout=layout, kv_heads=kv,
                    group="decode", dtype=dtype)
      cases[c.name] = c
      groups["decode"].append(c.name)
    for s, (b, h, kv, t, d, w) in WINDOWED.items():
      c = make_case(s, b, h, t, t, d, d, causal=True, layout=layout, kv_heads=kv,
                    window=w, group="sliding window", dtype=dtype)
      cases[c.name] = c
      groups["window"].append(c.name)
    for s, (b, h, kv, t, d, scale, cap, w) in GEMMA2.items():
      c = make_case(s, b, h, t, t, d, d, causal=True, layout=layout, kv_heads=kv, window=w,
                    softcap=cap, scale=scale, group="soft-capped (Gemma 2)", dtype=dtype)
      cases[c.name] = c
      groups["softcap"].append(c.name)
    for causal in (False, True):
      for s, (b, h, kv, t, d) in D256.items():
        c = make_case(s + ("-causal" if causal else ""), b, h, t, t, d, d, causal=causal,
                      layout=layout, kv_heads=kv, group="head dimension 256", dtype=dtype)
        cases[c.name] = c
        groups["d256"].append(c.name)
    for s, (b, h, t, d, causal) in PADDED.items():
      c = make_case(s, b, h, t, t, d, d, causal=causal, layout=layout, padded=True,
                    group="padded sequences", dtype=dtype)
      cases[c.name] = c
      groups["padded"].append(c.name)
  for (b, h, m, n, d), sfx in harness.parse_shapes(shapes, "BxHxMxNxD", ("", "c")):
    causal = sfx == "c"
    kv = f"-KV{kv_heads}" if kv_heads and kv_heads != h else ""
    c = make_case(f"B{b}-H{h}{kv}-M{m}-N{n}-D{d}" + ("-causal" if causal else ""),
                  b, h, m, n, d, d, causal=causal, layout=layout, group="custom",
                  dtype=dtype, kv_heads=kv_heads, step=step)
    cases[c.name] = c
    groups["shapes"].append(c.name)
  groups["tables"] = groups["mcfuser"]
  groups["causal"] = groups["mcfuser-causal"] + groups["large-causal"] + groups["gqa-causal"]
  if train:   # no training step of the other groups: --cases names them as unknown
    groups = {g: v for g, v in groups.items() if v or g == "shapes"}
  return cases, groups


# --- baselines ---------------------------------------------------------------

def _swap(x):
  """[B, H, T, D] <-> [B, T, H, D]."""
  return jnp.swapaxes(x, 1, 2)


def _dpa_xla_check():
  # XLA:CPU rejects the f16xf16->f32 dot that dot_product_attention emits.
  if not harness.on_gpu() and FLAGS.dtype != "float32":
    return f"jax.nn.dot_product_attention(xla) needs float32 on CPU, not {FLAGS.dtype}"
  return None


def _pallas_check(grouped: bool, window: int = 0):
  if window:
    return "pallas mha has no sliding window"
  if grouped:
    return "pallas mha takes as many key/value heads as query heads"
  try:
    from jax.experimental.pallas.ops.gpu import attention as _  # noqa: F401  pylint: disable=g-import-not-at-top
  except Exception as e:
    return f"pallas mha does not import ({type(e).__name__}: {e})"
  return None


def _torch_backend_check(backend: str, window: int = 0):
  def check():
    if window:
      return "torch SDPA takes a sliding window only as a dense mask (no flash or cuDNN kernel)"
    try:
      from torch.nn.attention import SDPBackend  # noqa: F401  pylint: disable=g-import-not-at-top
      getattr(SDPBackend, backend)
    except Exception as e:
      return f"torch SDPA backend {backend} unavailable ({type(e).__name__})"
    return None
  return check


def _torch_context(backend: str):
  def ctx():
    import torch  # pylint: disable=g-import-not-at-top
    from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=g-import-not-at-top
    import contextlib  # pylint: disable=g-import-not-at-top
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    stack.enter_context(sdpa_kernel([getattr(SDPBackend, backend)]))
    return stack
  return ctx


def _train_impls(case: harness.Case) -> list[harness.Impl]:
  """A training step's competitors: the plain function under jax.jit and
  jaxfuse.jit; the same attention with a hand-written FlashAttention-2-style
  backward (``make_flash_attention``) under both; the library calls'
  own backward passes, and jaxfuse.jit of ``jax.nn.dot_product_attention``'s."""
  p = case.params
  causal, scale, layout = p["causal"], p["scale"], p["layout"]
  flash = make_train_step(make_flash_attention(causal, scale, layout))
  if layout == "bhtd":
    to_btnh = lambda q, k, v, g: (_swap(q), _swap(k), _swap(v), _swap(g))
    from_btnh = lambda out: (out[0], tuple(_swap(x) for x in out[1]))
  else:
    to_btnh = from_btnh = None

  def dpa(impl):
    return make_train_step(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, implementation=impl))

  def pallas(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as pa  # pylint: disable=g-import-not-at-top
    return pa.mha(q, k, v, None, sm_scale=scale, causal=causal)

  return [
      harness.jaxfuse_impl(case.fn),
      harness.xla_impl(case.fn),
      harness.JaxImpl("jaxfuse-flash", flash, compiler="jaxfuse",
                      note="jaxfuse.jit of attention with a FlashAttention-2-style "
                      "backward in plain JAX (jax.custom_vjp)"),
      harness.JaxImpl("xla-flash", flash, compiler="jax",
                      note="jax.jit of the same FlashAttention-2-style backward"),
      harness.JaxImpl("dpa-cudnn", dpa("cudnn"), prepare=to_btnh, restore=from_btnh,
                      needs_gpu=True,
                      note="jax.nn.dot_product_attention(implementation='cudnn'), "
                      "its forward and backward"),
      harness.JaxImpl("dpa-xla", dpa("xla"), prepare=to_btnh, restore=from_btnh,
                      check=_dpa_xla_check,
                      note="jax.nn.dot_product_attention(implementation='xla')"),
      # The training step most users write: its autodiff backward reaches
      # capture through dpa's size-1 group axis and transposes.
      harness.JaxImpl("jaxfuse-dpa", dpa("xla"), compiler="jaxfuse", prepare=to_btnh,
                      restore=from_btnh, check=_dpa_xla_check,
                      note="jaxfuse.jit of jax.nn.dot_product_attention(implementation='xla'), "
                      "its forward and autodiff backward"),
      harness.JaxImpl("pallas", make_train_step(pallas), prepare=to_btnh,
                      restore=from_btnh, needs_gpu=True,
                      check=lambda: _pallas_check(False),
                      note="jax.experimental.pallas.ops.gpu.attention.mha, its "
                      "forward and backward kernels"),
  ]


def impls_for(case: harness.Case) -> list[harness.Impl]:
  p = case.params
  if p.get("step") == "train":
    return _train_impls(case)
  causal, scale, layout = p["causal"], p["scale"], p["layout"]
  window = p.get("window", 0)
  capped = "no library attention takes a score cap" if p.get("softcap") else None
  # Everything below but the plain function wants [B, T, N, H] (jax) or
  # [B, N, T, H] (torch); convert outside timing (for 'packed': q, k and v
  # split into their own arrays, each baseline's best case).
  padded = p.get("padded", False)
  unpadded = "takes no sequence lengths" if padded else None
  to_btnh = ((lambda q, k, v, *lengths: (_swap(q), _swap(k), _swap(v), *lengths))
             if layout == "bhtd" else None)
  from_btnh = _swap if layout == "bhtd" else None
  if layout == "packed":
    to_btnh = lambda qkv: unpack_qkv(qkv, p["heads"])

  # cuDNN takes a left window only (with the causal mask): what the cases use.
  local = {"local_window_size": (window, 0)} if window else {}

  def dpa(impl):
    def call(q, k, v, lengths=None):
      lens = {"query_seq_lengths": lengths, "key_value_seq_lengths": lengths} if padded else {}
      return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                          implementation=impl, **local, **lens)
    return call

  def pallas(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as pa  # pylint: disable=g-import-not-at-top
    return pa.mha(q, k, v, None, sm_scale=scale, causal=causal)

  grouped = p["kv_heads"] != p["heads"]

  def torch_sdpa(q, k, v):
    import torch  # pylint: disable=g-import-not-at-top
    # enable_gqa (torch >= 2.5) shares each key/value head among its group.
    kw = {"enable_gqa": True} if grouped else {}
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, scale=scale, **kw)

  def torch_prep(*args):
    q, k, v = args if layout != "packed" else unpack_qkv(args[0], p["heads"])
    xs = (q, k, v) if layout == "bhtd" else (_swap(q), _swap(k), _swap(v))
    return tuple(harness.jax_to_torch(x).contiguous() for x in xs)

  def torch_restore(o):
    return o if layout == "bhtd" else o.transpose(1, 2)

  impls = [
      harness.jaxfuse_impl(case.fn),
      harness.xla_impl(case.fn),
      harness.JaxImpl("dpa-cudnn", dpa("cudnn"), prepare=to_btnh, restore=from_btnh,
                      needs_gpu=True, check=lambda: capped,
                      note="jax.nn.dot_product_attention(implementation='cudnn')"),
      harness.JaxImpl("dpa-xla", dpa("xla"), prepare=to_btnh, restore=from_btnh,
                      check=lambda: capped or _dpa_xla_check(),
                      note="jax.nn.dot_product_attention(implementation='xla')"),
      # The library call as users write it, fused by jaxfuse: its causal mask
      # is a select of a tril with a finite fill, not the plain function's
      # iota compare with -inf.
      harness.JaxImpl("jaxfuse-dpa", dpa("xla"), compiler="jaxfuse", prepare=to_btnh,
                      restore=from_btnh, check=lambda: capped or _dpa_xla_check(),
                      note="jaxfuse.jit of jax.nn.dot_product_attention(implementation='xla')"),
      harness.JaxImpl("pallas", pallas, prepare=to_btnh, restore=from_btnh,
                      needs_gpu=True,
                      check=lambda: capped or (unpadded and f"pallas mha {unpadded}")
                      or _pallas_check(grouped, window),
                      note="jax.experimental.pallas.ops.gpu.attention.mha"),
  ]
  for name, backend in (("torch-flash", "FLASH_ATTENTION"), ("torch-cudnn", "CUDNN_ATTENTION")):
    impls.append(harness.TorchImpl(
        name, torch_sdpa, prepare=torch_prep, restore=torch_restore,
        check=lambda b=backend: capped or (unpadded and f"torch SDPA {unpadded}")
        or _torch_backend_check(b, window)(),
        context=_torch_context(backend),
        note=f"torch SDPA {backend} (eager)"))
  return impls


def main(argv) -> int:
  del argv
  cases, groups = all_cases(FLAGS.layout, FLAGS.dtype, FLAGS.shapes, FLAGS.kv_heads,
                            FLAGS.step)
  names = harness.select_from_flags(cases, groups)
  step = ", training step" if FLAGS.step == "train" else ""
  return harness.main("attention", [cases[n] for n in names], impls_for,
                      title=f"attention ({FLAGS.dtype}, {FLAGS.layout}{step})")


if __name__ == "__main__":
  app.run(main)
