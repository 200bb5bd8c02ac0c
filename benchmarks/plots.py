"""PNG plots of the sweep (a figure per measure, a panel per model, a line per
method) and of the convolution part.

* `step_time.png`: median time of one optimizer step at the effective batch,
  log scale;
* `memory.png`: temporary memory, the working set beyond params, optimizer
  state and batch (XLA temporaries, outputs not written into donated inputs,
  buffers held between programs), log scale;
* `compile_time.png`: XLA compile time within the first step;
* `first_step.png`: time to first step (trace + compile + first run);
* `conv.png`: the convolution part's step times against the whole batch, a
  panel per family, a bar per variant and K, log scale;
* `fsdp.png`: the fsdp part's temporaries per device against the params' size;
* `plan.png`: the plan part's predicted against measured step time, a panel
  per model, a point per grid point, the plans chosen by the model ringed
  and those chosen with `measure=` boxed.

Every figure names the machine, the versions and the date underneath.
"""

from __future__ import annotations

import pathlib
import textwrap
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
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
  "no rewrite": dict(color="tab:red", marker="^"),
  "rewrite all": dict(color="tab:olive", marker="v"),
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


def _save_part(
  fig: Any, record: dict[str, Any], name: str, out: pathlib.Path, bottom: float
) -> pathlib.Path:
  """Writes `{name}.png` with the caption of the part's own run (a part re-run
  on its own has its own date and machine) in the `bottom` share of the figure."""
  own = record["parts"][name]
  part = {**record, **{k: own[k] for k in ("date", "machine") if k in own}}
  fig.text(0.5, 0.01, _record.caption(part), ha="center", fontsize=8)
  fig.tight_layout(rect=(0, bottom, 1, 1))
  path = out / f"{name}.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_conv(record: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
  """Writes `conv.png`, the convolution part's step times against the whole batch."""
  conv = record["parts"]["conv"]
  variants = [name for name in conv["variants"] if name != "whole"]
  families = conv["families"]
  fig, axes = plt.subplots(
    1, len(families), figsize=(3.4 * len(families), 4.6), squeeze=False, sharey=True
  )
  width = 0.8 / len(variants)
  for ax, family in zip(axes[0], families, strict=True):
    ks = [row["num_microbatches"] for row in family["rows"]]
    for i, name in enumerate(variants):
      ax.bar(
        [x + (i - (len(variants) - 1) / 2) * width for x in range(len(ks))],
        [row["vs_whole"][name] for row in family["rows"]],
        width,
        label=name,
        color=STYLES[name]["color"],
      )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(
      ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:g}".lstrip("0.")[:1] in ("2", "5") else ""
      )
    )
    ax.set_xticks(range(len(ks)), [f"K={k}" for k in ks])
    ax.set_title(family["description"], fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
  axes[0][0].set_ylabel("step time / whole batch (dashed: 1)")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(
    handles,
    labels,
    loc="lower center",
    ncol=len(variants),
    fontsize=9,
    bbox_to_anchor=(0.5, 0.06),
    frameon=False,
  )
  fig.suptitle("Convolutional networks accumulated on CPU: step time / whole batch")
  return [_save_part(fig, record, "conv", out, bottom=0.14)]


def plot_fsdp(record: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
  """Writes `fsdp.png`: temporaries per device against the params' size, per mode."""
  fsdp = record["parts"]["fsdp"]
  ks = sorted({row["K"] for row in fsdp["rows"]})
  fig, axes = plt.subplots(1, len(ks), figsize=(4.6 * len(ks), 4.4), squeeze=False)
  for ax, k in zip(axes[0], ks, strict=True):
    for mode in ("gather_once", "shard_grads", "shard_all"):
      rows = [r for r in fsdp["rows"] if r["K"] == k and r["mode"] == mode]
      ax.plot(
        [r["params_bytes"] / 2**20 for r in rows],
        [r["temp_bytes"] / 2**20 for r in rows],
        marker="o",
        label=mode,
      )
    ax.set_xlabel("params (MiB, whole)")
    ax.set_title(f"K={k} micro-batches per device", fontsize=10)
    ax.grid(True, alpha=0.3)
  axes[0][0].set_ylabel("temporaries per device (MiB, XLA)")
  axes[0][0].legend(fontsize=9)
  fig.suptitle(f"FSDP modes on {len(fsdp['devices'])} simulated devices: memory")
  return [_save_part(fig, record, "fsdp", out, bottom=0.05)]


# One colour per remat policy in plan.png, lightest first.
POLICY_COLORS = {
  None: "tab:blue",
  "dots_with_no_batch_dims_saveable": "tab:orange",
  "nothing_saveable": "tab:red",
}


def plot_plan(record: dict[str, Any], out: pathlib.Path) -> list[pathlib.Path]:
  """Writes `plan.png`: each grid point's predicted against measured step time."""
  plan = record["parts"]["plan"]
  models = plan["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 5.2))
  for ax, model in zip(np.atleast_1d(axes), models, strict=True):
    rows = model["rows"]
    for policy in model["policies"]:
      mine = [r for r in rows if r["remat"] == policy]
      ax.scatter(
        [r["predicted_s"] * 1e3 for r in mine],
        [r["step_s"] * 1e3 for r in mine],
        color=POLICY_COLORS.get(policy, "tab:grey"),
        label=policy or "no remat",
        zorder=3,
      )
      for r in mine:
        ax.annotate(
          f"K={r['num_microbatches']}",
          (r["predicted_s"] * 1e3, r["step_s"] * 1e3),
          textcoords="offset points",
          xytext=(4, 3),
          fontsize=7,
        )
    # The model's absolute scale is off on a busy machine; its ranking is
    # what the plan rests on, so the reference is measured = c × predicted.
    scale = float(np.median([r["step_s"] / r["predicted_s"] for r in rows]))
    low = min(r["predicted_s"] for r in rows) * 1e3
    high = max(r["predicted_s"] for r in rows) * 1e3
    ax.plot(
      [low, high],
      [low * scale, high * scale],
      color="black",
      linestyle="--",
      linewidth=1,
      label=f"measured = {scale:.2g} × predicted",
    )
    for key, marker, size, label in (
      ("budgets", "o", 160, "chosen at a budget, by the model"),
      ("measured", "s", 260, "chosen at a budget, with measure="),
    ):
      chosen = {tuple(b["chosen"]) for b in model.get(key, {}).values()}
      picked = [r for r in rows if (r["num_microbatches"], r["remat"]) in chosen]
      if picked:
        ax.scatter(
          [r["predicted_s"] * 1e3 for r in picked],
          [r["step_s"] * 1e3 for r in picked],
          s=size,
          marker=marker,
          facecolors="none",
          edgecolors="black",
          label=label,
          zorder=4,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
      axis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.tick_params(which="minor", labelsize=7)
    ax.set_xlabel("predicted step time (ms, fit_plan's cost model)")
    ax.set_ylabel("measured step time (ms, median)")
    ax.set_title(
      textwrap.fill(model["description"], 64)
      + f"\nbatch {model['batch_size']}; rank correlation "
      + ("–" if model["spearman"] is None else f"{model['spearman']:.2f}"),
      fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("fit_plan: predicted against measured time, every grid point")
  return [_save_part(fig, record, "plan", out, bottom=0.04)]
