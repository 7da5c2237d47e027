"""The repository stays in step with itself: BUILD names every module, test
and binary; .ci/run runs the README's test command."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _build_calls():
  """Parses BUILD (Starlark is Python-syntax here) into (rule, kwargs)."""
  tree = ast.parse((ROOT / "BUILD").read_text())
  calls = []
  for node in tree.body:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
      call = node.value
      kwargs = {}
      for k in call.keywords:
        try:
          kwargs[k.arg] = ast.literal_eval(k.value)
        except ValueError:  # deps = REQUIREMENTS + [...]: not needed here
          pass
      calls.append((call.func.id, kwargs))
  return calls


def _srcs(rule, name=None):
  out = set()
  for kind, kw in _build_calls():
    if kind == rule and (name is None or kw.get("name") == name):
      out.update(kw.get("srcs", []))
  return out


def test_every_library_module_is_in_build():
  modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxfuse").rglob("*.py")}
  listed = _srcs("py_library", "jaxfuse")
  assert modules - listed == set(), f"modules missing from BUILD: {sorted(modules - listed)}"
  assert listed - modules == set(), f"BUILD names files that do not exist: {sorted(listed - modules)}"


def test_every_test_file_has_a_py_test():
  tests = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")}
  listed = _srcs("py_test")
  assert tests - listed == set(), f"tests missing from BUILD: {sorted(tests - listed)}"
  assert listed - tests == set(), f"BUILD names missing tests: {sorted(listed - tests)}"
  helpers = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")} - tests
  assert helpers <= _srcs("py_library"), "test helpers (conftest, utilities) belong to a py_library"


def _is_binary(path) -> bool:
  """A module-level ``if __name__ == "__main__":`` (not one in a docstring
  example, as benchmarks/harness.py has)."""
  tree = ast.parse(path.read_text())
  return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)


def test_every_binary_is_in_build():
  bins = set()
  for d in ("benchmarks", "examples"):
    for p in (ROOT / d).glob("*.py"):
      if _is_binary(p):
        bins.add(p.relative_to(ROOT).as_posix())
  listed = _srcs("py_binary")
  assert bins - listed == set(), f"binaries missing from BUILD: {sorted(bins - listed)}"
  assert listed - bins == set(), f"BUILD names missing binaries: {sorted(listed - bins)}"
  libs = {p.relative_to(ROOT).as_posix() for d in ("benchmarks",)
          for p in (ROOT / d).glob("*.py")} - bins
  assert libs <= _srcs("py_library"), f"benchmark modules missing: {sorted(libs - _srcs('py_library'))}"


def test_ci_runs_the_readme_test_command():
  lines = (ROOT / "README.md").read_text().splitlines()
  fence = lines.index("```")
  commands = []
  for line in lines[fence + 1:]:
    if line.startswith("```"):
      break
    commands.append(line.strip())
  assert len(commands) == 2, commands
  assert "examples/demo.py" in commands[0]
  assert "pytest" in commands[1]
  ci = (ROOT / ".ci" / "run").read_text()
  assert commands[1] in ci


def test_version_agrees():
  import jaxfuse
  pyproject = (ROOT / "pyproject.toml").read_text()
  assert re.search(rf'^version = "{re.escape(jaxfuse.__version__)}"', pyproject, re.M)


# The GPU machine receives a copy of the checkout's tracked files, at most
# 64 MiB with whatever else a run carries (wheels, scripts); the seventy-
# second session found the tree at 63 MB and gzipped raw results that no
# text names. Keep room: store large raw data gzipped.
TRACKED_TREE_LIMIT = 56 * 2**20


def test_tracked_tree_leaves_room_for_a_device_copy():
  import subprocess
  import pytest
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  files = [f for f in out.stdout.decode().split("\0") if f]
  sizes = {f: (ROOT / f).stat().st_size for f in files if (ROOT / f).is_file()}
  total = sum(sizes.values())
  biggest = sorted(sizes, key=sizes.get)[-5:]
  assert total < TRACKED_TREE_LIMIT, (
      f"tracked files take {total / 2**20:.1f} MiB (limit {TRACKED_TREE_LIMIT / 2**20:.0f}): "
      f"gzip large raw results; largest: {biggest}")
