"""PNG plots of the sweep: a figure per measure, a panel per model, a line per method.

* `step_time.png`: median time of one optimizer step at the effective batch,
  log scale;
* `memory.png`: temporary memory, the working set beyond params, optimizer
  state and batch (XLA temporaries, outputs not written into donated inputs,
  buffers held between programs), log scale;
* `compile_time.png`: XLA compile time within the first step;
* `first_step.png`: time to first step (trace + compile + first run).

Every figure names the machine, the versions and the date underneath.
"""

from __future__ import annotations

import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

from benchmarks import _record

# One look per method, the same in every figure; those flat in K dashed.
STYLES = {
  "whole": dict(color="black", linestyle="--", marker="x"),
  "nnx": dict(color="grey", linestyle="--", marker="+"),
  "jaccum": dict(color="tab:blue", marker="o", linewidth=2.5),
  "jaccum+stats": dict(color="tab:cyan", marker="o", linestyle=":"),
  "jaccum.nnx": dict(color="tab:purple", marker="o"),
  "optax.microbatch": dict(color="tab:orange", marker="s"),
  "python loop": dict(color="tab:red", marker="^"),
  "optax.MultiSteps": dict(color="tab:brown", marker="v"),
  "jaccum.MultiSteps": dict(color="tab:green", marker="D"),
}

FIGURES = {
  # file: (row field, scale to display units, y label, log y)
  "step_time.png": ("step_s", 1e3, "step time (ms)", True),
  "memory.png": ("working_bytes", 2.0**-20, "temporary memory (MiB)", True),
  "compile_time.png": ("compile_s", 1.0, "XLA compile time (s)", False),
  "first_step.png": ("first_step_s", 1.0, "time to first step (s)", False),
}


def plot_sweep(record: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
  """Writes the four figures of the sweep part of a suite record into `out`."""
  sweep = record["parts"]["sweep"]
  written = []
  for file, (field, scale, label, log) in FIGURES.items():
    models = sweep["models"]
    fig, axes = plt.subplots(
      1, len(models), figsize=(max(5.2 * len(models), 9), 5.2), squeeze=False
    )
    for ax, model in zip(axes[0], models, strict=True):
      methods = list(dict.fromkeys(row["method"] for row in model["rows"]))
      for method in methods:
        rows = [r for r in model["rows"] if r["method"] == method]
        points = [
          (r["num_microbatches"], r[field] * scale)
          for r in rows
          if r.get(field) is not None
        ]
        if not points:
          continue
        ks, values = zip(*points, strict=True)
        ax.plot(ks, values, label=method, **STYLES.get(method, {}))
      ax.set_xscale("log", base=2)
      if log:
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        # Over more than a decade, label only the 2s and 5s between powers of 10.
        shown = "25" if high / low > 5 else "123456789"
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(
          ticker.FuncFormatter(
            lambda v, _, shown=shown: f"{v:g}" if f"{v:g}"[0] in shown else ""
          )
        )
      ax.set_xlabel("micro-batches K (same effective batch)")
      ax.set_ylabel(label)
      ax.set_title(f"{model['description']}\nbatch {model['batch_size']}", fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
      handles,
      labels,
      loc="lower center",
      ncol=5,
      fontsize=9,
      bbox_to_anchor=(0.5, 0.04),
      frameon=False,
    )
    fig.suptitle(label.split(" (")[0])
    fig.text(0.5, 0.01, _record.caption(record), ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path = out / file
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written
