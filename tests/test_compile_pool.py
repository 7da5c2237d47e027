"""Compile workers for measured tuning (jaxfuse.runtime.compile_pool).

These compile real kernels for an sm_90 target on the CPU (Triton's own
LLVM and ptxas; no GPU): what a worker leaves in the Triton cache must be
exactly what this process's own launch looks up.
"""

import itertools
import os
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest
import torch

import jaxfuse
from jaxfuse import capture, codegen
from jaxfuse.codegen import testing as T
from jaxfuse.planner import examples, plan_region
from jaxfuse.runtime import compile_pool, compile_worker

triton = pytest.importorskip("triton")
from triton import knobs  # pylint: disable=g-import-not-at-top
from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
from triton.runtime.driver import driver  # pylint: disable=g-import-not-at-top

TARGET = GPUTarget("cuda", 90, 32)
_fresh = itertools.count()


@pytest.fixture
def gpu_kernels(tmp_path, monkeypatch):
  """Two distinct GPU (not interpreted) kernels of a small chain, their
  launches on CPU tensors (specialization reads only dtypes and
  alignment), a private Triton cache and a driver that answers sm_90.
  Each use gets other shapes: Triton keeps compiled kernels in memory."""
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
  region = examples.gemm_chain(1, 64, 64, 32, 16 * (2 + next(_fresh)))
  kernels = []
  for p in plan_region(region, "h100", use_cache=False).ranked:
    try:
      k = codegen.generate(region, p, interpret=False)
    except codegen.CodegenError:
      continue
    if all(k.module_path != q.module_path for q in kernels):
      kernels.append(k)
    if len(kernels) == 2:
      break
  assert len(kernels) == 2
  vm = region.value_map
  dt = {"float16": torch.float16}
  ins = [torch.empty(b.shape, dtype=dt[vm[b.value].dtype]) for b in region.inputs]
  outs = [torch.empty(b.shape, dtype=dt[vm[b.value].dtype]) for b in region.outputs]
  launches = [(k.fn, k.grid, [*ins, *outs],
               dict(k.launch_options, **k.constexprs))
              for k in kernels]
  # Not set_active/reset_active: the reset would build Triton's default
  # driver, which fails without a GPU.
  monkeypatch.setattr(driver, "_active", compile_worker._CompileOnlyDriver(TARGET))
  return launches, tmp_path / "triton"


def _entries(cache) -> set:
  return set(os.listdir(cache)) if os.path.isdir(cache) else set()


def test_workers_compile_what_this_process_then_loads(gpu_kernels):
  launches, cache = gpu_kernels
  pool = compile_pool.CompilePool(2)
  try:
    assert pool.precompile(launches, TARGET) == [None, None]
  finally:
    pool.close()
  built = _entries(cache)
  assert len(built) >= 2
  # This process's own launch now finds every kernel in the cache: it
  # compiles nothing (no new cache entries) and gets the cubins.
  for fn, grid, args, kw in launches:
    compiled = fn.warmup(*args, grid=grid, **kw)
    assert compiled.asm.get("cubin")
  assert _entries(cache) == built


def test_workers_follow_the_cache_dir_chosen_after_they_started(gpu_kernels, tmp_path,
                                                                 monkeypatch):
  # The pool starts before the measurer picks Triton's cache directory (the
  # workers had compiled into ~/.triton while the launch looked elsewhere).
  launches, _ = gpu_kernels
  pool = compile_pool.CompilePool(1)
  try:
    later = tmp_path / "chosen_later"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(later))
    assert pool.precompile(launches[:1], TARGET) == [None]
  finally:
    pool.close()
  built = _entries(later)
  assert built
  fn, grid, args, kw = launches[0]
  fn.warmup(*args, grid=grid, **kw)
  assert _entries(later) == built


def test_specializations_compile_nothing_and_restore_the_hook(gpu_kernels):
  launches, cache = gpu_kernels
  calls = []

  def user_hook(*args, **kwargs):   # someone else's hook stays in place
    calls.append(kwargs.get("key"))
  old = knobs.runtime.jit_cache_hook
  knobs.runtime.jit_cache_hook = user_hook
  try:
    specs = compile_pool.specializations(launches)
    assert knobs.runtime.jit_cache_hook is user_hook
  finally:
    knobs.runtime.jit_cache_hook = old
  assert len(specs) == 2 and all(isinstance(s, str) and s for s in specs)
  assert specs[0] != specs[1]
  assert not _entries(cache)
  assert not calls   # our kernels' compiles were not handed to the user's hook


def test_a_failed_job_is_reported_and_the_pool_recovers(gpu_kernels):
  launches, cache = gpu_kernels
  pool = compile_pool.CompilePool(1)
  try:
    err = pool._job({"path": "/nonexistent/k.py", "module": "nope", "target": ["cuda", 90, 32],
                     "fns": [["fused_kernel", "{}"]]}, time.perf_counter() + 60.0)
    assert isinstance(err, RuntimeError) and "nonexistent" in str(err)
    # The same (single) worker then compiles a real kernel.
    assert pool.precompile(launches[:1], TARGET) == [None]
  finally:
    pool.close()
  assert _entries(cache)


def test_a_dead_worker_is_replaced(gpu_kernels):
  launches, _ = gpu_kernels
  pool = compile_pool.CompilePool(1)
  try:
    w = pool._idle.get()
    w.kill()
    pool._idle.put(w)
    assert pool.precompile(launches[:1], TARGET) == [None]
  finally:
    pool.close()


def test_config_compile_workers(monkeypatch):
  with pytest.raises(ValueError, match="compile_workers"):
    jaxfuse.config.update("compile_workers", -1)
  monkeypatch.setenv("JAXFUSE_COMPILE_WORKERS", "3")
  assert type(jaxfuse.config).from_env().compile_workers == 3
  monkeypatch.setenv("JAXFUSE_COMPILE_WORKERS", "2.5")
  with pytest.raises(ValueError, match="JAXFUSE_COMPILE_WORKERS"):
    type(jaxfuse.config).from_env()
  with jaxfuse.config.override(compile_workers=0):
    assert compile_pool.get() is None
  with pytest.raises(ValueError, match="size"):
    compile_pool.CompilePool(0)


def test_a_silent_worker_times_out_within_the_callers_deadline(tmp_path, monkeypatch):
  script = tmp_path / "silent_worker.py"
  script.write_text("import time\ntime.sleep(120)\n")
  monkeypatch.setattr(compile_pool, "WORKER_SCRIPT", str(script))
  monkeypatch.setattr(compile_pool, "START_TIMEOUT_S", 30.0)
  pool = compile_pool.CompilePool(1)
  try:
    err = pool._job({"path": "x", "module": "x", "target": ["cuda", 90, 32], "fns": []},
                    time.perf_counter() + 1.0)
    # The caller's 1 s deadline, not the 30 s start allowance, bounded the wait.
    assert isinstance(err, compile_pool.CompileTimeout)
    assert str(err) == "compile worker silent for 1 s"
  finally:
    pool.close()


def test_the_process_pool_is_shared_and_follows_the_config():
  try:
    with jaxfuse.config.override(compile_workers=1):
      first = compile_pool.get()
      assert first is not None and first.size == 1
      assert compile_pool.get() is first          # one pool per process
    with jaxfuse.config.override(compile_workers=2):
      second = compile_pool.get()
      assert second is not first and second.size == 2
      assert first._closed                        # the old one's workers are gone
  finally:
    compile_pool.shutdown()
  with jaxfuse.config.override(compile_workers=1):
    third = compile_pool.get()
  assert third is not second
  compile_pool.shutdown()


def test_kernels_compile_with_fp_fusion_whatever_tritons_default(tmp_path, monkeypatch):
  # Printed kernels need mul+add contracted into FMAs (the softmax shift
  # s*c - max, rescales, activations); Triton 3.9 warns its default turns
  # that off in 3.10. With fusion off Triton prints fp32 mul/add as .rn,
  # which ptxas does not contract.
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
  monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
  monkeypatch.setattr(driver, "_active", compile_worker._CompileOnlyDriver(TARGET))
  m = 64 + 16 * next(_fresh)
  x, w1, w2 = (jax.ShapeDtypeStruct(s, jnp.float16) for s in ((m, 64), (64, 64), (64, 32)))
  region = capture.find_regions(jax.make_jaxpr(
      lambda x, w1, w2: jax.nn.gelu(x @ w1) @ w2)(x, w1, w2))[0].region
  k = codegen.generate(region, plan_region(region, "h100", use_cache=False).best,
                       interpret=False)
  assert k.launch_options["enable_fp_fusion"] is True
  tensors = [torch.empty(b.shape, dtype=torch.float16) for b in (*region.inputs, *region.outputs)]
  kw = dict(k.launch_options, **k.constexprs)
  # A worker compiles (this process may have run the interpreter, which
  # leaves Triton unable to compile here); the launch then loads its PTX.
  pool = compile_pool.CompilePool(1)
  try:
    assert pool.precompile([(k.fn, k.grid, tensors, kw)], TARGET) == [None]
  finally:
    pool.close()
  ptx = k.fn.warmup(*tensors, grid=k.grid, **kw).asm["ptx"]
  assert "fma.rn.f32" in ptx
  assert not any(f"{op}.rn.f32" in ptx for op in ("mul", "add", "sub"))


_SCRIPTED_WORKER = """
import json, sys, time
print(json.dumps({"ok": True, "ready": True}), flush=True)
for line in sys.stdin:
  job = json.loads(line)
  time.sleep(float(job.get("sleep", 0)))
  print(json.dumps({"ok": True}), flush=True)
"""


@pytest.fixture
def scripted_pool(tmp_path, monkeypatch):
  """A pool of one worker that answers each job after ``job["sleep"]`` s."""
  script = tmp_path / "scripted_worker.py"
  script.write_text(_SCRIPTED_WORKER)
  monkeypatch.setattr(compile_pool, "WORKER_SCRIPT", str(script))
  pool = compile_pool.CompilePool(1)
  yield pool
  pool.close()


def test_a_compile_past_the_deadline_is_abandoned_and_its_worker_replaced(scripted_pool):
  t0 = time.perf_counter()
  err = scripted_pool._job({"sleep": 60}, t0 + 1.0)
  assert isinstance(err, compile_pool.CompileTimeout)
  assert time.perf_counter() - t0 < 10.0        # the deadline, not the 60 s compile
  assert scripted_pool._job({"sleep": 0}, time.perf_counter() + 30.0) is None


def test_a_job_waiting_for_a_busy_worker_gives_up_at_its_deadline(scripted_pool):
  assert scripted_pool._job({}, time.perf_counter() + 30.0) is None   # worker started
  slow = threading.Thread(target=scripted_pool._job,
                          args=({"sleep": 3}, time.perf_counter() + 30.0))
  slow.start()
  time.sleep(0.2)
  t0 = time.perf_counter()
  err = scripted_pool._job({}, t0 + 0.5)
  assert isinstance(err, compile_pool.CompileTimeout) and "free" in str(err)
  assert time.perf_counter() - t0 < 2.0
  slow.join()
  assert scripted_pool._job({}, time.perf_counter() + 30.0) is None


def test_submit_returns_at_once_and_compiles_a_split_plans_two_kernels(tmp_path, monkeypatch):
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
  monkeypatch.setattr(driver, "_active", compile_worker._CompileOnlyDriver(TARGET))
  r = T.gemm_chain(M=64, N=96 + 16 * next(_fresh), K=32, H=32, B=1, dtype="float16")
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=32, n=16, k=32, h=32),
                       split=("n", 2))
  k = codegen.generate(r, plan, interpret=False)
  assert k.combine_fn is not None
  ins = [torch.empty(b.shape, dtype=torch.float16) for b in r.inputs]
  outs = [torch.empty(b.shape, dtype=torch.float16) for b in r.outputs]
  scratch = [torch.empty((max(s.numel, 1),), dtype=torch.float32) for s in k.scratch]
  kw = dict(k.launch_options)
  group = [(k.fn, k.grid, [*ins, *scratch], dict(kw, **k.constexprs)),
           (k.combine_fn, k.combine_grid, [*ins, *scratch, *outs],
            dict(kw, **k.combine_constexprs))]
  pool = compile_pool.CompilePool(1)
  try:
    with pytest.raises(ValueError, match="one module"):
      other = types.SimpleNamespace(fn=types.SimpleNamespace(__module__="elsewhere"))
      pool.submit([[group[0], (other, *group[0][1:])]], TARGET, time.perf_counter() + 60)
    t0 = time.perf_counter()
    (fut,) = pool.submit([group], TARGET, time.perf_counter() + 120.0)
    assert not fut.done() and time.perf_counter() - t0 < 5.0   # compiling meanwhile
    assert fut.result() is None
  finally:
    pool.close()
  built = _entries(tmp_path / "triton")
  for fn, grid, args, kwargs in group:   # both kernels load from the cache
    assert fn.warmup(*args, grid=grid, **kwargs).asm.get("cubin")
  assert _entries(tmp_path / "triton") == built


def test_wait_started_waits_for_every_worker_and_not_past_its_timeout(tmp_path, monkeypatch):
  """The measuring process says it is ready only once its compile workers
  have started; a worker that never starts does not hold it past the wait."""
  pool = compile_pool.CompilePool(2)
  try:
    assert pool.wait_started(120.0) == 2
    assert all(w.ready for w in list(pool._idle.queue))
    assert pool.wait_started(1.0) == 2                     # at once the second time
  finally:
    pool.close()
  script = tmp_path / "silent_worker.py"
  script.write_text("import time\ntime.sleep(120)\n")
  monkeypatch.setattr(compile_pool, "WORKER_SCRIPT", str(script))
  pool = compile_pool.CompilePool(1)
  try:
    t0 = time.perf_counter()
    assert pool.wait_started(0.5) == 0 and time.perf_counter() - t0 < 5
    assert pool._idle.qsize() == 1                         # still there for a job to replace
  finally:
    pool.close()
