"""The benchmark binaries run on the CPU (tiny cases, --reps=1) and say so.

Each binary runs in a subprocess, once as ``python -m benchmarks.<name>`` or
``python benchmarks/<name>.py``; the test checks the exit code, that the
JSON/CSV (and PNG where asked) outputs exist, that every measured
implementation passed the reference check, and that the binary says jaxfuse
ran its fallback path on the CPU. Harness pieces (trace parsing, errors,
fidelity statistics) are checked directly on synthetic data.
"""

from __future__ import annotations

import gzip
import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)


def _run(args: list[str], tmp_path, timeout: int = 240) -> str:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["JAXFUSE_CACHE_DIR"] = str(tmp_path / "cache")
  env.pop("JAXFUSE_BACKEND", None)
  env.pop("JAXFUSE_DISABLE", None)
  p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=timeout)
  out = p.stdout + p.stderr
  assert p.returncode == 0, out[-4000:]
  return out


def _check_outputs(prefix, out: str, *, plots: bool = False, must_run=("jaxfuse", "xla")):
  assert "fallback path" in out, out[-3000:]
  assert os.path.exists(str(prefix) + ".csv")
  with open(str(prefix) + ".json") as f:
    data = json.load(f)
  assert data["rows"], data
  assert "fallback path" in data["meta"]["jaxfuse_path"]
  for row in data["rows"]:
    assert row["flops"] > 0 and row["bytes"] > 0 and row["floor_s"] > 0
    for name in must_run:
      res = row["impls"][name]
      assert res["status"] == "ok", (row["case"], name, res)
      assert res["correct"] is True, (row["case"], name, res)
      assert res["rel_err"] < 5e-3
      assert "per_call_s" in res
      assert res["call_outputs"] == data["meta"]["settings"]["call_outputs"]
    assert "jaxfuse" in row["impls"]["jaxfuse"]   # jaxfuse details recorded
  if plots:
    assert os.path.getsize(str(prefix) + "_roofline.png") > 1000
    assert os.path.getsize(str(prefix) + "_speedup.png") > 1000
  return data


def test_gemm_chain_cpu(tmp_path):
  prefix = tmp_path / "gc"
  out = _run(["-m", "benchmarks.gemm_chain", "--shapes=1x64x32x16x16", "--reps=1",
              f"--out={prefix}", "--plot"], tmp_path)
  data = _check_outputs(prefix, out, plots=True)
  row = data["rows"][0]
  assert row["params"] == {"batch": 1, "M": 64, "N": 32, "K": 16, "H": 16, "epilogue": "none"}
  assert row["flops"] == 2 * 64 * 32 * (16 + 16)
  assert row["impls"]["torch"]["status"].startswith("skipped")


def test_interrupted_run_keeps_finished_cases(tmp_path, monkeypatch):
  """The outputs are written after every case: a run killed part-way (a
  device time limit) leaves the finished cases, marked partial."""
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  cases = [gemm_chain.make_case(n, 1, 32, 32, 16, 16, dtype="float32") for n in ("a", "b")]
  real = harness.run_case

  def run_case(case, *args, **kwargs):
    if case.name == "b":
      raise KeyboardInterrupt
    return real(case, *args, **kwargs)
  monkeypatch.setattr(harness, "run_case", run_case)
  prefix = str(tmp_path / "part")
  settings = harness.Settings(dtype="float32", reps=1, profile="off")
  with pytest.raises(KeyboardInterrupt):
    harness.main("gemm_chain", cases, gemm_chain.impls_for, settings, out=prefix,
                 do_plot=False, baselines="xla")
  with open(prefix + ".json") as f:
    data = json.load(f)
  assert [r["case"] for r in data["rows"]] == ["a"]
  assert data["meta"]["partial"] == "1 of 2 cases"
  assert data["rows"][0]["impls"]["xla"]["status"] == "ok"


def test_slope_windows_last_min_window_ms(monkeypatch):
  """--min_window_ms reaches the slope method: every timed program repeats
  until its window lasts that long."""
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
  seen = []
  real = timing.slopes

  def slopes(*args, **kwargs):
    seen.append(kwargs["min_window_s"])
    return real(*args, **kwargs)
  monkeypatch.setattr(timing, "slopes", slopes)
  case = gemm_chain.make_case("w", 1, 32, 32, 16, 16, dtype="float32")
  roof = harness.get_roof("float32")
  for ms in (50.0, 7.0):
    seen.clear()
    settings = harness.Settings(dtype="float32", reps=1, profile="off", min_window_ms=ms,
                                details=False)
    harness.run_case(case, [harness.xla_impl(case.fn)], settings, roof)
    assert seen == [ms * 1e-3]
  assert harness.Settings().min_window_ms == 50.0


def test_jax_programs_on_the_case_inputs_are_timed_interleaved(monkeypatch):
  """--slope_order=interleaved: jax.jit and jaxfuse.jit are timed in one
  interleaved slope after the loop; a program on another layout is timed
  alone; 'sequential' (the default) times each alone, in turn."""
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
  groups = []
  real = timing.slopes

  def slopes(runs, blocks, **kwargs):
    groups.append(len(runs))
    # A fixed time: the CPU's slopes of microsecond calls may read < 0.
    return [{**r, "per_call_s": 1e-3} for r in real(runs, blocks, **kwargs)]
  monkeypatch.setattr(timing, "slopes", slopes)
  case = gemm_chain.make_case("w", 1, 32, 32, 16, 16, dtype="float32")
  roof = harness.get_roof("float32")
  copied = harness.JaxImpl("xla-copied", case.fn, prepare=lambda *a: [x + 0 for x in a])
  impls = [harness.jaxfuse_impl(case.fn), harness.xla_impl(case.fn), copied]
  for order, want_groups, want in (("interleaved", [1, 2], ["interleaved"] * 2 + ["alone"]),
                                   ("sequential", [1, 1, 1], ["alone"] * 3)):
    groups.clear()
    settings = harness.Settings(dtype="float32", reps=2, profile="off", min_window_ms=1.0,
                                details=False, slope_order=order)
    row = harness.run_case(case, impls, settings, roof)
    assert groups == want_groups, order
    res = [row["impls"][i.name] for i in impls]
    assert [r["slope_order"] for r in res] == want
    for r in res:
      assert r["status"] == "ok" and r["correct"] and r["per_call_s"] == 1e-3, r
      # Derived from the time taken after the loop, too.
      assert r["per_call_tflops"] == pytest.approx(case.flops / 1e-3 / 1e12)
  assert harness.Settings().slope_order == "sequential"


def test_a_failed_interleaved_timing_times_each_program_alone(monkeypatch):
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import timing  # pylint: disable=g-import-not-at-top
  real = timing.slopes

  def slopes(runs, blocks, **kwargs):
    if len(runs) > 1:
      raise RuntimeError("out of memory")
    return real(runs, blocks, **kwargs)
  monkeypatch.setattr(timing, "slopes", slopes)
  case = gemm_chain.make_case("w", 1, 32, 32, 16, 16, dtype="float32")
  settings = harness.Settings(dtype="float32", reps=1, profile="off", min_window_ms=1.0,
                              details=False, slope_order="interleaved")
  row = harness.run_case(case, [harness.jaxfuse_impl(case.fn), harness.xla_impl(case.fn)],
                         settings, harness.get_roof("float32"))
  for r in row["impls"].values():
    assert r["status"] == "ok" and r["slope_order"] == "alone" and "per_call_s" in r


def test_stacked_slope_inputs_pass_one_array_per_input():
  """--slope_inputs=stacked: the K-call program takes one array per input
  holding every set and call i reads x[i]; its outputs equal the separate
  programs' call for call, jaxfuse reads the layers as windows in place,
  and the row records the mode."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  case = gemm_chain.make_case("w", 1, 32, 32, 16, 16, dtype="float32")
  sets = [case.make_inputs(jax.random.key(i), "float32") for i in range(4)]
  impl = harness.xla_impl(case.fn)
  want = impl.build()(sets[:3])
  got = impl.build_stacked(harness.stack_sets(sets), consumed=False)(sets[:3])
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  stacked = [np.stack([np.asarray(s[j]) for s in sets]) for j in range(len(sets[0]))]
  jx = jaxfuse.fused_jaxpr(lambda *st: [case.fn(*(a[i] for a in st)) for i in range(2)])(*stacked)
  assert [e.primitive.name for e in jx.jaxpr.eqns] == ["jaxfuse_region"] * 2
  roof = harness.get_roof("float32")
  settings = harness.Settings(dtype="float32", reps=1, profile="off", min_window_ms=1.0,
                              details=False, slope_inputs="stacked")
  row = harness.run_case(case, [harness.jaxfuse_impl(case.fn), impl], settings, roof)
  for name in ("jaxfuse", "xla"):
    res = row["impls"][name]
    assert res["status"] == "ok" and res["correct"], res
    assert res["slope_inputs"] == "stacked"
  assert harness.Settings().slope_inputs == "separate"


def test_gemm_chain_cpu_outputs_returned(tmp_path):
  prefix = tmp_path / "gr"
  out = _run(["-m", "benchmarks.gemm_chain", "--shapes=1x64x32x16x16", "--reps=1",
              "--baselines=xla", "--call_outputs=returned", f"--out={prefix}"], tmp_path)
  data = _check_outputs(prefix, out)
  assert data["rows"][0]["impls"]["xla"]["call_outputs"] == "returned"


def test_check_consumed_compares_samples_with_returned_outputs():
  from benchmarks import harness
  out = [(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([5.0])), (np.array([[7.0, 0.0]]), np.array([9.0]))]
  harness.check_consumed(np.array([1.0, 5.0, 7.0, 9.0]), out, tol=2e-3)
  harness.check_consumed(np.array([1.001, 5.0, 7.0, 9.0]), out, tol=2e-3)  # fp16 rounding
  with pytest.raises(AssertionError, match="differ"):
    harness.check_consumed(np.array([1.0, 5.0, 0.0, 9.0]), out, tol=2e-3)
  with pytest.raises(AssertionError, match="differ"):
    harness.check_consumed(np.array([1.0, 5.0]), out, tol=2e-3)


def test_attention_cpu_script(tmp_path):
  prefix = tmp_path / "at"
  out = _run(["benchmarks/attention.py", "--shapes=1x2x32x48x16c", "--reps=1",
              "--dtype=float32", f"--out={prefix}"], tmp_path)
  data = _check_outputs(prefix, out, must_run=("jaxfuse", "xla", "dpa-xla", "jaxfuse-dpa"))
  row = data["rows"][0]
  assert row["params"]["causal"] is True
  # jaxfuse-dpa reports the regions of its own function (the library call in
  # [B, T, N, H]), not the plain function's.
  dpa_jf = row["impls"]["jaxfuse-dpa"]["jaxfuse"]
  assert dpa_jf["regions"] == 1, dpa_jf
  plain_jf = row["impls"]["jaxfuse"]["jaxfuse"]
  assert dpa_jf["inspect"][0]["einsum"] != plain_jf["inspect"][0]["einsum"]
  for name in ("dpa-cudnn", "pallas"):
    assert row["impls"][name]["status"].startswith("skipped"), row["impls"][name]


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_train_step_cpu_script(tmp_path, layout):
  """--step=train: the loss and q, k, v gradients, checked against float32
  for every implementation, the FlashAttention-2-style backward and
  jaxfuse.jit of jax.nn.dot_product_attention's step included."""
  prefix = tmp_path / "tr"
  out = _run(["benchmarks/attention.py", "--step=train", "--shapes=1x2x32x32x16c",
              f"--layout={layout}", "--reps=1", "--dtype=float32", f"--out={prefix}"],
             tmp_path)
  data = _check_outputs(prefix, out, must_run=("jaxfuse", "xla", "jaxfuse-flash",
                                               "xla-flash", "dpa-xla", "jaxfuse-dpa"))
  row = data["rows"][0]
  assert row["case"] == "B1-H2-M32-N32-D16-causal-train"
  assert row["params"]["step"] == "train" and row["params"]["causal"] is True
  for name in ("dpa-cudnn", "pallas"):
    assert row["impls"][name]["status"].startswith("skipped"), row["impls"][name]


def test_attention_train_step_regions_and_errors():
  """The FlashAttention-2-style backward is three regions (the forward with
  rowsum(do * o), dq, and dk with dv from one recomputation: capture merges
  the two, ``jaxfuse.ir_merge``), and its Triton kernels compute the step in
  float16 as the plain function's gradients; cases that are not plain
  self-attention are refused."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases("bthd", "float16", "1x2x64x64x32c", step="train")
  assert groups["mcfuser"] == [f"S{i}-train" for i in range(1, 7)]
  case = cases["B1-H2-M64-N64-D32-causal-train"]
  args = case.make_inputs(jax.random.key(1), "float16")
  flash = next(i for i in attention.impls_for(case) if i.name == "jaxfuse-flash").fn
  regions = capture.find_regions(jax.make_jaxpr(flash)(*args))
  assert [len(r.region.contractions) for r in regions] == [3, 3, 4]
  assert [len(r.region.outputs) for r in regions][1:] == [1, 2]
  ref = jax.jit(case.fn)(*[a.astype(jnp.float32) for a in args])
  with config.override(backend="interpret"):
    got = jaxfuse.jit(flash)(*args)
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    err = float(jnp.linalg.norm((g.astype(jnp.float32) - r).ravel()) / jnp.linalg.norm(r.ravel()))
    assert err < 2e-3, err
  with pytest.raises(ValueError, match="--step=train"):
    attention.make_case("x", 1, 4, 32, 32, 16, 16, causal=False, layout="bthd", group="g",
                        dtype="float16", kv_heads=2, step="train")
  with pytest.raises(ValueError, match="--step=train takes"):
    attention.all_cases("packed", "float16", step="train")


def test_a_causal_recomputing_backward_skips_masked_tiles():
  """Under a causal mask the backward's probabilities ``exp(where(keep, s,
  -inf) - m) / l`` and ``ds = p * (dp - D)`` are zero outside the band: dq's
  key loop stops at the diagonal, and dk's and dv's query loops start
  there (``streaming.zero_outside``); kernels with 32-wide tiles of 128
  tokens compute each region."""
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture, codegen, ir, planner  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  cases, _ = attention.all_cases("bthd", "float16", "1x2x128x128x32c", step="train")
  case = cases["B1-H2-M128-N128-D32-causal-train"]
  args = jax.eval_shape(lambda: case.make_inputs(jax.random.key(1), "float16"))
  flash = next(i for i in attention.impls_for(case) if i.name == "jaxfuse-flash").fn
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  with config.override(merge=False):   # each backward product on its own
    regions = [ir.simplify(r.region)
               for r in capture.find_regions(jax.make_jaxpr(flash)(*args))]
  bands = [streaming.masked_tile_relations(r) for r in regions]
  assert [(b["n"].lower, b["n"].upper) for b in bands] == [(None, 0), (None, 0), (0, None), (0, None)]
  for reg, band in zip(regions, bands):
    res = planner.plan_region(reg, "h100", top=300, use_cache=False)
    plan = next(p for p in res.ranked if dict(p.tiles)["n"] == 32 and dict(p.tiles)["m"] == 32
                and not p.split)
    k = codegen.generate(reg, plan, interpret=True)
    xs = launch.random_inputs(reg, seed=1)
    outs = launch.run_interpreted(k, xs)
    assert launch.compare(reg, outs, ir.evaluate(reg, xs)) <= launch.tolerance(reg), str(plan)
  # Without the mask nothing is skipped.
  cases, _ = attention.all_cases("bthd", "float16", "1x2x128x128x32", step="train")
  case = cases["B1-H2-M128-N128-D32-train"]
  flash = next(i for i in attention.impls_for(case) if i.name == "jaxfuse-flash").fn
  for r in capture.find_regions(jax.make_jaxpr(flash)(*args)):
    assert streaming.masked_tile_relations(ir.simplify(r.region)) == {}


def test_attention_packed_layout_reads_one_qkv_array():
  """--layout=packed: the plain function takes a fused QKV projection's
  output and splits it; jaxfuse reads the three windows in place, and the
  baselines get q, k and v split before timing."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention, harness  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases("packed", "float32", "1x2x32x32x16")
  assert groups["mcfuser"] == ["S1", "S2", "S3", "S4", "S5", "S6"]   # S7-S9: M != N
  case = cases["B1-H2-M32-N32-D16"]
  (qkv,) = case.make_inputs(jax.random.key(0), "float32")
  assert qkv.shape == (1, 32, 3 * 2 * 16)
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(case.fn)(qkv).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  want = jax.jit(case.fn)(qkv)
  dpa = next(i for i in attention.impls_for(case) if i.name == "dpa-xla")
  got = dpa.build()([dpa.prepare((qkv,))])
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="--layout=packed"):
    attention.all_cases("packed", "float32", "1x2x32x48x16")


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_grouped_query_cases_match_dot_product_attention(layout):
  """Grouped-query cases: the plain function (query heads folded into a
  group axis per key/value head) computes what
  ``jax.nn.dot_product_attention`` does with fewer key/value heads, is one
  jaxfuse region, and pallas (no grouped heads) is skipped with a reason."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases(layout, "float32", "1x4x32x48x16c", kv_heads=2)
  assert groups["gqa"] == list(attention.GROUPED)
  assert cases["GQA-T2048-h32-kv8"].params["kv_heads"] == 8
  case = cases["B1-H4-KV2-M32-N48-D16-causal"]
  q, k, v = case.make_inputs(jax.random.key(0), "float32")
  assert q.shape[2 if layout == "bthd" else 1] == 4 and k.shape[2 if layout == "bthd" else 1] == 2
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(case.fn)(q, k, v).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  want = jax.jit(case.fn)(q, k, v)
  impls = {i.name: i for i in attention.impls_for(case)}
  dpa = impls["dpa-xla"]
  [got] = dpa.per_call_numpy(dpa.build()([dpa.prepare((q, k, v))]), [0])[0]
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  assert "key/value heads" in attention._pallas_check(grouped=True)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="--kv_heads"):
    attention.all_cases(layout, "float32", "1x4x32x48x16", kv_heads=3)


def test_attention_decode_cases_are_one_query_token_against_a_cache():
  """The decode group: one query token per sequence against a long key/value
  cache, grouped heads where kv < heads, no causal variant (the new token
  sees every cached key); a small decoding step through the same builder is
  what ``jax.nn.dot_product_attention`` computes."""
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases("bthd", "float32")
  assert groups["decode"] == list(attention.DECODE)
  assert not any(n.startswith("DEC") for n in groups["causal"])
  p = cases["DEC-B8-S4096-h32-kv8"].params
  assert (p["batch"], p["M"], p["N"], p["heads"], p["kv_heads"], p["causal"]) == (8, 1, 4096, 32, 8, False)
  assert "DEC-B1-S4096-h32-kv8" not in attention.all_cases("packed", "float32")[0]
  case = attention.make_case("dec", 2, 4, 1, 40, 16, 16, causal=False, layout="bthd",
                             group="decode", dtype="float32", kv_heads=2)
  q, k, v = case.make_inputs(jax.random.key(1), "float32")
  assert q.shape == (2, 1, 4, 16) and k.shape == (2, 40, 2, 16)
  want = jax.nn.dot_product_attention(q, k, v)
  np.testing.assert_allclose(np.asarray(jax.jit(case.fn)(q, k, v)), np.asarray(want),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_window_cases_match_dot_product_attention(kv_heads):
  """The window group: causal sliding-window cases whose plain function
  computes what ``jax.nn.dot_product_attention(local_window_size=(w, 0),
  is_causal=True)`` does; jaxfuse fuses it into one region whose key loop
  keeps the window's band (tiles outside it are skipped); the baselines
  without a window (pallas, torch) are skipped with a reason."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  from jaxfuse.codegen import streaming  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases("bthd", "float32")
  assert groups["window"] == list(attention.WINDOWED)
  p = cases["SWA-T4096-w512-h32-kv8"].params
  assert (p["window"], p["causal"], p["kv_heads"]) == (512, True, 8)
  assert attention.causal_pairs(6, 6, 2) == 1 + 2 + 3 + 3 + 3 + 3
  case = attention.make_case("w", 2, 4, 48, 48, 16, 16, causal=True, layout="bthd",
                             group="window", dtype="float32", kv_heads=kv_heads, window=5)
  q, k, v = case.make_inputs(jax.random.key(2), "float32")
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(5, 0))
  np.testing.assert_allclose(np.asarray(jax.jit(case.fn)(q, k, v)), np.asarray(want),
                             rtol=1e-5, atol=1e-5)
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(case.fn)(q, k, v).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  [cap] = capture.find_regions(jax.make_jaxpr(case.fn)(q, k, v))
  bands = streaming.masked_tile_relations(cap.region)
  assert [(b.lower, b.upper) for b in bands.values()] == [(-5, 0)]
  assert "window" in attention._pallas_check(False, 5)   # pylint: disable=protected-access
  assert "window" in attention._torch_backend_check("FLASH_ATTENTION", 5)()  # pylint: disable=protected-access


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_attention_padded_cases_match_dot_product_attention_with_lengths(layout):
  """The padded group: each sequence of the batch has its own length (an
  int32 input); the plain function masks the keys past it and zeroes the
  result's rows past it, which is what ``jax.nn.dot_product_attention``
  computes with ``query_seq_lengths`` and ``key_value_seq_lengths``, the
  call the library baselines make. jaxfuse fuses it into one region (the
  row mask on the result is the kernel's epilogue), and the baselines that
  take no lengths are skipped with a reason."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases(layout, "float32")
  assert groups["padded"] == list(attention.PADDED)
  assert attention.sequence_lengths(4, 40) == [10, 20, 30, 40]
  full = cases["PAD-B8-T512-h12-d64"]
  assert full.params["padded"] and full.flops < 2 * 8 * 12 * 512 * 512 * 128
  case = attention.make_case("pad", 4, 2, 40, 40, 16, 16, causal=False, layout=layout,
                             group="padded", dtype="float32", padded=True)
  q, k, v, lengths = case.make_inputs(jax.random.key(3), "float32")
  assert lengths.dtype == np.int32 and list(lengths) == [10, 20, 30, 40]
  want = jax.jit(case.fn)(q, k, v, lengths)
  t_axis = 2 if layout == "bhtd" else 1
  assert not np.asarray(jax.numpy.take(want, np.arange(10, 40), axis=t_axis)[0]).any()
  impls = {i.name: i for i in attention.impls_for(case)}
  dpa = impls["dpa-xla"]
  [got] = dpa.per_call_numpy(dpa.build()([dpa.prepare((q, k, v, lengths))]), [0])[0]
  np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(case.fn)(q, k, v, lengths).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  for name in ("pallas", "torch-flash", "torch-cudnn"):
    assert "sequence lengths" in impls[name]._check(), name   # pylint: disable=protected-access
  with pytest.raises(ValueError, match="padded"):
    attention.make_case("p", 1, 2, 32, 48, 16, 16, causal=False, layout=layout,
                        group="padded", dtype="float32", padded=True)


def test_attention_softcap_and_d256_cases():
  """The softcap group: Gemma 2's causal grouped attention with scores
  capped as ``cap * tanh(s / cap)`` (the plain function computes what
  ``dot_product_attention`` does on capped scores; every library baseline
  is skipped with a reason, since none takes the cap); jaxfuse fuses it
  into one region, which runs in Triton's interpreter and matches
  ``jax.jit``. The d256 group: head dimension 256, causal and not."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jaxfuse  # pylint: disable=g-import-not-at-top
  from benchmarks import attention  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  cases, groups = attention.all_cases("bthd", "float32")
  assert groups["softcap"] == list(attention.GEMMA2)
  assert groups["d256"] == ["D256-T4096-h16-kv8", "D256-T4096-h16-kv8-causal"]
  p = cases["GEMMA2-27B-T4096"].params
  assert (p["softcap"], p["kv_heads"], p["K"], p["causal"]) == (50.0, 16, 128, True)
  assert p["scale"] == pytest.approx(144 ** -0.5)
  local = cases["GEMMA2-9B-T8192-local"].params
  assert (local["window"], local["softcap"], local["K"]) == (4096, 50.0, 256)
  assert cases["D256-T4096-h16-kv8"].params["softcap"] == 0.0
  case = attention.make_case("cap", 1, 4, 40, 40, 32, 32, causal=True, layout="bthd",
                             group="softcap", dtype="float32", kv_heads=2, softcap=2.0)
  q, k, v = case.make_inputs(jax.random.key(3), "float32")
  kk, vv = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * case.params["scale"]
  s = jnp.where(jnp.tril(jnp.ones((40, 40), bool)), 2.0 * jnp.tanh(s / 2.0), -jnp.inf)
  want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), vv)
  np.testing.assert_allclose(np.asarray(jax.jit(case.fn)(q, k, v)), np.asarray(want),
                             rtol=1e-5, atol=1e-5)
  impls = {i.name: i for i in attention.impls_for(case)}
  for name in ("dpa-cudnn", "dpa-xla", "jaxfuse-dpa", "pallas", "torch-flash", "torch-cudnn"):
    assert "score cap" in impls[name]._check(), name   # pylint: disable=protected-access
  assert impls["xla"].unavailable() is None and impls["jaxfuse"].unavailable() is None
  prims = [e.primitive.name for e in jaxfuse.fused_jaxpr(case.fn)(q, k, v).jaxpr.eqns]
  assert prims == ["jaxfuse_region"]
  with config.override(backend="interpret", device="h100", tune="model"):
    got = jaxfuse.jit(case.fn)(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def test_mlp_chain_cpu(tmp_path):
  prefix = tmp_path / "mlp"
  out = _run(["-m", "benchmarks.mlp_chain", "--shapes=4x32x64x32x16", "--reps=1",
              f"--out={prefix}"], tmp_path)
  _check_outputs(prefix, out)


def test_mlp_chain_packed_cases_are_the_gated_ones_with_one_weight():
  import jax  # pylint: disable=g-import-not-at-top
  from benchmarks import mlp_chain  # pylint: disable=g-import-not-at-top
  from jaxfuse import capture  # pylint: disable=g-import-not-at-top
  cases, groups = mlp_chain.all_cases(("gelu", "relu"), True, "float32")
  assert groups["packed"] == [f"{m}-packed-M{t}" for m in mlp_chain.GATED_MODELS
                              for t in mlp_chain.TOKENS]
  gated, packed = cases["qwen2-0.5b-M8"], cases["qwen2-0.5b-packed-M8"]
  key = jax.random.PRNGKey(0)
  x, wg, wu, wd = gated.make_inputs(key, "float32")
  xp, wgu, wdp = packed.make_inputs(key, "float32")
  assert wgu.shape == (896, 2 * 4864)
  np.testing.assert_allclose(np.asarray(packed.fn(xp, wgu, wdp)),
                             np.asarray(gated.fn(x, wg, wu, wd)), rtol=1e-4, atol=1e-4)
  assert (packed.flops, packed.nbytes) == (gated.flops, gated.nbytes)
  [r] = capture.find_regions(jax.make_jaxpr(packed.fn)(xp, wgu, wdp))
  assert len(r.region.contractions) == 3


def test_bert_cpu(tmp_path):
  # --nojaxfuse_details: the planner takes minutes on BERT's LayerNorm+FFN
  # region today; planning is covered by the other binaries.
  prefix = tmp_path / "bert"
  out = _run(["benchmarks/bert.py", "--cases=tiny", "--reps=1", "--nojaxfuse_details",
              f"--out={prefix}"], tmp_path)
  data = _check_outputs(prefix, out)
  assert data["rows"][0]["params"]["layers"] == 2


def test_bert_cpu_training_step(tmp_path):
  # --step=train: the loss and its gradient with respect to every weight,
  # checked against float32 like the forward pass.
  prefix = tmp_path / "bert_train"
  out = _run(["benchmarks/bert.py", "--cases=tiny", "--reps=1", "--nojaxfuse_details",
              "--step=train", f"--out={prefix}"], tmp_path)
  data = _check_outputs(prefix, out)
  [row] = data["rows"]
  assert row["case"] == "tiny-train" and row["params"]["step"] == "train"
  assert "tiny-train" in out


def test_bert_train_case_is_the_forward_differentiated():
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import bert   # pylint: disable=import-outside-toplevel
  fwd = bert.make_case("t", bert.TINY, 1, 16, "float32", "g")
  train = bert.make_case("t", bert.TINY, 1, 16, "float32", "g", step="train")
  assert train.name == "t-train" and train.flops == 3 * fwd.flops
  x, params, g = train.make_inputs(jax.random.key(0), "float32")
  loss, grads = train.fn(x, params, g)
  want = jax.grad(lambda p: jnp.sum(fwd.fn(x, p) * g))(params)
  np.testing.assert_allclose(float(loss), float(jnp.sum(fwd.fn(x, params) * g)), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="step"):
    bert.make_case("t", bert.TINY, 1, 16, "float32", "g", step="backward")


def test_bert_train_step_takes_its_softmax_in_float32():
  # In float16 the softmax's backward cancels: BERT-Base's gradients from
  # jax.jit itself were 2.4 away from float32's (see make_train_step).
  import jax   # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp   # pylint: disable=import-outside-toplevel
  from benchmarks import bert   # pylint: disable=import-outside-toplevel
  train = bert.make_case("t", bert.TINY, 1, 16, "float16", "g", step="train")
  fwd = bert.make_case("t", bert.TINY, 1, 16, "float16", "g")

  def max_dtypes(fn, args):
    text = str(jax.make_jaxpr(fn)(*args))
    return {line.split(":")[1].split("[")[0] for line in text.splitlines() if "reduce_max" in line}

  args = train.make_inputs(jax.random.key(0), "float16")
  assert max_dtypes(train.fn, args) == {"f32"}
  assert max_dtypes(fwd.fn, args[:2]) == {"f16"}
  assert args[0].dtype == jnp.float16


def test_judge_errors_marks_rows_the_reference_cannot_check():
  from benchmarks import harness
  tol = harness.TOLERANCE["float16"]
  impls = {"jaxfuse": {"rel_err": 3e-3}, "xla": {"rel_err": 1.6e-3}, "other": {"status": "x"}}
  harness.judge_errors(impls, tol)   # within 2x of XLA's own error
  assert impls["jaxfuse"]["correct"] is True and impls["xla"]["correct"] is True
  assert "correct" not in impls["other"]
  impls = {"jaxfuse": {"rel_err": 5e-3}, "xla": {"rel_err": 1e-3}}
  harness.judge_errors(impls, tol)
  assert impls["jaxfuse"]["correct"] is False
  # XLA itself far off float32: no implementation is vouched for.
  impls = {"jaxfuse": {"rel_err": 2.1}, "xla": {"rel_err": 2.07}}
  harness.judge_errors(impls, tol)
  assert impls["jaxfuse"]["correct"] is None and "cannot tell" in impls["xla"]["unchecked"]
  row = {"case": "c", "floor_s": 1e-3, "jaxfuse_speedup": {}, "impls": impls}
  assert "UNCHECKED" in harness.markdown_table([row])
  assert harness.summarize([row])["unchecked"] == ["c/jaxfuse", "c/xla"]


def test_judge_errors_checks_each_output_leaf_against_xlas():
  from benchmarks import harness
  tol = harness.TOLERANCE["float16"]
  names = ["[0]", "[1]['w']", "[1]['bk']"]
  # Normwise over all leaves both pass; jaxfuse's small second leaf is 40x
  # off float32 where XLA's is right. The third leaf is rounding noise in
  # both (XLA's own error over 10 tolerances): unchecked, not a mismatch.
  impls = {"jaxfuse": {"rel_err": 1e-3, "leaf_err": [1e-3, 8e-2, 900.0]},
           "xla": {"rel_err": 1e-3, "leaf_err": [1e-3, 2e-3, 1500.0]}}
  harness.judge_errors(impls, tol, names)
  jf, xla = impls["jaxfuse"], impls["xla"]
  assert jf["correct"] is False and xla["correct"] is True
  assert "[1]['w'] 8.0e-02 (XLA 2.0e-03)" in jf["leaf_mismatch"]
  assert "1 unchecked" in jf["leaf_check"] and "worst [1]['w']" in jf["leaf_check"]
  assert "20.00 of its bound" in jf["leaf_check"]
  assert "leaf_err" not in jf and "leaf_err" not in xla   # summarized, not written out
  row = {"case": "c", "floor_s": 1e-3, "jaxfuse_speedup": {}, "impls": impls}
  summary = harness.summarize([row])
  assert summary["mismatches"] == ["c/jaxfuse"]
  assert summary["leaf_mismatches"] == [f"c/jaxfuse: {jf['leaf_mismatch']}"]
  # Within 2x of XLA's error on every leaf it checks: correct.
  impls = {"jaxfuse": {"rel_err": 1e-3, "leaf_err": [1e-3, 3.9e-3, 5.0]},
           "xla": {"rel_err": 1e-3, "leaf_err": [1e-3, 2e-3, 1500.0]}}
  harness.judge_errors(impls, tol, names)
  assert impls["jaxfuse"]["correct"] is True and "leaf_mismatch" not in impls["jaxfuse"]
  # A leaf XLA's own error puts over the tolerance (ill-conditioned) passes
  # within NOISY_LEAF_FACTOR times XLA's error, and fails beyond it.
  for got, ok in ((2.2e-2, True), (4.1e-2, False)):
    impls = {"jaxfuse": {"rel_err": 1e-3, "leaf_err": [1e-3, got, 5.0]},
             "xla": {"rel_err": 1e-3, "leaf_err": [1e-3, 1e-2, 1500.0]}}
    harness.judge_errors(impls, tol, names)
    assert impls["jaxfuse"]["correct"] is ok
  # No leaf errors from XLA: only the normwise check (noise leaves cannot be told).
  impls = {"jaxfuse": {"rel_err": 1e-3, "leaf_err": [1e-3, 8e-2, 900.0]}}
  harness.judge_errors(impls, tol, names)
  assert impls["jaxfuse"]["correct"] is True and "leaf_check" not in impls["jaxfuse"]


def test_leaf_errors_and_the_references_leaf_names():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from benchmarks import harness
  r = [np.ones(4), np.full(3, 2.0)]
  assert harness.leaf_errors([r[0], r[1] * 1.5], r) == [0.0, pytest.approx(0.5)]
  assert harness.leaf_errors(r[:1], r) == [math.inf, math.inf]
  fn = lambda x: (x.sum(), {"a": x, "b": [x * 2]})
  case = harness.Case("c", fn, None, 1.0, 1.0)
  x = np.arange(3, dtype=np.float32)
  leaves, _, names = harness.reference(case, (jnp.asarray(x, jnp.float16),))
  assert names == ["[0]", "[1]['a']", "[1]['b'][0]"]
  np.testing.assert_allclose(leaves[2], 2 * x)
  _, _, names = harness.reference(harness.Case("c", lambda x: x * 2, None, 1.0, 1.0), (x,))
  assert names == ["output"]


def test_model_fidelity_cpu_dry_run(tmp_path):
  prefix = tmp_path / "mf"
  out = _run(["-m", "benchmarks.model_fidelity", f"--out={prefix}"], tmp_path)
  assert "needs a GPU" in out
  assert "dry run" in out


def test_plan_check_cpu_runs_the_tiny_regions_in_the_interpreter(tmp_path):
  prefix = tmp_path / "pc"
  out = _run(["-m", "benchmarks.plan_check", "--cases=paper", f"--out={prefix}"], tmp_path)
  assert "no GPU" in out and "0 wrong" in out
  with open(str(prefix) + ".json") as f:
    rows = json.load(f)["rows"]
  assert [r["region"] for r in rows] == ["tiny-gemm", "tiny-mlp3", "tiny-attention-causal"]
  assert all(len(r["plans"]) == 3 and r["ok"] == 3 and r["wrong"] == 0 for r in rows)


def test_plan_check_counts_a_wrong_plan_and_fails(monkeypatch):
  """A plan whose self-check fails is counted wrong (the binary then exits
  1); the other plans of its region still run."""
  from benchmarks import plan_check
  from jaxfuse.runtime import launch
  regions, _ = plan_check.check_regions("float16")
  real, calls = launch.self_check, []

  def flaky(k, runner, seed=None):
    calls.append(k)
    if len(calls) == 2:
      raise launch.CodegenError(f"self-check failed: relative error 0.9 > 0.002 for plan {k.plan}")
    return real(k, runner, seed)
  monkeypatch.setattr(launch, "self_check", flaky)
  row = plan_check.check_region("tiny-gemm", regions["tiny-gemm"], 3, 60.0, gpu=False)
  assert row["wrong"] == 1 and row["ok"] == 2
  assert row["plans"][1]["wrong"] and "self-check failed" in row["plans"][1]["status"]


def test_plan_time_cpu(tmp_path):
  out = _run(["benchmarks/plan_time.py", "--filter=G1", "--set=all", "--repeat=1"], tmp_path)
  assert "| mcfuser/G1 |" in out and "| chimera/G1 |" in out and "grid(" in out
  assert "large/" not in out
  out = _run(["benchmarks/plan_time.py", "--filter=T2048-d64", "--set=large", "--repeat=1"],
             tmp_path)
  assert "| large/L-T2048-d64 | b=8,g=16,m=2048,n=2048,d=64,e=64 |" in out and "mcfuser" not in out
  # The training step's regions as capture finds them: the forward, dq,
  # and dk with dv merged (four contractions).
  out = _run(["benchmarks/plan_time.py", "--filter=train/L-T2048-d64/", "--set=train",
              "--repeat=1"], tmp_path)
  rows = [l for l in out.splitlines() if l.startswith("| train/L-T2048-d64/")]
  assert len(rows) == 3 and all("grid(" in l for l in rows) and "causal" not in out
  assert any(",h_1=64 |" in l for l in rows)   # the merged region's second head loop
  # One region of a step by its index.
  out = _run(["benchmarks/plan_time.py", "--filter=train/L-T2048-d64/0", "--set=train",
              "--repeat=1"], tmp_path)
  rows = [l for l in out.splitlines() if l.startswith("| train/")]
  assert len(rows) == 1 and rows[0].startswith("| train/L-T2048-d64/0 |")
  # Measured tuning needs the GPU, and says so instead of timing nothing.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAXFUSE_CACHE_DIR=str(tmp_path / "cache"))
  p = subprocess.run([sys.executable, "benchmarks/plan_time.py", "--tune=measure",
                      "--filter=mcfuser/G1"], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=240)
  assert p.returncode != 0
  assert "needs a CUDA GPU" in p.stdout + p.stderr


def test_plan_time_times_tuning_as_jaxfuse_jit_runs_it():
  """The measurer plan_time records through keeps what planner.plan_region
  reads from jaxfuse's: its budget's start and whether it times the other
  kernel forms (in a child: plan_time's flags would clash with other
  binaries' in this process)."""
  code = """
import benchmarks.plan_time as pt
def measure(plans):
  return [1e-3 * (i + 1) for i in range(len(plans))]
measure.begin = lambda: None
measure.kernel_forms = True
seen = {}
w = pt._recording(measure, seen)
assert w.begin is measure.begin and w.kernel_forms is True
assert w(["a", "b"]) == [1e-3, 2e-3] and seen == {"a": 1e-3, "b": 2e-3}
del measure.kernel_forms
assert pt._recording(measure, {}).kernel_forms is False
print("ok")
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_unknown_case_is_a_clear_error(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-m", "benchmarks.gemm_chain", "--cases=G99",
                      f"--out={tmp_path / 'x'}"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode != 0
  assert "--cases" in p.stderr and "G99" in p.stderr


# --------------------------------------------------------------------- harness

def _gpu_trace(tmp_path, events) -> str:
  """A perfetto trace file: a GPU process (pid 2) with a kernel stream
  (tid 10), plus ``events``; returns its path."""
  ev = [
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 10, "name": "thread_name", "args": {"name": "Stream #14(Kernel)"}},
  ] + list(events)
  path = str(tmp_path / "perfetto_trace.json.gz")
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": ev}, f)
  return path


def _kernel(name, ts, dur, tid=10, pid=2):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_parse_perfetto_counts_stream_kernels_only(tmp_path):
  from benchmarks import harness
  path = _gpu_trace(tmp_path, [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "tid": 11, "name": "thread_name", "args": {"name": "XLA Ops"}},
      _kernel("fused_kernel", 0, 3.0), _kernel("gemm", 5, 4.5), _kernel("MemcpyD2D", 9, 1.0),
      _kernel("dot.1", 0, 7.5, tid=11), _kernel("python", 0, 100.0, tid=5, pid=1),
  ])
  ks = harness.parse_perfetto(path)
  assert ks.count == 2 and ks.total_us == pytest.approx(7.5)
  assert ks.memcpy_us == pytest.approx(1.0)
  assert harness.parse_perfetto(path, device="/device:GPU:1") is None


def test_execution_spans_split_runs_and_keep_overlap(tmp_path):
  from benchmarks import harness
  # Two traced runs of a 3-kernel program: the second run's first two
  # kernels overlap; its span runs from 100 to 109.
  path = _gpu_trace(tmp_path, [
      _kernel("a", 0, 2.0), _kernel("b", 3, 2.0), _kernel("c", 6, 1.0),
      _kernel("c", 105, 4.0), _kernel("a", 100, 3.0), _kernel("b", 101, 3.0)])
  ks = harness.parse_perfetto(path, executions=2)
  assert ks.spans_us == [pytest.approx(7.0), pytest.approx(9.0)]
  assert ks.total_us == pytest.approx(15.0)
  # Runs that do not split evenly give no spans rather than wrong ones.
  assert harness.parse_perfetto(path, executions=4).spans_us == []
  assert harness.parse_perfetto(path).spans_us == []
  assert harness.execution_spans([], 1) == []


def test_speedups_and_summary_carry_device_call():
  from benchmarks import harness
  row = {"case": "G1", "impls": {
      "jaxfuse": {"per_call_s": 4e-6, "kernel_s": 2e-6, "device_call_s": 2.5e-6},
      "xla": {"per_call_s": 4.4e-6, "kernel_s": 5e-6, "device_call_s": 4e-6}}}
  harness._speedups(row)
  assert row["jaxfuse_speedup"]["xla"]["device_call"] == pytest.approx(1.6)
  g = harness.summarize([row])["geomean_speedup"]["xla"]
  assert g["device_call"] == pytest.approx(1.6) and g["device_call_cases"] == 1
  row["floor_s"] = 1e-6
  table = harness.markdown_table([row])
  assert "device µs/call" in table and "| 2.50 |" in table and "1.60x" in table


def test_the_path_note_says_how_kernels_are_launched_on_the_gpu(monkeypatch):
  from benchmarks import harness
  from jaxfuse.config import config
  from jaxfuse.runtime import direct_launch
  monkeypatch.setattr(harness, "on_gpu", lambda: True)
  monkeypatch.setattr(direct_launch, "records", lambda: True)
  with config.override(record=True, tune="auto"):
    assert "tune=auto, launch=direct, record=on)" in harness.jaxfuse_path_note()
    monkeypatch.setattr(direct_launch, "records", lambda: False)    # a jaxlib without the stage
    assert "record=off (this jaxlib cannot record launches)" in harness.jaxfuse_path_note()
  with config.override(record=False):
    assert "record=off)" in harness.jaxfuse_path_note()


def test_choose_calls_by_memory_and_floor(monkeypatch):
  from benchmarks import harness
  monkeypatch.setattr(harness, "on_gpu", lambda: True)
  st = harness.Settings(mem_budget_gb=1.0)
  assert harness.choose_calls(1 << 20, st) == 16                 # capped at 16
  assert harness.choose_calls(64 << 20, st) == 4                  # 4K sets fit 1 GiB
  assert harness.choose_calls(1 << 30, st) == 1
  assert harness.choose_calls(1 << 20, st, floor_s=2e-6) == 16
  assert harness.choose_calls(1 << 20, st, floor_s=122e-6) == 2   # BERT-Base b1
  assert harness.choose_calls(1 << 30, st, floor_s=122e-6) == 1
  assert harness.choose_calls(1 << 20, harness.Settings(calls=6), floor_s=1e-3) == 6
  monkeypatch.setattr(harness, "on_gpu", lambda: False)
  assert harness.choose_calls(1 << 20, st, floor_s=1e-3) == 2


def test_rel_error_and_select():
  from benchmarks import harness
  rng = np.random.default_rng(0)
  r = rng.normal(size=(8, 8))
  assert harness.rel_error([r], [r]) == (0.0, 0.0)
  e, m = harness.rel_error([r * 1.01], [r])
  assert e == pytest.approx(0.01) and m == pytest.approx(0.01)
  bad = r.copy()
  bad[0, 0] = np.nan
  assert harness.rel_error([bad], [r])[0] == math.inf
  assert harness.rel_error([r[:4]], [r])[0] == math.inf
  cases = {"G1": 1, "G2": 2, "S1": 3}
  assert harness.select(cases, "g2,all", {"gemm": ["G1", "G2"]}) == ["G2", "G1", "S1"]
  assert harness.select(cases, "gemm", {"gemm": ["G1", "G2"]}) == ["G1", "G2"]
  with pytest.raises(ValueError, match="--cases"):
    harness.select(cases, "nope")
  assert harness.geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_fidelity_stats():
  from benchmarks import model_fidelity as mf
  pred = [1.0, 2.0, 3.0, 4.0, 5.0]
  meas = [1.5, 2.5, 2.0, 4.5, math.inf]            # last candidate failed
  s = mf.fidelity_stats(pred, meas)
  assert s["measured_ok"] == 4 and s["candidates"] == 5
  assert s["spearman"] == pytest.approx(0.8)
  assert s["regret_top1"] == pytest.approx(0.0)
  s = mf.fidelity_stats([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
  assert s["spearman"] == pytest.approx(-1.0)
  assert s["regret_top1"] == pytest.approx(2.0) and s["best_rank"] == 2
  s = mf.fidelity_stats([1.0, 2.0, 3.0], [math.inf, 2.0, 4.0])
  assert s["top1_failed"] and s["regret_top1"] == pytest.approx(0.0)


def test_fidelity_sample_indices():
  from benchmarks import model_fidelity as mf
  assert mf.sample_indices(100, 10, "top") == list(range(10))
  s = mf.sample_indices(1000, 64, "spread")
  assert len(s) == 64 and s == sorted(set(s))
  assert s[:8] == list(range(8)) and s[-1] == 999      # model's top-n and the worst
  gaps = np.diff(s[8:])
  assert gaps.min() >= 17 and gaps.max() <= 19           # 991 ranks / 55 picks
  assert mf.sample_indices(30, 64, "spread") == list(range(30))
  s = mf.sample_indices(12, 11, "spread")                # rounding collisions resolved
  assert len(s) == 11 and len(set(s)) == 11 and max(s) < 12
  with pytest.raises(ValueError, match="sample"):
    mf.sample_indices(10, 5, "best")


def test_parse_shapes():
  from benchmarks import harness
  assert harness.parse_shapes("1x64x32x16x16, 2x8x8x8x8", "BxMxNxKxH") == [
      ((1, 64, 32, 16, 16), ""), ((2, 8, 8, 8, 8), "")]
  assert harness.parse_shapes("1x2x32x48x16c", "BxHxMxNxD", ("", "c")) == [
      ((1, 2, 32, 48, 16), "c")]
  for bad in ("1x2x3x4", "1x2x3x4x0", "1x2x3x4x5c", "axbxcxdxe"):
    with pytest.raises(ValueError, match="--shapes"):
      harness.parse_shapes(bad, "BxMxNxKxH")
  assert harness.parse_shapes("", "BxMxNxKxH") == []


def test_fidelity_rescore_reranks_a_saved_run(tmp_path):
  """--rescore re-predicts the measured candidates of a saved run with the
  current model (no GPU): the model's ranking decides the pick and the
  statistics; unknown cases and plans that no longer fit the case's region
  are reported, not fatal."""
  from benchmarks import model_fidelity as mf
  from jaxfuse.planner import plan_region
  region = mf.capture_region(mf.fidelity_cases("float16")["G1"], "float16")
  ranked = plan_region(region, "h200", use_cache=False, top=12).ranked
  assert len(ranked) >= 6
  # "measured": the model's second plan is the fastest; one plan failed
  meas = [p.predicted.time_s * (0.5 if i == 1 else 1.0) for i, p in enumerate(ranked)]
  meas[-1] = math.inf
  row = {"case": "G1", "dtype": "float16", "region": region.einsum_summary(),
         "candidates": [{"rank": i, "plan": str(p), "predicted_s": 1.0, "measured_s": m}
                        for i, (p, m) in enumerate(zip(reversed(ranked), reversed(meas)))]}
  # a plan saved before capture renamed the case's loops
  stale = str(ranked[0]).replace("grid(m", "grid(b,m").replace("tiles(m", "tiles(b=1, m")
  path = tmp_path / "fid.json"
  path.write_text(json.dumps({"meta": {"device": "gpu:NVIDIA H200"},
                              "rows": [row, {"case": "nope", "candidates": []},
                                       dict(row, candidates=[dict(row["candidates"][1],
                                                                  plan=stale)])]}))
  rows = mf.rescore_rows([str(path)], "float16")
  good, bad, old = rows
  assert bad["error"] == "unknown case"
  assert "does not fit the region captured now" in old["error"] and not old["stats"]
  s = good["stats"]
  assert good["device"] == "h200" and s["measured_ok"] == len(ranked) - 1
  # ranked by the current model again: its first plan is the pick, the
  # fastest (its second) gives the regret
  assert good["candidates"][0]["plan"] == str(ranked[0])
  p0, p1 = ranked[0].predicted.time_s, ranked[1].predicted.time_s
  assert s["best_measured_s"] == pytest.approx(0.5 * p1)
  assert s["regret_top1"] == pytest.approx(p0 / (0.5 * p1) - 1.0)
  assert s["spearman"] is not None and "| G1 |" in mf.table(rows)


def test_fidelity_rescore_takes_globs_and_sums_the_samples_up(tmp_path):
  """--rescore expands glob patterns (a file named twice is read once, a
  pattern matching nothing is an error naming the flag); ``summarize``
  gives the statistics over every ranked sample, errors left out."""
  from benchmarks import model_fidelity as mf
  for name in ("a.G1.json", "b.G2.json", "c.csv"):
    (tmp_path / name).write_text("{}")
  a, b = str(tmp_path / "a.G1.json"), str(tmp_path / "b.G2.json")
  assert mf.rescore_paths([str(tmp_path / "*.G?.json"), a]) == [a, b]
  for bad in ("*.S?.json", "missing.json"):
    with pytest.raises(ValueError, match="--rescore"):
      mf.rescore_paths([str(tmp_path / bad)])
  rows = [{"case": "G1", "stats": {"spearman": 0.90, "pearson": 0.95, "regret_top1": 0.02}},
          {"case": "G5", "stats": {"spearman": 0.88, "pearson": 0.90, "regret_top1": 0.21}},
          {"case": "S2", "stats": {"spearman": 0.80, "pearson": 0.85, "regret_top1": 0.0}},
          {"case": "x", "error": "unknown case", "stats": {}}]
  s = mf.summarize(rows)
  assert s["samples"] == 3 and s["worst_case"] == "G5" and s["at_target"] == 1
  assert s["max_regret_top1"] == 0.21 and s["min_spearman"] == 0.80
  assert s["mean_regret_top1"] == pytest.approx(0.23 / 3)
  assert s["mean_pearson"] == pytest.approx(0.9)
  assert mf.summarize(rows[3:]) == {"samples": 0}


def test_fidelity_rescore_leaves_out_plans_the_planner_now_rejects(tmp_path):
  """A saved plan that the current planner's rules reject (here 128x256
  causal scores, over the masked register budget even at 8 warps) is not
  ranked again; the
  regret still counts against the fastest plan of the whole sample, so a
  rule that drops the fastest plan shows."""
  from benchmarks import model_fidelity as mf
  from jaxfuse.planner import plan_region
  case = "L-T2048-d64-causal"
  region = mf.capture_region(mf.fidelity_cases("float16")[case], "float16")
  ranked = [p for p in plan_region(region, "h100", use_cache=False, top=12).ranked
            if p.tile("m") == 128 and p.tile("n") == 64]
  assert ranked
  kept = str(ranked[0])
  dropped = kept.replace("n=64,", "n=256,")
  assert dropped != kept
  row = {"case": case, "dtype": "float16", "candidates": [
      {"rank": 0, "plan": dropped, "predicted_s": 1.0, "measured_s": 2e-4},
      {"rank": 1, "plan": kept, "predicted_s": 1.0, "measured_s": 3e-4}]}
  path = tmp_path / "fid.json"
  path.write_text(json.dumps({"meta": {"device": "gpu:NVIDIA H100"}, "rows": [row]}))
  (got,) = mf.rescore_rows([str(path)], "float16")
  assert [c["plan"] for c in got["candidates"]] == [kept]
  assert [r["plan"] for r in got["rejected"]] == [dropped]
  assert "masked key tiles" in got["rejected"][0]["reason"]
  assert got["stats"]["best_measured_s"] == pytest.approx(2e-4)
  assert got["stats"]["regret_top1"] == pytest.approx(0.5)


def test_measured_runs_record_the_plans_jaxfuse_compiled(tmp_path):
  """Under --tune=measure a row also records ``plans_run``, read back from
  the plan cache that jaxfuse.jit's compile filled (on a CPU no tuning runs,
  so it is the model's plan)."""
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  case = gemm_chain.make_case("a", 1, 32, 32, 16, 16, dtype="float32")
  settings = harness.Settings(dtype="float32", reps=1, profile="off", tune="measure")
  prefix = str(tmp_path / "m")
  harness.main("gemm_chain", [case], gemm_chain.impls_for, settings, out=prefix,
               do_plot=False, baselines="xla")
  with open(prefix + ".json") as f:
    row = json.load(f)["rows"][0]
  info = row["impls"]["jaxfuse"]["jaxfuse"]
  assert info["plans_run"] and info["plans_run"] == info["plans"]


def test_rows_record_how_jaxfuse_lowered_each_region(tmp_path, monkeypatch):
  """``lowered`` says what ran for each region (a kernel's plan, or XLA's
  ops and why), and ``plans_run`` names XLA's ops for a region keep-or-drop
  left to XLA: the model's plan in ``plans`` never ran there."""
  from benchmarks import gemm_chain, harness  # pylint: disable=g-import-not-at-top
  from jaxfuse.config import config  # pylint: disable=g-import-not-at-top
  from jaxfuse.runtime import launch  # pylint: disable=g-import-not-at-top
  settings = harness.Settings(dtype="float32", reps=1, profile="off", tune="measure")

  def run(case):
    prefix = str(tmp_path / case.name)
    with config.override(backend="interpret"):
      harness.main("gemm_chain", [case], gemm_chain.impls_for, settings, out=prefix,
                   do_plot=False, baselines="xla")
    with open(prefix + ".json") as f:
      info = json.load(f)["rows"][0]["impls"]["jaxfuse"]["jaxfuse"]
    with open(prefix + ".csv") as f:
      return info, next(csv.DictReader(f))
  info, flat = run(gemm_chain.make_case("fused", 1, 48, 40, 16, 24, dtype="float32"))
  assert len(info["lowered"]) == 1 and info["lowered"][0].startswith("fused: grid(")
  assert info["plans_run"] == info["lowered"][0][len("fused: "):]
  assert flat["jaxfuse.lowered"] == info["lowered"][0]
  monkeypatch.setattr(launch, "_candidate_plans", lambda *a, **k: (_ for _ in ()).throw(
      launch.LeftToXLA("measured slower than XLA: fused 9.0 us vs XLA 7.0 us")))
  info, _ = run(gemm_chain.make_case("dropped", 1, 48, 40, 16, 8, dtype="float32"))
  assert info["lowered"] == ["XLA's ops: measured slower than XLA: fused 9.0 us vs XLA 7.0 us"]
  assert info["plans_run"] == "XLA's ops" != info["plans"]


def test_join_counted_names_each_text_once_with_its_count():
  # A model's layers repeat one region's why_not; the progress line and the
  # JSON say it once, with how many regions it stands for.
  from benchmarks import harness  # pylint: disable=g-import-not-at-top
  assert harness.join_counted(["a", "b", "a", "a"]) == "a (x3); b"
  assert harness.join_counted(x for x in ["b", "a"]) == "b; a"
  assert harness.join_counted([]) == ""


def test_run_in_child_returns_the_childs_row(tmp_path, monkeypatch):
  """The binaries' per-case child process (model_fidelity, plan_check):
  the child gets the parent's flags but --cases, --out and the isolate flag,
  and its first JSON row comes back; a child that writes nothing says why."""
  from benchmarks import harness
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("JAXFUSE_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(sys, "argv", ["plan_check.py", "--plans_per_region=2", "--cases=all",
                                    "--process_per_region"])
  script = os.path.join(REPO, "benchmarks", "plan_check.py")
  row, why, out = harness.run_in_child(script, "tiny-gemm", str(tmp_path / "pc"),
                                       "process_per_region", 240)
  assert why == "" and row["region"] == "tiny-gemm" and len(row["plans"]) == 2, out
  with open(str(tmp_path / "pc.tiny-gemm.json")) as f:
    assert [r["region"] for r in json.load(f)["rows"]] == ["tiny-gemm"]   # --cases replaced
  monkeypatch.setattr(sys, "argv", ["plan_check.py", "--no_such_flag"])
  row, why, _ = harness.run_in_child(script, "tiny-gemm", str(tmp_path / "bad"),
                                     "process_per_region", 240)
  assert row is None and "child exited" in why


def test_fidelity_one_row_cases_capture_their_products():
  """The one-row fidelity cases: ``V-<K>x<N>`` one product, ``VG-<K>x<N>``
  a gated MLP's gate/up part (two products over one k loop, SiLU join)."""
  from benchmarks import model_fidelity as mf
  cases = mf.fidelity_cases("float16")
  assert {"VG-896x4864", "VG-2048x5632", "VG-4096x11008"} <= set(cases)
  v = mf.capture_region(cases["V-3072x768"], "float16")
  g = mf.capture_region(cases["VG-896x4864"], "float16")
  assert len(v.contractions) == 1 and len(g.contractions) == 2
  assert g.loop_extents == {"m": 1, "n": 4864, "k": 896}
  assert cases["VG-896x4864"].flops == 2 * 2.0 * 896 * 4864


def test_predicted_time_counts_what_runs(monkeypatch):
  # A region the model leaves to XLA adds its separate kernels' time to the
  # row's prediction, not the fused plan it rejected.
  from benchmarks import harness
  import types

  def region(pred, unfused, why):
    return types.SimpleNamespace(
        einsum="mk,kn->mn ; mn,nh->mh", source="f.py:1", loops={}, flops=1, min_bytes=1,
        intensity=1.0, ridge=2.0, mbci=True, device="h100", plan="grid(m)",
        predicted_time_s=pred, floor_time_s=None, unfused_time_s=unfused, why_not=why,
        plan_time_s=0.01, tune_time_s=None, notes=[], lowered=None)

  report = types.SimpleNamespace(regions=[region(5e-6, 2e-5, None),
                                          region(6.4e-5, 2e-5, "predicted slower")])
  api = types.SimpleNamespace(inspect=lambda fn, *a: report, fused_jaxpr=None, jit=None,
                              config=None, errors={}, plan_region=None, find_regions=None)
  monkeypatch.setattr(harness, "jaxfuse_api", lambda: api)
  info = harness.jaxfuse_details(lambda x: x, (np.ones(2),), harness.Settings(reps=1))
  assert info["predicted_s"] == pytest.approx(5e-6 + 2e-5)
  assert info["plan_s"] == pytest.approx(0.02)
