"""Model fidelity: the planner's predicted time against measured time.

For MCFuser's Fig. 11 cases (GEMM chains G1-G4 of Table II) and attention
S1-S3 (Table III), this captures the case's region, asks the planner for its
ranked candidates (``jaxfuse.planner.plan_region``), measures at least 50 of
them on the GPU (``--sample``: by default the model's top 8 plus the rest
spread evenly along the predicted ranking of every legal plan the search
evaluated, as MCFuser's Fig. 11 does; ``--sample=top`` measures only the
best N, which tests discrimination among near-ties), and reports:

* Pearson and Spearman correlation between predicted and measured time
  (MCFuser reports 0.80-0.92; the target is Spearman >= 0.85);
* regret of the model-only choice: measured time of the model's first
  candidate over the best measured, minus one (target < 15%), and the same
  for the best of the model's top 8 (MCFuser Alg. 1's measured step).

Measuring (``--measure``): ``codegen`` uses the code generator's
``jaxfuse.runtime.launch.measure_plans`` (CUDA-event timing, kernels that
fail their self-check score inf); ``profiler`` launches each plan through
``jaxfuse.runtime.launch.fused_call`` in ``jax.jit``, checks it against the
IR evaluator and takes the profiler's kernel time; ``auto`` picks codegen's
when it imports. Candidates that fail are reported and left out of the
statistics. With several cases each runs in its own process (``--isolate``):
a kernel fault poisons the CUDA context for the rest of a process.

Without a GPU there is nothing to measure: the binary says so, does a tiny
dry run (plans a small chain and runs a few candidates through Triton's
interpreter against the IR evaluator) and exits 0.

Example::

    python -m benchmarks.model_fidelity --plot
    python benchmarks/model_fidelity.py --cases=G1,S1 --candidates=80
    python -m benchmarks.model_fidelity --rescore=/tmp/fid.G4.json   # CPU: re-rank a saved run
    python -m benchmarks.model_fidelity --rescore='benchmarks/results/s52/fidelity/*.G?.json'
"""

from __future__ import annotations

import datetime
import glob
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import jax
import numpy as np

from benchmarks import harness

harness.define_flags(default_cases="G1,G2,G3,G4,S1,S2,S3")
flags.DEFINE_integer("candidates", 64, "Ranked candidates to ask the planner for "
                     "(top=...); at least 50 are wanted per case.")
flags.DEFINE_enum("measure", "auto", ["auto", "codegen", "profiler"],
                  "How candidates are timed (see the module docstring).")
flags.DEFINE_float("budget_s", 900.0, "Measuring budget per case (seconds) for "
                   "the code generator's measuring function.")
flags.DEFINE_enum("sample", "spread", ["spread", "top"],
                  "Which planned candidates are measured: 'top' = the model's best "
                  "--candidates; 'spread' = the model's best 8 plus the rest taken "
                  "evenly along the predicted ranking of every legal plan the search "
                  "evaluated (MCFuser Fig. 11 plots scheduled candidates across the "
                  "space, not only the best).")
flags.DEFINE_bool("isolate", True, "On a GPU with several cases, measure each case in "
                  "a fresh process (a kernel that faults leaves the CUDA context "
                  "unusable for every later case in the same process).")

flags.DEFINE_list("rescore", [], "JSON files written by earlier runs of this binary (or "
                  "glob patterns of them): re-rank their measured candidates with the "
                  "current cost model (no GPU needed) and print the same statistics, "
                  "per sample and summed up. The sample stays the one the earlier "
                  "model drew.")

FLAGS = flags.FLAGS

MIN_CANDIDATES = 50
HEAD = 8   # the model's top-n that MCFuser Alg. 1 measures; always in the sample


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
  """Average ranks (ties share their mean rank), as Spearman needs."""
  order = np.argsort(x, kind="mergesort")
  ranks = np.empty(len(x), dtype=np.float64)
  xs = x[order]
  i = 0
  while i < len(x):
    j = i
    while j + 1 < len(x) and xs[j + 1] == xs[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2.0
    i = j + 1
  return ranks


def pearson(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
    return None
  return float(np.corrcoef(a, b)[0, 1])


def spearman(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if len(a) < 3:
    return None
  return pearson(_ranks(a), _ranks(b))


def fidelity_stats(predicted: Sequence[float], measured: Sequence[float],
                   best_s: Optional[float] = None) -> dict:
  """Correlations over the finite pairs; regret of the model's picks.

  ``predicted``/``measured`` are in the planner's ranked order (best
  predicted first). The model-only choice is the first candidate; when it
  failed to run, jaxfuse would fall back to the next, so the regret is that
  of the first candidate that ran (and ``top1_failed`` says so). ``best_s``:
  the best time measured in the whole sample when that includes plans left
  out of the ranking (default: the best of ``measured``).
  """
  pairs = [(p, m) for p, m in zip(predicted, measured)
           if p is not None and m is not None and math.isfinite(p) and math.isfinite(m)]
  out: dict[str, Any] = {"candidates": len(predicted), "measured_ok": len(pairs)}
  if not pairs:
    return out
  p, m = zip(*pairs)
  out["pearson"] = pearson(p, m)
  out["spearman"] = spearman(p, m)
  out["pearson_log"] = pearson(np.log(p), np.log(m))
  best = min(m) if best_s is None else min(best_s, min(m))
  out["best_measured_s"] = best
  ok = [x for x in measured if x is not None and math.isfinite(x)]
  first = next(x for x in measured if x is not None and math.isfinite(x))
  out["top1_failed"] = not (measured[0] is not None and math.isfinite(measured[0]))
  out["model_pick_s"] = first
  out["regret_top1"] = first / best - 1.0
  top8 = [x for x in measured[:8] if x is not None and math.isfinite(x)]
  if top8:
    out["regret_top8"] = min(top8) / best - 1.0
  out["best_rank"] = int(np.argmin([x if x is not None and math.isfinite(x) else np.inf
                                    for x in measured]))
  del ok
  return out


def sample_indices(n_ranked: int, n: int, how: str, head: int = HEAD) -> list[int]:
  """Indices into a ranked list (best predicted first) of the candidates to
  measure, ascending. ``top``: the first ``n``. ``spread``: the first
  ``head`` and the rest evenly spaced over the remaining ranks, last included,
  so the sample covers the model's whole range, not only its near-ties."""
  if how not in ("top", "spread"):
    raise ValueError(f"sample must be 'top' or 'spread', got {how!r}")
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  if n >= n_ranked or how == "top":
    return list(range(min(n, n_ranked)))
  head = min(head, n)
  rest = n - head
  if rest == 0:
    return list(range(head))
  picks = np.linspace(head, n_ranked - 1, rest)
  out = list(range(head))
  for x in picks:
    i = int(round(x))
    while i in out and i < n_ranked - 1:   # rounding collisions: next free rank
      i += 1
    if i not in out:
      out.append(i)
  return sorted(out)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def fidelity_cases(dtype: str) -> dict[str, harness.Case]:
  from benchmarks import attention, gemm_chain, mlp_chain  # pylint: disable=g-import-not-at-top
  cases = {}
  for g, (b, m, n, k, h) in gemm_chain.MCFUSER.items():
    cases[g] = gemm_chain.make_case(g, b, m, n, k, h, dtype=dtype, group="MCFuser Table II")
  for s, (h, m, n, dk, dv, _) in attention.MCFUSER.items():
    cases[s] = attention.make_case(s, 1, h, m, n, dk, dv, causal=False, layout="bhtd",
                                   group="MCFuser Table III", dtype=dtype)
  # The large attention cases (not run by default: their candidates take
  # minutes to compile and time).
  for t in (2048, 4096):
    for d in (64, 128):
      name = f"L-T{t}-d{d}"
      cases[name] = attention.make_case(name, 8, 16, t, t, d, d, causal=False, layout="bhtd",
                                        group="large", dtype=dtype)
  # Causal attention (not run by default): the code generator skips the key
  # tiles the mask hides, so programs differ in length and the model prices
  # the tiles each runs (``cost_model.masked_trip_fractions``).
  for s in ("S1", "S3", "S7"):
    h, m, n, dk, dv, _ = attention.MCFUSER[s]
    cases[f"{s}-causal"] = attention.make_case(f"{s}-causal", 1, h, m, n, dk, dv, causal=True,
                                               layout="bhtd", group="MCFuser Table III causal",
                                               dtype=dtype)
  for name in ("L-T2048-d64", "L-T2048-d128"):
    b, h, t, d = attention.LARGE[name]
    cases[f"{name}-causal"] = attention.make_case(f"{name}-causal", b, h, t, t, d, d,
                                                  causal=True, layout="bhtd",
                                                  group="large causal", dtype=dtype)
  b, h, kv, t, d = attention.GROUPED["GQA-T2048-h32-kv8"]
  cases["GQA-T2048-h32-kv8-causal"] = attention.make_case(
      "GQA-T2048-h32-kv8-causal", b, h, t, t, d, d, causal=True, layout="bhtd", kv_heads=kv,
      group="grouped-query causal", dtype=dtype)
  # Causal sliding windows (not run by default): each query tile runs only
  # the key tiles its window spans, priced the same way.
  for name, (b, h, kv, t, d, w) in attention.WINDOWED.items():
    cases[name] = attention.make_case(name, b, h, t, t, d, d, causal=True, layout="bhtd",
                                      kv_heads=kv, window=w, group="sliding window",
                                      dtype=dtype)
  # Decoding steps (one query token against a key/value cache): plans
  # split the key loop across programs. Not run by default.
  for name, (b, h, kv, n, d) in attention.DECODE.items():
    cases[name] = attention.make_case(name, b, h, 1, n, d, d, causal=False, layout="bthd",
                                      kv_heads=kv, group="decode", dtype=dtype)
  # A GEMM with its bias and tanh-GELU at decode-like token counts, the first
  # part of an FFN that XLA leaves whole (``mlp_chain``): a weight-streaming
  # region, unlike the chains above. Not run by default.
  for model, d in mlp_chain.MODELS.items():
    for m in (8, 32):
      cases[f"E-{model}-M{m}"] = epilogue_case(f"E-{model}-M{m}", m, d, 4 * d, dtype)
  # One-row GEMMs (a decoding step's projections at batch 1): every plan is
  # a broadcast product whose loads Triton does not pipeline
  # (``cost_model.is_unpipelined``). Not run by default.
  for k, n in ONE_ROW_SHAPES:
    cases[f"V-{k}x{n}"] = one_row_case(f"V-{k}x{n}", k, n, dtype)
  # A gated MLP's gate/up part at one token: two one-row products share the
  # k loop (and ``pruning.deferred_sums``' register cap). Not run by default.
  for model, (d, f) in mlp_chain.GATED_MODELS.items():
    cases[f"VG-{d}x{f}"] = one_row_case(f"VG-{d}x{f}", d, f, dtype, gated=True)
  # The GEMM chains with a tanh-GELU between the GEMMs (``gemm_chain
  # --epilogue=gelu``): plans that recompute the first GEMM per output tile
  # recompute its GELU too, so these rank the elementwise ops' price. Not
  # run by default.
  for g in ("G8", "G9", "G10", "G11", "G12"):
    b, m, n, k, h = gemm_chain.MCFUSER[g]
    c = gemm_chain.make_case(g, b, m, n, k, h, epilogue="gelu", dtype=dtype,
                             group="MCFuser Table II + GELU")
    cases[c.name] = c
  chimera = gemm_chain.all_cases("gelu", dtype)[0]
  for g in ("CH-G11", "CH-G12"):
    cases[chimera[g].name] = chimera[g]   # named CH-G11+gelu
  return cases


# (K, N) of one-row GEMMs: BERT-Base's and BERT-Large's FFN, Qwen2-0.5B's
# down projection and its transpose, LLaMA-2-7B's up and down projections.
ONE_ROW_SHAPES = ((768, 3072), (3072, 768), (1024, 4096), (4096, 1024), (4864, 896),
                  (896, 4864), (4096, 11008), (11008, 4096))


def one_row_case(name: str, k: int, n: int, dtype: str, gated: bool = False) -> harness.Case:
  """``x @ w`` with x [1, k], w [k, n] (weights scaled by 1/sqrt(k)); with
  ``gated``, ``silu(x @ wg) * (x @ wu)``, a gated MLP's gate/up part."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  mats = 2 if gated else 1

  def fn(x, *ws):
    return jax.nn.silu(x @ ws[0]) * (x @ ws[1]) if gated else x @ ws[0]

  def make_inputs(key, dt):
    ks = jax.random.split(key, 1 + mats)
    return (harness.normal(ks[0], (1, k), dt),) + tuple(
        harness.normal(kw, (k, n), dt, k ** -0.5) for kw in ks[1:])

  item = jnp.dtype(dtype).itemsize
  return harness.Case(name, fn, make_inputs, 2.0 * mats * k * n,
                      float(item * (k + mats * k * n + n)),
                      {"M": 1, "K": k, "N": n, **({"gated": True} if gated else {})},
                      group="one-row gated part" if gated else "one-row GEMM")


def epilogue_case(name: str, m: int, k: int, n: int, dtype: str) -> harness.Case:
  """``gelu(x @ w + b)`` (tanh form) with x [m, k], w [k, n]."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def fn(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=True)

  def make_inputs(key, dt):
    ks = jax.random.split(key, 3)
    return (harness.normal(ks[0], (m, k), dt), harness.normal(ks[1], (k, n), dt, k ** -0.5),
            harness.normal(ks[2], (n,), dt, 0.1))

  item = jnp.dtype(dtype).itemsize
  return harness.Case(name, fn, make_inputs, 2.0 * m * k * n,
                      float(item * (m * k + k * n + n + m * n)),
                      {"M": m, "K": k, "N": n, "act": "gelu_tanh", "bias": True},
                      group="GEMM epilogue")


def capture_region(case: harness.Case, dtype: str):
  """The case's (largest) captured region."""
  api = harness.jaxfuse_api()
  if api.find_regions is None:
    raise RuntimeError(f"jaxfuse.capture.find_regions unavailable: {api.errors}")
  args = case.make_inputs(jax.random.PRNGKey(0), dtype)
  caps = api.find_regions(jax.make_jaxpr(case.fn)(*args))
  if not caps:
    raise RuntimeError(f"no region captured in {case.name}")
  return max(caps, key=lambda c: len(c.region.contractions)).region


def region_numpy_inputs(region, seed: int = 7) -> list[np.ndarray]:
  try:
    from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
    return list(launch.random_inputs(region, seed=seed))
  except Exception:
    return [np.asarray(a) for a in harness.region_inputs(region, jax.random.PRNGKey(seed))]


def reference_outputs(region, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
  from jaxfuse import ir  # pylint: disable=g-import-not-at-top
  return [np.asarray(o, np.float64) for o in ir.evaluate(region, inputs, precision="float64")]


def measure_candidates(region, plans: Sequence[Any], how: str, budget_s: float,
                       backend: str = "triton") -> tuple[list[float], list[dict], str]:
  """Seconds per candidate (inf on failure), per-candidate details, method used."""
  if how in ("auto", "codegen") and backend == "triton":
    try:
      from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
      errors: list = []
      times = [float(t) for t in launch.measure_plans(region, list(plans), budget_s=budget_s,
                                                      errors=errors)]
      details = [{"status": "ok" if e is None else e} for e in errors]
      failed = [e for e in errors if e is not None]
      if failed:
        print(f"[model_fidelity] {len(failed)}/{len(plans)} candidates not measured; "
              f"first reason: {failed[0]}")
      return times, details, "jaxfuse.runtime.launch.measure_plans"
    except Exception as e:
      if how == "codegen":
        raise
      print(f"[model_fidelity] codegen measure unavailable ({type(e).__name__}: {e}); "
            "using the profiler")
  inputs = region_numpy_inputs(region)
  refs = reference_outputs(region, inputs)
  dev_inputs = [jax.device_put(x) for x in inputs]
  times, details = [], []
  t_end = time.perf_counter() + budget_s
  for p in plans:
    if time.perf_counter() > t_end:
      times.append(math.inf)
      details.append({"status": "budget exhausted"})
      continue
    try:
      d = harness.measure_plan(region, p, dev_inputs, refs, backend=backend, iters=10)
      d["status"] = "ok"
      tol = 2e-3 if backend == "triton" else 5e-3
      try:
        from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
        tol = launch.tolerance(region)
      except Exception:
        pass
      if not d.get("max_err", math.inf) <= tol:
        d["status"] = f"wrong answer (max err {d.get('max_err'):.2e} > {tol:.1e})"
        times.append(math.inf)
      else:
        times.append(float(d["time_s"]))
      details.append(d)
    except Exception as e:
      times.append(math.inf)
      details.append({"status": f"error: {type(e).__name__}: {str(e)[:200]}"})
  return times, details, f"harness profiler ({backend})"


def run_case(name: str, case: harness.Case, dtype: str, top: int, how: str,
             budget_s: float, backend: str = "triton", sample: str = "top") -> dict:
  api = harness.jaxfuse_api()
  row: dict[str, Any] = {"case": name, "params": case.params, "dtype": dtype}
  region = capture_region(case, dtype)
  row["region"] = region.einsum_summary()
  row["loops"] = region.loop_extents
  t0 = time.perf_counter()
  res = api.plan_region(region, top=top if sample == "top" else 10**9, use_cache=False)
  row["plan_time_s"] = float(getattr(res, "plan_time_s", time.perf_counter() - t0))
  row["space"] = {str(k): (v if isinstance(v, (int, float, str)) else str(v))
                  for k, v in dict(getattr(res, "space", {}) or {}).items()}
  ranked = list(res.ranked)
  idx = sample_indices(len(ranked), top, sample) if ranked else []
  plans = [ranked[i] for i in idx]
  row["sample"] = sample
  row["ranked_total"] = len(ranked)
  row["why_not"] = res.why_not
  if len(plans) < MIN_CANDIDATES:
    row["note"] = f"planner returned {len(plans)} < {MIN_CANDIDATES} candidates"
  predicted = [float(p.predicted.time_s) if p.predicted is not None else None for p in plans]
  t0 = time.perf_counter()
  measured, details, method = measure_candidates(region, plans, how, budget_s, backend)
  row["measure_s"] = time.perf_counter() - t0
  row["method"] = method
  def model_terms(p) -> dict:
    pr = p.predicted
    if pr is None:
      return {}
    # The model's terms and the plan's knobs, for calibrating the model offline.
    return {"t_mem_s": pr.t_mem_s, "t_comp_s": pr.t_comp_s, "alpha": pr.alpha,
            "programs": pr.programs, "tiles": dict(p.tiles), "grid": list(p.grid),
            "num_warps": p.num_warps, "num_stages": p.num_stages}
  row["candidates"] = [
      {"rank": idx[i], "plan": str(p), "predicted_s": predicted[i], "measured_s": measured[i],
       **model_terms(p), **{k: v for k, v in details[i].items() if k != "plan"}}
      for i, p in enumerate(plans)]
  row["stats"] = fidelity_stats(predicted, measured)
  return row


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

def _f(x, fmt="{:.3f}"):
  return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
  lines = ["| case | region | candidates | measured ok | Pearson | Spearman | "
           "regret top-1 | regret top-8 | best µs | model pick µs | plan s |",
           "|" + " --- |" * 11]
  for r in rows:
    s = r.get("stats", {})
    lines.append(
        f"| {r['case']} | {r.get('region', '-')} | {s.get('candidates', 0)} | "
        f"{s.get('measured_ok', 0)} | {_f(s.get('pearson'))} | {_f(s.get('spearman'))} | "
        f"{_f(None if s.get('regret_top1') is None else 100 * s['regret_top1'], '{:.1f}%')} | "
        f"{_f(None if s.get('regret_top8') is None else 100 * s['regret_top8'], '{:.1f}%')} | "
        f"{_f(None if s.get('best_measured_s') is None else s['best_measured_s'] * 1e6, '{:.2f}')} | "
        f"{_f(None if s.get('model_pick_s') is None else s['model_pick_s'] * 1e6, '{:.2f}')} | "
        f"{_f(r.get('plan_time_s'), '{:.2f}')} |")
  return "\n".join(lines)


def write(prefix: str, meta: dict, rows: list[dict]) -> list[str]:
  import csv  # pylint: disable=g-import-not-at-top
  os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
  with open(prefix + ".json", "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
  with open(prefix + ".csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["case", "rank", "predicted_s", "measured_s", "status", "plan"])
    for r in rows:
      for c in r.get("candidates", []):
        w.writerow([r["case"], c["rank"], c["predicted_s"], c["measured_s"],
                    c.get("status", ""), c["plan"]])
  return [prefix + ".json", prefix + ".csv"]


def plot(prefix: str, rows: list[dict]) -> str:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = [r for r in rows if r.get("candidates")]
  n = max(1, len(rows))
  cols = min(4, n)
  fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4 * cols, 3.6 * ((n + cols - 1) // cols)),
                           squeeze=False)
  for ax, r in zip(axes.flat, rows):
    pts = [(c["predicted_s"], c["measured_s"]) for c in r["candidates"]
           if c["predicted_s"] and c["measured_s"] and math.isfinite(c["measured_s"])]
    if pts:
      p, m = zip(*pts)
      ax.scatter(np.array(p) * 1e6, np.array(m) * 1e6, s=12, alpha=0.7)
      c0 = r["candidates"][0]
      if c0["measured_s"] and math.isfinite(c0["measured_s"]):
        ax.scatter([c0["predicted_s"] * 1e6], [c0["measured_s"] * 1e6], s=50,
                   facecolors="none", edgecolors="r", label="model's pick")
        ax.legend(fontsize=7)
      ax.set_xscale("log"); ax.set_yscale("log")
    s = r["stats"]
    ax.set_title(f"{r['case']}: Spearman {_f(s.get('spearman'), '{:.2f}')}, "
                 f"regret {_f(None if s.get('regret_top1') is None else 100 * s['regret_top1'], '{:.0f}%')}",
                 fontsize=9)
    ax.set_xlabel("predicted µs"); ax.set_ylabel("measured µs")
    ax.grid(True, which="both", alpha=0.3)
  for ax in list(axes.flat)[len(rows):]:
    ax.axis("off")
  fig.tight_layout()
  path = prefix + "_fidelity.png"
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def dry_run(prefix: str) -> int:
  """No GPU: plan a tiny chain, run 3 candidates in Triton's interpreter."""
  api = harness.jaxfuse_api()
  print("[model_fidelity] model fidelity needs a GPU (jax backend is "
        f"{jax.default_backend()}): measured times on this machine mean nothing. "
        "Dry run only: a tiny GEMM chain, 3 planned candidates through Triton's "
        "interpreter, checked against the IR evaluator.")
  print(f"[model_fidelity] {harness.jaxfuse_path_note()}")
  if api.plan_region is None or api.find_regions is None:
    print(f"[model_fidelity] dry run skipped: planner/capture unavailable ({api.errors})")
    return 0
  from benchmarks import gemm_chain  # pylint: disable=g-import-not-at-top
  case = gemm_chain.make_case("tiny", 1, 32, 32, 16, 16, dtype="float32")
  try:
    row = run_case("tiny", case, "float32", top=3, how="profiler", budget_s=120.0,
                   backend="interpret")
  except Exception as e:
    print(f"[model_fidelity] dry run failed: {type(e).__name__}: {e}")
    traceback.print_exc()
    return 0
  for c in row["candidates"]:
    print(f"[model_fidelity]   candidate {c['rank']}: {c.get('status')} "
          f"max err {_f(c.get('max_err'), '{:.1e}')}  predicted "
          f"{_f(None if c['predicted_s'] is None else c['predicted_s'] * 1e6, '{:.2f}')} µs  {c['plan']}")
  files = write(prefix, {"dry_run": True, "device": harness._device_kind()}, [row])  # pylint: disable=protected-access
  print(f"[model_fidelity] dry run done ({row['stats'].get('measured_ok', 0)}/"
        f"{row['stats'].get('candidates', 0)} candidates ran); wrote {', '.join(files)}")
  return 0


def run_case_in_child(case: str, prefix: str) -> dict:
  """``run_case`` in a fresh process; its row, or an error row."""
  row, why, out = harness.run_in_child(__file__, case, prefix, "isolate", FLAGS.budget_s + 900)
  for line in out.splitlines():
    if line.startswith("[model_fidelity]") and "summary" not in line and "wrote" not in line:
      print("  " + line)
  return row if row is not None else {"case": case, "error": why, "stats": {}}


def _device_of(meta: dict):
  from jaxfuse.devices import get_device  # pylint: disable=g-import-not-at-top
  kind = str(meta.get("device") or "")
  try:
    return get_device(kind.split(":", 1)[-1]) if kind else get_device("h100")
  except ValueError:
    return get_device("h100")


def rescore_rows(paths: Sequence[str], dtype: str) -> list[dict]:
  """The candidates measured in ``paths`` (this binary's JSON, one case per
  row), predicted again by the current model and ranked by it: the
  statistics of ``fidelity_stats`` as if the current model had ranked that
  sample. A row whose case is unknown or whose JSON lacks candidates is
  reported with an ``error``."""
  from jaxfuse.planner import search, tiling  # pylint: disable=g-import-not-at-top
  from jaxfuse.planner.plan import parse_plan  # pylint: disable=g-import-not-at-top
  cases = fidelity_cases(dtype)
  out = []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    dev = _device_of(data.get("meta") or {})
    for row in data.get("rows") or []:
      name = row.get("case")
      res: dict[str, Any] = {"case": name, "source": path, "device": dev.name, "stats": {},
                             "region": row.get("region", "-")}
      out.append(res)
      cands = [c for c in row.get("candidates") or []
               if c.get("measured_s") is not None and math.isfinite(float(c["measured_s"]))]
      if name not in cases or not cands:
        res["error"] = "unknown case" if name not in cases else "no measured candidates"
        continue
      region = capture_region(cases[name], row.get("dtype") or dtype)
      scored = []
      rejected = []
      try:
        for c in cands:
          p = parse_plan(c["plan"], region.loop_extents)
          try:
            # The current planner would not rank a plan its rules now reject.
            search.check_tiles(region, dict(p.tiles), dev)
          except tiling.PlacementError as e:
            rejected.append({"plan": c["plan"], "measured_s": float(c["measured_s"]),
                             "reason": str(e)})
            continue
          t = search.predict_plan(region, p, dev).time_s
          scored.append((t, float(c["measured_s"]), c["plan"]))
      except Exception as e:  # pylint: disable=broad-except
        # A sample from before capture changed the case's region (its loops
        # or values): its plans no longer place on the region captured now.
        res["error"] = (f"saved plan {c['plan']!r} does not fit the region captured now "
                        f"(loops {dict(region.loop_extents)}): {type(e).__name__}: {e}")
        continue
      scored.sort(key=lambda x: (x[0], x[2]))
      # Regret against the best of the whole sample, rejected plans too: a
      # rule that drops the fastest plan shows as regret.
      res["stats"] = fidelity_stats(
          [x[0] for x in scored], [x[1] for x in scored],
          best_s=min([r["measured_s"] for r in rejected], default=None))
      res["rejected"] = rejected
      res["candidates"] = [{"rank": i, "plan": pl, "predicted_s": t, "measured_s": m}
                           for i, (t, m, pl) in enumerate(scored)]
      res["plan_time_s"] = row.get("plan_time_s")
  return out


def rescore_paths(entries: Sequence[str]) -> list[str]:
  """``--rescore``'s entries as files: a glob pattern is expanded (sorted),
  a file named twice is read once. A pattern or name that matches no file
  raises ``ValueError`` naming the flag."""
  out: list[str] = []
  for entry in entries:
    hits = sorted(glob.glob(entry)) if glob.has_magic(entry) else (
        [entry] if os.path.isfile(entry) else [])
    if not hits:
      raise ValueError(f"--rescore: no file matches {entry!r}")
    out += [h for h in hits if h not in out]
  return out


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
  """Statistics over every sample (row) with a measured ranking: Spearman's
  mean and lowest, Pearson's mean, top-1 regret's mean and largest (with
  its case), and how many samples meet the issue's targets (Spearman >=
  0.85 and regret < 15%)."""
  ok = [r for r in rows if not r.get("error") and r.get("stats", {}).get("spearman") is not None
        and r["stats"].get("regret_top1") is not None]
  summary: dict[str, Any] = {"samples": len(ok)}
  if not ok:
    return summary
  sp = [r["stats"]["spearman"] for r in ok]
  rg = [r["stats"]["regret_top1"] for r in ok]
  pe = [r["stats"]["pearson"] for r in ok if r["stats"].get("pearson") is not None]
  worst = max(ok, key=lambda r: r["stats"]["regret_top1"])
  summary.update(mean_spearman=float(np.mean(sp)), min_spearman=float(np.min(sp)),
                 mean_regret_top1=float(np.mean(rg)), max_regret_top1=float(np.max(rg)),
                 worst_case=worst["case"],
                 at_target=sum(1 for a, b in zip(sp, rg) if a >= 0.85 and b < 0.15))
  if pe:
    summary["mean_pearson"] = float(np.mean(pe))
  return summary


def main(argv) -> int:
  del argv
  prefix = FLAGS.out or harness.default_out("model_fidelity", FLAGS.dtype)
  if FLAGS.rescore:
    from jaxfuse.planner import search  # pylint: disable=g-import-not-at-top
    rows = rescore_rows(rescore_paths(FLAGS.rescore), FLAGS.dtype)
    print(table(rows))
    for r in rows:
      if r.get("error"):
        print(f"[model_fidelity] {r['source']}: {r['case']}: {r['error']}")
      elif r.get("rejected"):
        reasons = sorted({search.rejection_kind(x["reason"]) for x in r["rejected"]})
        print(f"[model_fidelity] {r['case']}: {len(r['rejected'])} saved plans left out, "
              f"the current planner rejects them: {'; '.join(reasons)}")
    print(f"[model_fidelity] summary: {json.dumps(summarize(rows))} (targets: Spearman >= "
          "0.85, regret < 15%)")
    return 0
  if not harness.on_gpu():
    return dry_run(prefix)
  api = harness.jaxfuse_api()
  if api.plan_region is None:
    print(f"[model_fidelity] jaxfuse.planner.plan_region unavailable: {api.errors}")
    return 1
  cases = fidelity_cases(FLAGS.dtype)
  names = harness.select(cases, FLAGS.cases)
  top = max(FLAGS.candidates, MIN_CANDIDATES)
  print(f"[model_fidelity] device {harness._device_kind()}, dtype {FLAGS.dtype}, "  # pylint: disable=protected-access
        f"{top} candidates per case, sample={FLAGS.sample}")
  rows = []
  for n in names:
    t0 = time.perf_counter()
    if FLAGS.isolate and len(names) > 1:
      row = run_case_in_child(n, prefix)
    else:
      try:
        row = run_case(n, cases[n], FLAGS.dtype, top, FLAGS.measure, FLAGS.budget_s,
                       sample=FLAGS.sample)
      except Exception as e:
        row = {"case": n, "error": f"{type(e).__name__}: {e}", "stats": {}}
        traceback.print_exc()
    s = row.get("stats", {})
    print(f"[model_fidelity] {n}: {s.get('measured_ok', 0)}/{s.get('candidates', 0)} "
          f"measured, Spearman {_f(s.get('spearman'))}, regret "
          f"{_f(None if s.get('regret_top1') is None else 100 * s['regret_top1'], '{:.1f}%')} "
          f"({time.perf_counter() - t0:.0f}s){' ' + row['note'] if row.get('note') else ''}"
          f"{' ERROR ' + row['error'] if row.get('error') else ''}")
    rows.append(row)
  print()
  print(table(rows))
  summary = summarize(rows)
  print(f"[model_fidelity] summary: {json.dumps(summary)} (targets: Spearman >= 0.85, "
        "regret < 15%)")
  meta = {"binary": "model_fidelity", "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "device": harness._device_kind(), "versions": harness.versions(),  # pylint: disable=protected-access
          "flags": {"dtype": FLAGS.dtype, "candidates": top, "measure": FLAGS.measure,
                    "budget_s": FLAGS.budget_s, "sample": FLAGS.sample,
                    "isolate": FLAGS.isolate}, "summary": summary}
  files = write(prefix, meta, rows)
  if FLAGS.plot and rows:
    files.append(plot(prefix, rows))
  print(f"[model_fidelity] wrote {', '.join(files)}")
  return 0


if __name__ == "__main__":
  app.run(main)
