"""A kernel's self-check in a light child process (jaxfuse.runtime.kernel_sandbox).

The real child runs here against a stand-in CUDA driver (a small C
library, as in test_direct_launch.py) whose "kernels" add, write half their
output, fault, crash or hang, so that the child's launches, buffers and
errors and the caller's handling of each ending are tested without a GPU.
"""

import logging as pylogging
import shutil
import subprocess
import time

import numpy as np
import pytest

from jaxfuse import ir
from jaxfuse.codegen import generate
from jaxfuse.codegen import testing as T
from jaxfuse.config import config
from jaxfuse.runtime import kernel_sandbox as ks
from jaxfuse.runtime import launch
from jaxfuse.runtime import triton_call

FAKE_DRIVER = r"""
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int sticky;   /* a fault's error, returned from then on (as CUDA's are) */
int cuInit(unsigned f) { return 0; }
int cuDeviceGet(int* d, int ordinal) { *d = ordinal; return ordinal == 0 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0xC0; return 0; }
int cuCtxSetCurrent(void* c) { return 0; }
int cuMemAlloc_v2(uint64_t* p, size_t n) {
  if (n > (1u << 20)) return 2;                      /* out of memory past 1 MiB */
  *p = (uint64_t)(uintptr_t)malloc(n); return 0;
}
int cuMemFree_v2(uint64_t p) { free((void*)(uintptr_t)p); return 0; }
int cuMemcpyHtoD_v2(uint64_t d, const void* h, size_t n) {
  memcpy((void*)(uintptr_t)d, h, n); return sticky;
}
int cuMemcpyDtoH_v2(void* h, uint64_t d, size_t n) {
  memcpy(h, (void*)(uintptr_t)d, n); return sticky;
}
int cuMemsetD8_v2(uint64_t d, unsigned char v, size_t n) {
  memset((void*)(uintptr_t)d, v, n); return sticky;
}
int cuModuleLoadData(void** m, const void* image) { *m = (void*)0x10; return 0; }
int cuModuleGetFunction(void** f, void* m, const char* name) { *f = strdup(name); return 0; }
int cuDeviceGetAttribute(int* v, int a, int d) { *v = 232448; return 0; }
int cuFuncGetAttribute(int* v, int a, void* f) { *v = 0; return 0; }
int cuFuncSetAttribute(void* f, int a, int v) { return 0; }
int cuCtxSynchronize(void) { return sticky; }
int cuGetErrorString(int r, const char** s) {
  *s = r == 700 ? "an illegal memory access was encountered" : "fake error"; return 0;
}
/* Parameters: x, y (float*), n (i32), out (float*), then two hidden nulls. */
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void* stream, void** p, void** extra) {
  const char* name = (const char*)f;
  float *x = *(float**)p[0], *y = *(float**)p[1], *o = *(float**)p[3];
  int n = *(int*)p[2];
  if (*(void**)p[4] || *(void**)p[5]) return 1;     /* the hidden pointers must be null */
  if (!strcmp(name, "add")) for (int i = 0; i < n; ++i) o[i] = x[i] + gx * y[i];
  else if (!strcmp(name, "half")) for (int i = 0; i < n / 2; ++i) o[i] = x[i];
  else if (!strcmp(name, "fault")) sticky = 700;
  else if (!strcmp(name, "crash")) raise(SIGSEGV);
  else if (!strcmp(name, "hang")) for (;;) sleep(1);
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver_path(tmp_path_factory):
  cc = shutil.which("cc") or shutil.which("gcc")
  if cc is None:
    pytest.skip("no C compiler")
  d = tmp_path_factory.mktemp("fake_cuda")
  (d / "fake_cuda.c").write_text(FAKE_DRIVER)
  subprocess.run([cc, "-shared", "-fPIC", str(d / "fake_cuda.c"), "-o", str(d / "libcuda.so")],
                 check=True)
  return str(d / "libcuda.so")


@pytest.fixture
def fake_cuda(driver_path, monkeypatch):
  monkeypatch.setenv("JAXFUSE_CUDA_DRIVER", driver_path)
  monkeypatch.setattr(ks, "_unusable", None)   # a child given up on by an earlier test
  yield
  ks.shutdown()


def _program(name="add", n=4, zero_bytes=0, out_n=None):
  f32 = np.dtype(np.float32)
  attrs = {"kid": hash(name) & 0xFFFF, "image": "//ptx", "image_kind": 0, "name": name,
           "grid": [2, 1, 1], "block": 128, "smem": 0, "kinds": [0, 0, 1, 0],
           "values": [0, 0, n, zero_bytes]}
  return ks.Program(buffers=[((n,), f32), ((n,), f32), ((out_n or n,), f32)],
                    steps=[(attrs, [0, 1, 2])], inputs=[0, 1], outputs=[2])


X = np.arange(4, dtype=np.float32)
Y = np.full(4, 0.5, dtype=np.float32)


def test_the_child_runs_a_program_with_its_parameters_and_buffers(fake_cuda):
  out = ks.run(_program(), [X, Y])
  np.testing.assert_array_equal(out[0], X + 2 * Y)      # grid x = 2 reached the launch
  pid = ks._sandbox._proc.pid                             # pylint: disable=protected-access
  out = ks.run(_program(), [X + 1, Y])                    # the same child, again
  np.testing.assert_array_equal(out[0], X + 1 + 2 * Y)
  assert ks._sandbox._proc.pid == pid                     # pylint: disable=protected-access
  assert "cuda" in ks._sandbox.startup                    # pylint: disable=protected-access


def test_unwritten_outputs_read_nan_unless_the_call_zeroes_them(fake_cuda):
  out = ks.run(_program("half"), [X, Y])[0]
  np.testing.assert_array_equal(out[:2], X[:2])
  assert np.isnan(out[2:]).all()                          # poisoned, so a check fails
  out = ks.run(_program("half", zero_bytes=16), [X, Y])[0]
  np.testing.assert_array_equal(out, [0, 1, 0, 0])


@pytest.mark.parametrize("name, words", [
    ("fault", "illegal memory access"),     # a CUDA error: the child reports it and exits
    ("crash", r"died while running the kernel \(signal 11\)"),
])
def test_a_failing_kernel_ends_the_child_not_this_process(fake_cuda, name, words):
  with pytest.raises(ks.KernelFault, match=words):
    ks.run(_program(name), [X, Y])
  out = ks.run(_program(), [X, Y])                        # a fresh child for the next one
  np.testing.assert_array_equal(out[0], X + 2 * Y)


def test_a_kernel_that_hangs_is_killed_after_the_timeout(fake_cuda):
  with pytest.raises(ks.KernelFault, match="ran past 1 s"):
    ks.run(_program("hang"), [X, Y], timeout_s=1.0)
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)


def test_no_memory_in_the_child_is_not_the_kernels_fault(fake_cuda):
  big = _program(out_n=2**19)                             # 2 MiB: the fake driver refuses it
  assert ks.run(big, [X, Y]) is None                      # the caller runs the kernel itself
  assert ks._sandbox.alive()                              # pylint: disable=protected-access
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)


def test_without_a_driver_checks_run_in_this_process(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("JAXFUSE_CUDA_DRIVER", str(tmp_path / "no_such_libcuda.so"))
  monkeypatch.setattr(ks, "_unusable", None)
  try:
    with caplog.at_level(pylogging.WARNING):
      assert ks.run(_program(), [X, Y]) is None
      assert ks.run(_program(), [X, Y]) is None            # given up on: no second child
    warned = [r for r in caplog.records if "checking process cannot run" in r.getMessage()]
    assert len(warned) == 1 and "no_such_libcuda" in warned[0].getMessage()
  finally:
    ks.shutdown()


def test_an_idle_child_is_closed(fake_cuda, monkeypatch):
  """The child's CUDA context is not held for the rest of the program."""
  monkeypatch.setattr(ks, "IDLE_CLOSE_S", 0.3)
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)
  proc = ks._sandbox._proc                                 # pylint: disable=protected-access
  proc.wait(timeout=20)                                    # closed by the idle timer
  for _ in range(200):                                     # the timer then forgets it
    if ks._sandbox is None:                                # pylint: disable=protected-access
      break
    time.sleep(0.05)
  assert ks._sandbox is None                               # pylint: disable=protected-access
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)   # started again


def test_arrays_must_match_the_programs_inputs(fake_cuda):
  with pytest.raises(ValueError, match="arrays: the program takes 2 inputs, got 1"):
    ks.run(_program(), [X])
  with pytest.raises(ValueError, match=r"arrays: buffer 1 is float32\[4\], got float64\[4\]"):
    ks.run(_program(), [X, Y.astype(np.float64)])


# ------------------------------------------------------------ launch's side
def _collecting_launch(kernel, args, offsets=None):
  """Stands in for ``launch.triton_launch`` at lowering: one collected
  call per kernel launch, attributes naming the kernel, and its outputs."""
  import jax.numpy as jnp
  del args, offsets
  calls = triton_call._collecting.calls                  # pylint: disable=protected-access
  for fn, *_ in launch._launch_steps(kernel):            # pylint: disable=protected-access
    calls.append({"name": "main" if fn is kernel.fn else "combine"})
  return [jnp.zeros(s.shape, s.dtype) for s in launch._out_shapes(kernel.region)]  # pylint: disable=protected-access


def test_a_split_plans_launches_bind_inputs_partials_and_outputs(monkeypatch):
  """The checking process's program for a split plan: the main kernel
  reads the inputs and writes the partials, the combine pass reads the
  inputs and partials and writes the outputs, as ``triton_launch`` binds them."""
  r = T.gemm_chain(M=40, N=48, K=40, H=24, B=2)
  plan = T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16, k=64), split=("n", 3))
  k = generate(r, plan, interpret=True)
  monkeypatch.setattr(launch, "triton_launch", _collecting_launch)
  xs = launch.random_inputs(r, seed=1)
  p = launch._sandbox_program(k, xs)                      # pylint: disable=protected-access
  n_in, n_tmp = len(xs), len(k.scratch)
  assert [a["name"] for a, _ in p.steps] == ["main", "combine"]
  assert p.inputs == list(range(n_in)) and p.outputs == [n_in + n_tmp]
  assert p.steps[0][1] == list(range(n_in + n_tmp))
  assert p.steps[1][1] == list(range(n_in + n_tmp + 1))
  assert [p.buffers[i] for i in p.inputs] == [(x.shape, x.dtype) for x in xs]
  assert all(p.buffers[n_in + j] == ((max(s.numel, 1),), np.float32)
             for j, s in enumerate(k.scratch))


def test_a_kernel_that_fails_in_the_child_is_dropped_for_the_next_plan(monkeypatch):
  """``select_kernel`` on the GPU path: the first plan's kernel fails in the
  checking process, so the second plan's kernel is chosen; no kernel ran here."""
  r = T.gemm_chain(M=32, N=32, K=16, H=16)
  plans = [T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=16, n=16)),
           T.simple_plan(r, ("b", "m"), [("n", [])], dict(b=1, m=32, n=16))]
  seen = []

  def in_child(kernel, xs):
    seen.append(str(kernel.plan))
    if len(seen) == 1:
      raise ks.KernelFault("in the checking process: CUDA error 700")
    return [np.asarray(o) for o in launch.run_interpreted(kernel, xs)]

  def no_run_here(*_):
    raise AssertionError("a kernel ran in this process")

  monkeypatch.setattr(launch, "_run_in_sandbox", in_child)
  monkeypatch.setattr(launch, "_compile", no_run_here)
  monkeypatch.setattr(launch, "_kernels", {})
  monkeypatch.setattr(launch, "_check_key", lambda k: None)
  monkeypatch.setattr(launch, "_device_reference",
                      lambda region, seed, xs: ir.evaluate(region, xs, precision="native"))
  monkeypatch.setattr(launch, "start_reference", lambda *a, **kw: None)
  monkeypatch.setattr(launch, "generate", lambda region, p, interpret, grid_wait: generate(
      region, p, interpret=True))
  with config.override(check_isolate=True):
    k = launch.select_kernel(r, plans, backend="triton")
  assert seen == [str(p) for p in plans] and str(k.plan) == str(plans[1])
  dropped = launch._kernels[(r.signature(), str(plans[0]), "triton")]   # pylint: disable=protected-access
  assert "CUDA error 700" in str(dropped)


def test_files_go_to_disk_when_dev_shm_has_no_room(fake_cuda, monkeypatch):
  from jaxfuse.runtime import child_process

  def no_room(path):
    raise OSError("statvfs refused")
  monkeypatch.setattr(child_process.os, "statvfs", no_room)
  sb = ks._get(0)                                          # pylint: disable=protected-access
  folder = sb.folder_for(10)
  assert folder != sb._tmp and not folder.startswith("/dev/shm")   # pylint: disable=protected-access
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)
  import os
  assert os.listdir(folder) == []                         # the run's files are removed
  ks.shutdown()
  assert not os.path.exists(folder)


def test_a_child_that_ended_between_runs_is_replaced(fake_cuda):
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)
  old = ks._sandbox                                        # pylint: disable=protected-access
  old._proc.kill()                                         # pylint: disable=protected-access
  old._proc.wait()                                         # pylint: disable=protected-access
  np.testing.assert_array_equal(ks.run(_program(), [X, Y])[0], X + 2 * Y)
  assert ks._sandbox is not old                            # pylint: disable=protected-access
