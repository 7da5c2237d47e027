"""Test-session settings: CPU only, Triton's interpreter, a private cache."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

# Before jax or triton are imported anywhere in the session.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("JAXFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="jaxfuse-test-cache-"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_python(tmp_path):
  """``run(script) -> dict``: runs ``script`` in a fresh interpreter (the repo
  on its path, TRITON_INTERPRET unset) and returns the JSON object on its last
  line of output. Why: Triton's interpreter, which other tests of this
  process run, patches triton.language in place (a device function called
  from an interpreted kernel is never unpatched), so an offline compile for
  a GPU in this process fails or passes by the order the tests ran in."""
  def run(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    path = tmp_path / f"fresh_{abs(hash(script))}.py"   # Triton reads kernels from a file
    path.write_text(script)
    p = subprocess.run([sys.executable, str(path)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
  return run
