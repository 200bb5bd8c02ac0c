"""Runs every ```python block of README.md as its own script, in a fresh process."""

import pathlib
import re
import subprocess
import sys
import time

readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
blocks = re.findall(r"^```python\n(.*?)^```", readme.read_text(), re.M | re.S)
if not blocks:
  sys.exit("README.md has no ```python blocks to run")
for number, code in enumerate(blocks, 1):
  start = time.perf_counter()
  result = subprocess.run([sys.executable, "-c", code], timeout=300)
  print(
    f"README snippet {number}/{len(blocks)}: exit {result.returncode} "
    f"in {time.perf_counter() - start:.1f}s",
    flush=True,
  )
  if result.returncode:
    print(code, file=sys.stderr)
    sys.exit(result.returncode)
