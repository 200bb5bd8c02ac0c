"""The documentation: every public name documented with an example and listed in
the API reference; every guide's Python code runs; the version is one number.

Code blocks in docs/**/*.md: each page's ```python blocks run, in order, as one
script in a fresh Python process (later blocks may use what earlier ones
defined, as a reader following the page does), as a reader would run it: none
of the test suite's settings, so a page that needs several devices asks for
them itself, in its first block (`jax.config.update("jax_num_cpu_devices", 8)`).
A block fenced ```python skip-run is shown but not run: keep that for fragments
that cannot run on their own (a line of a loop, a signature). A block fenced
```text output shows what the page's code prints: its lines must appear, in
that order, in what the script prints.
"""

import importlib
import importlib.metadata
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import jaccum

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Modules whose __all__ is public API.
MODULES = ["jaccum", "jaccum.inspect", "jaccum.nnx", "jaccum.linen"]
PAGE_TIMEOUT_S = 300


def _public_names() -> list[str]:
  names = []
  for module_name in MODULES:
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name != module_name:
        raise
      continue
    names += [f"{module_name}.{name}" for name in module.__all__]
  return names


PUBLIC_NAMES = _public_names()


def _resolve(qualified_name: str):
  module_name, name = qualified_name.rsplit(".", 1)
  return getattr(importlib.import_module(module_name), name)


def _example_code(doc: str) -> str:
  """The `>>>` and `...` lines of a docstring's Examples section."""
  _, found, examples = doc.partition("Examples:")
  if not found:
    return ""
  lines = [line.strip() for line in examples.splitlines()]
  return "\n".join(line[4:] for line in lines if line.startswith((">>> ", "... ")))


def _public_members(cls: type) -> list[str]:
  """Methods and properties a class defines itself (not its NamedTuple fields)."""
  fields = set(getattr(cls, "_fields", ()))
  return [
    name
    for name, value in vars(cls).items()
    if not name.startswith("_")
    and name not in fields
    and (callable(value) or isinstance(value, property | staticmethod | classmethod))
  ]


@pytest.mark.parametrize("qualified_name", PUBLIC_NAMES)
def test_public_name_has_docstring_and_example(qualified_name):
  obj = _resolve(qualified_name)
  doc = inspect.getdoc(obj) or ""
  summary = doc.split("\n", 1)[0]
  assert summary.strip(), f"{qualified_name} has no docstring."
  assert _example_code(doc), (
    f"{qualified_name}'s docstring has no Examples section with a `>>>` example."
  )
  if inspect.isclass(obj):
    class_example = _example_code(doc)
    for member in _public_members(obj):
      member_doc = inspect.getdoc(getattr(obj, member)) or ""
      assert member_doc.strip(), f"{qualified_name}.{member} has no docstring."
      assert _example_code(member_doc) or f".{member}" in class_example, (
        f"{qualified_name}.{member} has no example of its own, and the class's "
        "example does not use it."
      )


def _reference_entries() -> dict[str, list[str]]:
  """`{documented name: [pages]}` from the autodoc directives of docs/api/*.md.

  An `automodule` with `:members:` documents every name in its module's
  `__all__` (autodoc follows `__all__`).
  """
  entries: dict[str, list[str]] = {}
  directive = re.compile(r"^\s*\.\. auto(\w+)::\s*(\S+)\s*$")
  for page in sorted((DOCS / "api").glob("*.md")):
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
      match = directive.match(line)
      if not match:
        continue
      kind, target = match.groups()
      names = [target]
      if kind == "module":
        options = []
        for option in lines[i + 1 :]:
          if not option.strip().startswith(":"):
            break
          options.append(option.strip())
        if not any(o.startswith(":members:") for o in options):
          continue
        try:
          module = importlib.import_module(target)
        except ModuleNotFoundError:
          continue  # docs/conf.py shows a note until the module exists.
        names = [f"{target}.{name}" for name in module.__all__]
      for name in names:
        entries.setdefault(name, []).append(page.name)
  return entries


def test_reference_lists_every_public_name_once():
  entries = _reference_entries()
  missing = [name for name in PUBLIC_NAMES if name not in entries]
  assert not missing, (
    f"public names with no autodoc entry in docs/api/*.md: {missing}; add e.g. "
    f"`.. autofunction:: {missing[0]}` to the module's reference page."
  )
  twice = {name: pages for name, pages in entries.items() if len(pages) > 1}
  assert not twice, f"names documented more than once: {twice}"
  stale = sorted(set(entries) - set(PUBLIC_NAMES))
  assert not stale, f"docs/api/*.md documents names that are not public: {stale}"


def _page_code() -> list[tuple[str, str, list[str]]]:
  """`(page, script, outputs)`: each page's runnable ```python blocks joined in
  order, and its ```text output blocks."""
  pages = []
  for page in sorted(DOCS.rglob("*.md")):
    if "_build" in page.parts:
      continue
    blocks, outputs, block, kind = [], [], None, None
    for line in page.read_text().splitlines():
      stripped = line.strip()
      if block is None and stripped.startswith("```"):
        words = stripped[3:].split()
        block, kind = [], None  # shown only, unless:
        if words[:1] == ["python"] and "skip-run" not in words[1:]:
          kind = blocks
        elif words[:1] == ["text"] and "output" in words[1:]:
          kind = outputs
      elif block is not None and stripped == "```":
        if kind is not None:
          kind.append(textwrap.dedent("\n".join(block)))
        block = None
      elif block is not None:
        block.append(line)
    if blocks:
      pages.append((str(page.relative_to(DOCS)), "\n\n".join(blocks), outputs))
  return pages


def _reader_env() -> dict[str, str]:
  """The environment of a reader who runs a page: none of this session's JAX
  settings (no simulated devices), this checkout's jaccum on the path."""
  env = {
    name: value
    for name, value in os.environ.items()
    if not name.startswith(("JAX_", "XLA_"))
  }
  return {
    **env,
    "JAX_PLATFORMS": "cpu",
    # LLVM's optimisations off: half the compile time, the same programs and
    # memory figures (XLA's own passes still run); it sets no devices.
    "XLA_FLAGS": "--xla_backend_optimization_level=0",
    "MPLBACKEND": "Agg",
    "PYTHONPATH": os.pathsep.join(
      filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    ),
  }


def _missing_output(printed: str, outputs: list[str]) -> str | None:
  """The first output block whose lines do not follow the previous one's in
  `printed` (trailing spaces aside), or None."""
  printed_lines = [line.rstrip() for line in printed.splitlines()]
  position = 0
  for output in outputs:
    lines = [line.rstrip() for line in output.strip("\n").splitlines()]
    for start in range(position, len(printed_lines) - len(lines) + 1):
      if printed_lines[start : start + len(lines)] == lines:
        position = start + len(lines)
        break
    else:
      return output
  return None


@pytest.mark.slow  # Each page in a fresh process: `pytest -m slow`, run by CI.
@pytest.mark.parametrize(
  ("page", "script", "outputs"),
  [pytest.param(*page, id=page[0]) for page in _page_code()],
)
def test_guide_code_runs(page, script, outputs, tmp_path):
  # Not equinox.py: a script named like a module it imports would shadow it.
  path = tmp_path / f"docs_{pathlib.Path(page).stem}.py"
  path.write_text(script)
  result = subprocess.run(
    [sys.executable, path.name],
    cwd=tmp_path,
    env=_reader_env(),
    capture_output=True,
    text=True,
    timeout=PAGE_TIMEOUT_S,
  )
  assert result.returncode == 0, (
    f"the Python code of docs/{page} failed:\n{result.stderr[-3000:]}"
  )
  missing = _missing_output(result.stdout, outputs)
  assert missing is None, (
    f"docs/{page} shows output its code does not print:\n{missing}\n"
    f"It printed:\n{result.stdout[-3000:]}"
  )


def test_version_matches_package_metadata():
  assert importlib.metadata.version("jaccum") == jaccum.__version__


def test_changelog_names_the_version():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", changelog, re.M)
  assert releases, "CHANGELOG.md has no release heading `## [X.Y.Z] - YYYY-MM-DD`."
  assert releases[0] == jaccum.__version__, (
    f"the newest release in CHANGELOG.md is {releases[0]}, but jaccum.__version__ "
    f"is {jaccum.__version__}; add a section for it."
  )
