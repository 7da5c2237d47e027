"""Plan check: the planner's best plans, each compiled and self-checked on the GPU.

Triton miscompiles some dots: wrong values and, with many such kernels in one
process, illegal memory accesses. The pruning rules
(``jaxfuse.planner.pruning.dot_hazard``) keep the known families out of the
search; they were measured on one Triton version and one GPU. This binary
looks for families they miss. For a spread of regions (the papers' tables,
MLP chains of two and three GEMMs with and without an activation, attention
variants, decoding steps, small-K chains) it asks the planner for its best ``--plans_per_region`` plans
and runs each through ``jaxfuse.runtime.launch.measure_plans``: compile,
self-check against a float32 reference, time. Run it after a Triton, jax or
GPU change. It exits 1 when any plan computes a wrong answer or a region's
process dies. With ``--process_per_region`` (the default) each region runs in its own
process, since a fault poisons the CUDA context for the rest of a process.

Without a GPU it checks the ``tiny`` regions' best plans in Triton's
interpreter against the IR evaluator. That tests the code generator, not the
GPU backend, and the output says so.

Example::

    python -m benchmarks.plan_check                      # every region, top 24
    python -m benchmarks.plan_check --cases=mlp,attention --plans_per_region=48 --out=/tmp/pc
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags

from benchmarks import harness

harness.define_flags(default_cases="all")
flags.DEFINE_integer("plans_per_region", 24, "Plans per region: the planner's best, in its "
                     "order.")
flags.DEFINE_float("region_budget_s", 30.0, "Compile-and-check budget per region (seconds).")
flags.DEFINE_bool("process_per_region", True, "Check each region in a fresh process "
                  "(GPU only).")

FLAGS = flags.FLAGS


def check_regions(dtype: str) -> tuple[dict[str, Any], dict[str, list[str]]]:
  """Regions to check by name, and their groups."""
  from jaxfuse.codegen import testing as T  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner import examples  # pylint: disable=g-import-not-at-top
  regions: dict[str, Any] = {}
  groups: dict[str, list[str]] = {}

  def add(group: str, name: str, region) -> None:
    regions[name] = region
    groups.setdefault(group, []).append(name)
  for name, r in examples.paper_cases(dtype):
    add("paper", name, r)
  for act in ("", "tanh"):
    for m in (32, 128, 512):
      add("mlp", f"mlp-{act or 'none'}-M{m}", examples.mlp_chain(1, m, [768, 3072, 768], dtype=dtype,
                                                                  act=act))
    add("mlp", f"mlp3-{act or 'none'}-M128",
        examples.mlp_chain(1, 128, [256, 1024, 256, 64], dtype=dtype, act=act))
  for d in (32, 64, 128):
    add("attention", f"att-d{d}-causal", T.attention(M=512, N=512, D=d, B=2, heads=4, dtype=dtype,
                                                      causal=True, scale=d ** -0.5))
  add("attention", "att-d64-bias-mask", T.attention(M=256, N=384, D=64, B=2, heads=2, dtype=dtype,
                                                    bias=True, mask=True))
  add("attention", "att-d80-dv48", T.attention(M=200, N=300, D=80, Dv=48, heads=4, dtype=dtype,
                                               scale=0.1))
  for k in (16, 32):
    add("chains", f"gemm-K{k}", examples.gemm_chain(2, 512, 256, k, 64, dtype=dtype))
  # Middle loops of one tile (128 keys or fewer: short sequences, a
  # transformer's per-layer attention at 128 tokens): the second dot then
  # reads the whole computed row, with no loop around it.
  for d in (64, 128):
    add("short", f"att-N128-d{d}", T.attention(M=128, N=128, D=d, B=1, heads=8, dtype=dtype,
                                               scale=d ** -0.5))
  add("short", "att-N64-d64", T.attention(M=256, N=64, D=64, B=1, heads=8, dtype=dtype,
                                          scale=0.125))
  add("short", "att-N128-d64-causal", T.attention(M=128, N=128, D=64, B=1, heads=8,
                                                  dtype=dtype, causal=True, scale=0.125))
  for n in (64, 128):
    add("short", f"gemm-N{n}", examples.gemm_chain(2, 512, n, 64, 64, dtype=dtype))
  for heads, d in ((16, 64), (8, 128)):
    add("short", f"att-N128-h{heads}-d{d}-captured", _captured_attention(128, heads, d, dtype))
  for d in (64, 128):
    add("short", f"gqa-N128-h16-kv4-d{d}", _captured_attention(128, 16, d, dtype, kv_heads=4))
  add("short", "gqa-N128-h16-kv4-d64-causal",
      _captured_attention(128, 16, 64, dtype, kv_heads=4, causal=True))
  for act in ("", "tanh"):
    add("short", f"mlp3-{act or 'none'}-64-128-64-32",
        examples.mlp_chain(1, 256, [64, 128, 64, 32], dtype=dtype, act=act))
  # Decoding steps: one query row per head, whose P.V is a broadcast product
  # the online softmax rescales (kept whole within
  # pruning.RESCALED_SUM_REGS_PER_THREAD), and grouped heads' few rows.
  add("decode", "dec-mha-S4096-d128", T.attention(M=1, N=4096, D=128, B=4, heads=32,
                                                  dtype=dtype, scale=128 ** -0.5))
  add("decode", "dec-mha-S1000-d64-mask", T.attention(M=1, N=1000, D=64, B=2, heads=8,
                                                      dtype=dtype, mask=True, scale=0.125))
  add("decode", "dec-gqa-h32-kv8-S4096-d128",
      _captured_attention(4096, 32, 128, dtype, kv_heads=8, queries=1, batch=8))
  # Small enough for Triton's interpreter (the check without a GPU).
  add("tiny", "tiny-gemm", T.gemm_chain(M=64, N=64, K=32, H=32, dtype="float32"))
  add("tiny", "tiny-mlp3", examples.mlp_chain(1, 32, [32, 64, 32, 16], dtype="float32", act="tanh"))
  add("tiny", "tiny-attention-causal", T.attention(M=32, N=48, D=16, heads=2, causal=True))
  groups["all"] = [n for n in regions if n not in groups["tiny"]]
  return regions, groups


def _captured_attention(t: int, heads: int, d: int, dtype: str, kv_heads: int = 0,
                        causal: bool = False, queries: int = 0, batch: int = 1):
  """The region capture makes of attention as a transformer layer writes it
  (token-major q, k, v; ``jax.nn.softmax``; with ``kv_heads``, grouped-query
  attention through ``jax.nn.dot_product_attention``, ``queries`` query
  tokens (default ``t``) over ``t`` keys): its ops and dtypes differ from the
  hand-built examples'."""
  import math  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture, ir  # pylint: disable=g-import-not-at-top

  def attn(q, k, v):
    q, k, v = (a.reshape(t, heads, d).transpose(1, 0, 2) for a in (q, k, v))
    return jax.nn.softmax(q @ k.transpose(0, 2, 1) / math.sqrt(d), -1) @ v

  def gqa(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
  if kv_heads:
    q = jax.ShapeDtypeStruct((batch, queries or t, heads, d), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((batch, t, kv_heads, d), jnp.dtype(dtype))
    [r] = capture.find_regions(jax.make_jaxpr(gqa)(q, kv, kv))
  else:
    x = jax.ShapeDtypeStruct((t, heads * d), jnp.dtype(dtype))
    [r] = capture.find_regions(jax.make_jaxpr(attn)(x, x, x))
  return ir.simplify(r.region)


def check_region(name: str, region, top: int, budget_s: float, gpu: bool) -> dict:
  """The region's best ``top`` plans, each compiled and self-checked: a row
  with each plan's status ('ok' or why not) and time (GPU only)."""
  from jaxfuse.planner import plan_region  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  res = plan_region(region, "h100" if not gpu else None, use_cache=False, top=top)
  plans = list(res.ranked[:top])
  row: dict = {"region": name, "einsum": region.einsum_summary(), "why_not": res.why_not,
               "plans": [], "wrong": 0}
  if gpu:
    errors: list = []
    times = launch.measure_plans(region, plans, budget_s=budget_s, errors=errors)
  else:
    errors, times = [], []
    for p in plans:
      try:
        launch.self_check(launch.generate(region, p, interpret=True), launch.run_interpreted)
        errors.append(None)
      except Exception as e:  # pylint: disable=broad-except  (refusals and wrong answers alike)
        errors.append(f"{type(e).__name__}: {e}")
      times.append(float("nan"))
  for p, e, t in zip(plans, errors, times):
    wrong = e is not None and "self-check failed" in e
    row["wrong"] += wrong
    row["plans"].append({"plan": str(p), "status": "ok" if e is None else e[:300],
                         "wrong": wrong, "time_s": float(t)})
  row["ok"] = sum(p["status"] == "ok" for p in row["plans"])
  row["check_s"] = time.perf_counter() - t0
  return row


def _in_child(name: str, prefix: str) -> dict:
  """``check_region`` for ``name`` in a fresh process; its row, or a row
  that says how the process ended."""
  row, why, _ = harness.run_in_child(__file__, name, prefix, "process_per_region",
                                     FLAGS.region_budget_s + 600)
  return row if row is not None else {"region": name, "error": why, "plans": [], "wrong": 0,
                                      "ok": 0}


def main(argv) -> int:
  del argv
  gpu = harness.on_gpu()
  prefix = FLAGS.out or harness.default_out("plan_check", FLAGS.dtype)
  regions, groups = check_regions(FLAGS.dtype)
  names = harness.select(regions, FLAGS.cases, groups)
  if not gpu:
    print("[plan_check] no GPU: the tiny regions' best plans run in Triton's interpreter "
          "against the IR evaluator (this checks the code generator, not the GPU backend).")
    names = [n for n in names if n in groups["tiny"]] or groups["tiny"]
  top = FLAGS.plans_per_region if gpu else min(FLAGS.plans_per_region, 3)
  rows = []
  for n in names:
    if gpu and FLAGS.process_per_region and len(names) > 1:
      row = _in_child(n, prefix)
    else:
      row = check_region(n, regions[n], top, FLAGS.region_budget_s, gpu)
    rows.append(row)
    print(f"[plan_check] {n}: {len(row['plans'])} plans, {row['ok']} ok, {row['wrong']} WRONG"
          f"{', ' + row['error'] if row.get('error') else ''}"
          f"{', no plan: ' + row['why_not'] if not row['plans'] and row.get('why_not') else ''}",
          flush=True)
    for p in row["plans"]:
      if p["status"] != "ok":
        print(f"[plan_check]   {'WRONG' if p['wrong'] else 'not run'}: {p['plan']}: "
              f"{p['status'][:160]}")
  wrong = sum(r["wrong"] for r in rows)
  died = [r["region"] for r in rows if r.get("error")]
  checked = sum(len(r["plans"]) for r in rows)
  meta = {"binary": "plan_check", "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "device": harness._device_kind(), "versions": harness.versions(),  # pylint: disable=protected-access
          "flags": {"dtype": FLAGS.dtype, "plans_per_region": top,
                    "region_budget_s": FLAGS.region_budget_s,
                    "process_per_region": FLAGS.process_per_region, "gpu": gpu}}
  os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  print(f"[plan_check] {len(rows)} regions, {checked} plans, "
        f"{sum(r['ok'] for r in rows)} ok, {wrong} wrong"
        f"{', processes died: ' + ', '.join(died) if died else ''}; wrote {prefix}.json")
  return 1 if wrong or died else 0


if __name__ == "__main__":
  app.run(main)
