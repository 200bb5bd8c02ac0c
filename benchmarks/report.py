"""The suite's markdown report, written from its JSON record alone."""

from __future__ import annotations

import importlib
import statistics
from typing import Any

from benchmarks import _record

MIB = 2**20


def markdown_table(header: list[str], rows: list[list[Any]], align: str = "") -> str:
  align = align or "l" + "r" * (len(header) - 1)
  rule = ["---" if a == "l" else "--:" for a in align]
  lines = [header, rule, *rows]
  return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def _fmt(value: float | None, spec: str) -> str:
  return "–" if value is None else format(value, spec)


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
  """The median over rounds of a's step time / b's in the same round."""
  ratios = [x / y for x, y in zip(a["step_s_rounds"], b["step_s_rounds"], strict=True)]
  return statistics.median(ratios)


def sweep_section(sweep: dict[str, Any]) -> str:
  parts = [
    "## Sweep over K\n",
    f"One optimizer step ({sweep['optimizer']}) at the same effective batch, "
    f"median of {sweep['rounds']} rounds in rotated order; ratios are medians "
    "of per-round ratios. Working memory: XLA temporaries, outputs not written "
    "into donated inputs, and buffers held between programs.",
  ]
  if sweep.get("concurrent_first_steps"):
    parts.append(
      "First steps ran two at a time (`--quick`): compile times and times to "
      "first step are not comparable between methods."
    )
  for model in sweep["models"]:
    rows = model["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ks = sorted({r["num_microbatches"] for r in rows})
    at = {(r["num_microbatches"], r["method"]): r for r in rows}
    parts.append(
      f"\n### {model['name'] if 'name' in model else model['model']}: "
      f"{model['description']}, batch {model['batch_size']}\n"
    )

    def grid(cell, at=at, methods=methods, ks=ks):
      return [
        [k, *(cell(at[k, m]) if (k, m) in at else "–" for m in methods)] for k in ks
      ]

    parts.append("Step time, ms (× whole batch):\n")
    parts.append(
      markdown_table(
        ["K", *methods],
        grid(lambda r: f"{r['step_s'] * 1e3:.1f} ({r['step_vs_whole']:.2f}×)"),
      )
    )
    parts.append("\nWorking memory, MiB (XLA temporaries alone in parentheses):\n")
    parts.append(
      markdown_table(
        ["K", *methods],
        grid(
          lambda r: (
            f"{_fmt(r['working_bytes'] and r['working_bytes'] / MIB, '.2f')} "
            f"({_fmt(r['temp_bytes'] and r['temp_bytes'] / MIB, '.2f')})"
          )
        ),
      )
    )
    parts.append("\nXLA compile time / time to first step, s:\n")
    parts.append(
      markdown_table(
        ["K", *methods],
        grid(lambda r: f"{r['compile_s']:.2f} / {r['first_step_s']:.2f}"),
      )
    )
    pairs = [
      ("jaccum", "optax.microbatch"),
      ("jaccum", "python loop"),
      ("jaccum.MultiSteps", "optax.MultiSteps"),
      ("jaccum.MultiSteps", "python loop"),
      ("jaccum.nnx", "nnx"),
      ("jaccum+stats", "jaccum"),
    ]
    pair_rows = []
    for k in ks:
      cells = []
      for a, b in pairs:
        ra, rb = at.get((k, a)), at.get((k, b))
        if ra is None or rb is None:
          cells.append("–")
        else:
          cells.append(f"{paired_ratio(ra, rb):.2f}")
      pair_rows.append([k, *cells])
    parts.append("\nStep time ratios:\n")
    parts.append(markdown_table(["K", *(f"{a} / {b}" for a, b in pairs)], pair_rows))
  return "\n".join(parts)


def loop_section(loop: dict[str, Any]) -> str:
  f = loop["findings"]
  rows = [
    [
      "quickstart train step, jaccum / whole batch",
      f"{f['train_step_jaccum_vs_whole_ratio']:.2f}",
    ],
    ["jaccum / whole batch", f"{f['jaccum_vs_whole_ratio']:.2f}"],
    ["bare scan / whole batch", f"{f['bare_scan_vs_whole_ratio']:.2f}"],
    ["unrolled scan / whole batch", f"{f['unrolled_vs_whole_ratio']:.2f}"],
    ["K × micro-step alone / whole batch", f"{f['k_micro_steps_vs_whole_ratio']:.2f}"],
    ["(jaccum − whole) per micro-batch, µs", f"{f['jaccum_minus_whole_us']:.1f}"],
    [
      "(jaccum − bare scan) per micro-batch, µs",
      f"{f['jaccum_minus_bare_scan_us']:.1f}",
    ],
    [
      "(bare scan − unrolled) per micro-batch, µs",
      f"{f['bare_scan_minus_unrolled_us']:.1f}",
    ],
    [
      "one 32-row micro-step alone, less a dispatch, µs",
      f"{f['micro_step_alone_us']:.1f}",
    ],
    ["jaccum, per 1-row iteration, µs", f"{f['jaccum_per_iteration_us']:.1f}"],
    ["bare scan, per 1-row iteration, µs", f"{f['bare_scan_per_iteration_us']:.1f}"],
    ["empty scan, per iteration, µs", f"{f['empty_scan_per_iteration_us']:.1f}"],
  ]
  ops = loop["loop_body_ops"]
  op_names = sorted({op for counts in ops.values() for op in counts} - {"kernels"})
  op_rows = [
    [name, *(counts.get(op, 0) for op in op_names), counts.get("kernels", 0)]
    for name, counts in ops.items()
  ]
  return "\n".join(
    [
      "## Small micro-batches: the loop's cost per micro-batch\n",
      f"{loop['config']}; median of {loop['rounds']} rounds.\n",
      markdown_table(["measure", "value"], rows),
      "\nInstructions in the compiled loop body (kernels: all but "
      "parameter, get-tuple-element, tuple, constant, bitcast):\n",
      markdown_table(["loop", *op_names, "kernels"], op_rows),
    ]
  )


def conv_section(conv: dict[str, Any]) -> str:
  if "skipped" in conv:
    return f"## Convolutions on CPU\n\nSkipped: {conv['skipped']}."
  names = conv["variants"]
  rows = []
  for family in conv["families"]:
    for r in family["rows"]:
      rows.append(
        [
          family["family"],
          r["num_microbatches"],
          *(f"{r['step_s'][n] * 1e3:.1f} ({r['vs_whole'][n]:.2f}×)" for n in names),
          f"{r['jaccum_vs_faster']:.2f} ({r['faster_of_none_and_all']})",
          f"{r['num_kept_as_traced']} of {r['num_convolutions_in_loop']}",
        ]
      )
  described = "; ".join(
    f"{f['family']}: {f['description']}, batch {f['batch_size']}"
    + (" (BatchNorm: batch statistics)" if f["batch_statistics"] else "")
    for f in conv["families"]
  )
  return "\n".join(
    [
      "## Convolutions on CPU: jaccum's rewrite rule on five families\n",
      f"One gradient step at the same effective batch; {described}. "
      "jaccum is `jax.jit(jaccum.accumulate(grad_fn, K))`, which rewrites the "
      "convolutions the rule picks into XLA:CPU's canonical layout; no rewrite "
      "and rewrite all are the same call with the rule replaced by never and "
      "always. Every variant agreed with the mean of per-micro-batch gradients "
      f"(relative difference ≤ {conv['tolerance']:g}) before it was timed. "
      f"Median of {conv['rounds']} rounds in rotated order; ratios are medians "
      "of per-round ratios.\n",
      "Step time, ms (× whole batch); jaccum against the faster of no rewrite "
      "and rewrite all; the loop body's convolutions that jaccum left as traced:\n",
      markdown_table(
        [
          "family",
          "K",
          *names,
          "jaccum / faster of the two",
          "kept as traced",
        ],
        rows,
        "lr" + "r" * (len(names) + 2),
      ),
    ]
  )


def multisteps_section(multisteps: dict[str, Any]) -> str:
  parts = ["## MultiSteps: K=8 mini-steps per window\n"]
  for record in multisteps["runs"]:
    parts.append(
      f"\n{'Params and state donated' if record['donated'] else 'Nothing donated'}; "
      f"{record['microbatch_rows']} rows per mini-step, median of "
      f"{record['rounds']} windows.\n"
    )
    rows = []
    for r in record["results"]:
      for name, temp in r["temp_bytes"].items():
        ratio = r["time_ratios"].get(f"{name}/optax")
        memory = r["memory_ratios"].get(f"{name}/optax")
        rows.append(
          [
            r["case"],
            f"{r['num_params'] / 1e6:.1f}M",
            name,
            f"{r['seconds_per_mini_step'][name] * 1e3:.1f}",
            f"{r['seconds_accumulate_call'][name] * 1e3:.1f}",
            f"{r['seconds_emit_call'][name] * 1e3:.1f}",
            _fmt(ratio, ".2f"),
            f"{temp / MIB:.1f}",
            _fmt(memory, ".2f"),
            r["params_sized_copies"][name],
          ]
        )
    parts.append(
      markdown_table(
        [
          "inner",
          "params",
          "variant",
          "ms / mini-step",
          "accumulate ms",
          "emit ms",
          "time × optax",
          "temp MiB",
          "memory × optax",
          "copies",
        ],
        rows,
        "lllrrrrrrr",
      )
    )
  return "\n".join(parts)


def precision_section(precision: dict[str, Any]) -> str:
  errors = precision["relative_error"]
  ks = list(next(iter(errors.values())))
  rows = [
    [row, *(f"{e[k]['max']:.2g} / {e[k]['rms']:.2g}" for k in ks)]
    for row, e in errors.items()
  ]
  return "\n".join(
    [
      "## MultiSteps precision: the window mean's relative error (max / rms)\n",
      f"{precision['size']} entries per gradient, g ~ N(1, 1).\n",
      markdown_table(["", *(f"K={k}" for k in ks)], rows),
    ]
  )


def distributed_section(distributed: dict[str, Any]) -> str:
  if "skipped" in distributed:
    return f"## Distributed\n\nSkipped: {distributed['skipped']}."
  rows = [
    [
      r["K"],
      r["approach"],
      r["all_reduce_in_loop"],
      r["all_reduce_outside"],
      f"{r['step_ms']:.1f}",
    ]
    for r in distributed["rows"]
  ]
  return "\n".join(
    [
      f"## Distributed: {len(distributed['devices'])} simulated CPU devices\n",
      f"{distributed['model']}, {distributed['rows_per_microbatch_per_device']} rows "
      "per micro-batch per device.\n",
      markdown_table(
        ["K", "approach", "all-reduce in loop", "all-reduce outside", "step ms"],
        rows,
        "rlrrr",
      ),
    ]
  )


def pipeline_section(pipeline: dict[str, Any]) -> str:
  """`jaccum.pipeline`: idle share, temporaries and FLOPs against K, head."""
  ks = [str(k) for k in pipeline["ks"]]
  S = pipeline["num_stages"]
  two_s = str(2 * S)
  rows, flop_rows = [], []
  for name, row in pipeline["schedules"].items():
    temp = row["temp_bytes"]
    first, last = ks[0], ks[-1]
    growth = (temp[last] - temp[first]) / (int(last) - int(first))
    rows.append(
      [
        name,
        *(f"{temp[k] / 1e6:.2f}" for k in ks),
        f"{growth / 1e3:.1f}",
        f"{row['flops'] / 1e6:.2f}",
        f"{row['flops_in_f']:.2f}",
      ]
    )
    step = row["step_matmul_flops"]
    flop_rows.append([name, *(f"{step[k] / 1e6:.1f}" for k in ks)])
  schedules = markdown_table(
    [
      "schedule",
      *(f"K={k}" for k in ks),
      f"kB per micro-batch, K={ks[0]}→{ks[-1]}",
      f"MFLOP per tick at K={two_s}",
      "in F",
    ],
    rows,
  )
  flop_table = markdown_table(["schedule", *(f"K={k}" for k in ks)], flop_rows)
  idle_ks = list(next(iter(pipeline["idle"].values())))
  idle_rows = [
    [name, *(f"{b[k]['idle']:.1%} ({b[k]['time']:g})" for k in idle_ks)]
    for name, b in pipeline["idle"].items()
  ]
  idle = markdown_table(["", *(f"K={k}" for k in idle_ks)], idle_rows)
  head = pipeline["head"]
  K = head["num_microbatches"]
  per_microbatch = head["loss_fn"]
  head_rows = [
    [
      "after the pipeline, on the output every stage holds",
      f"{head['after'] / 1e9:.2f} on each of the {S} devices",
    ],
    [
      'the output spread over the stages (`with_sharding_constraint`, `P("stage")`)',
      f"{head['spread'] / 1e9:.2f} on each",
    ],
    [
      "`loss_fn`, in the last stage",
      f"{per_microbatch / 1e9:.3f} per micro-batch (as compiled: the loop body "
      f"counts once), × K = {K}: {K * per_microbatch / 1e9:.2f} on the last stage, "
      "none on the others",
    ],
  ]
  return "\n".join(
    [
      f"## Pipeline: {S} stages on {S} simulated CPU devices\n",
      f"{pipeline['num_blocks']} residual MLP blocks ({pipeline['width']} → "
      f"{pipeline['hidden']} → {pipeline['width']}, GELU), "
      f"{pipeline['num_blocks'] // S} per stage (1 per virtual stage with V = 2), "
      "micro-batches of "
      f"{pipeline['microbatch_rows']} rows, `value_and_grad` of `sum(sin(y))` "
      'computed by the last stage (`loss_fn`; "loss after": plain JAX on the '
      "pipeline's output). Temporaries per device in MB (`jaccum.inspect.memory`) "
      "as K grows with the batch; FLOPs per tick from `cost_analysis()`, which "
      "counts a loop's body once, also in units of F, one tick's forward on one "
      "micro-batch compiled alone (F + B ≈ 3, 2F + B ≈ 4; ZB-H1 runs one of F, "
      "B, W ≈ 1 per tick).\n",
      schedules,
      "\nMatmul MFLOP per device and step, read from the compiled HLO "
      "(`jaccum._planning.hlo_cost`): each loop's body times its trip count, each "
      "conditional at its costliest branch, as XLA counts one: per tick, the "
      "work of the device that works the most.\n",
      flop_table,
      f"\nIdle share of the device-ticks, S = {S}, from the schedule each runs "
      "(`jaccum.pipeline_schedule`), each tick as long as its busiest device, "
      "F = B = W = 1/V of a whole stage's forward; in brackets the step time "
      "in those units. GPipe's and 1F1B's are the bubble (S − 1)/(V·K + S − 1), "
      "ZB-H1's (S − 1)/(3K + S − 1), ZB-V's (S − 1)/(6K + S − 1).\n",
      idle,
      *_pipeline_small(pipeline),
      f"\nThe head: an output layer {head['width']} → {head['vocab']:,} and its "
      f"cross-entropy on {head['rows']} rows (K = {K}), GFLOP per device per step "
      "(the step's, less the same step's with a trivial loss):\n",
      markdown_table(["head and loss", "GFLOP"], head_rows),
    ]
  )


def _pipeline_small(pipeline: dict[str, Any]) -> list[str]:
  """The small size's temporaries, and what each device holds."""
  if "small" not in pipeline:
    return []
  small = pipeline["small"]
  temps = small["temp_bytes"]
  base = {label.split(",")[1]: temps[label] for label in temps if "1f1b" in label}
  rows = [
    [
      label,
      f"{temp / 1e3:.1f}",
      f"{temp / base[label.split(',')[1]]:.3f}" if label.split(",")[1] in base else "",
    ]
    for label, temp in temps.items()
  ]
  held = pipeline["held"]
  held_rows = [
    [name, *(f"{h:g}" for h in by_device), f"{max(by_device) / min(by_device):.2f}"]
    for name, by_device in held.items()
  ]
  num_devices = len(next(iter(held.values())))
  return [
    f"\nThe small size: residual tanh blocks of width {small['width']} "
    f"({small['width']} → {2 * small['width']} → {small['width']}), "
    f"{small['rows']} rows, K = 8, the loss in the last stage; temporaries per "
    "device in kB, and against 1F1B on the same blocks:\n",
    markdown_table(["schedule", "kB", "× 1f1b"], rows),
    "\nMicro-batches each device holds at most from its F to the end of its "
    "backward (W), in whole stages (a chunk counts 1/V), K = 8, from the "
    "schedule: every device of the SPMD program allocates the same buffers, "
    "sized for the device that needs the most.\n",
    markdown_table(
      ["", *(f"device {s}" for s in range(num_devices)), "max ÷ min"], held_rows
    ),
  ]


def fsdp_section(fsdp: dict[str, Any]) -> str:
  mib = lambda b: f"{b / 2**20:.2f}"
  rows = [
    [
      r["width"],
      mib(r["params_bytes"]),
      r["K"],
      r["mode"],
      mib(r["temp_bytes"]),
      f"{r['temp_bytes'] / r['params_bytes']:.2f}",
      mib(r["bytes_per_step"]),
      f"{r['bytes_per_step'] / r['params_bytes']:.1f}",
      f"{r['step_ms_cpu']:.1f}",
    ]
    for r in fsdp["rows"]
  ]
  return "\n".join(
    [
      f"## FSDP modes: {len(fsdp['devices'])} simulated CPU devices\n",
      f"{fsdp['model']}; {fsdp['rows_per_microbatch_per_device']} rows per "
      "micro-batch per device. Per device, from the compiled program: XLA's "
      "temporaries and the bytes the collectives move per step (P: the "
      "params' bytes). Step times are on simulated CPU devices sharing the "
      "machine's cores.\n",
      markdown_table(
        [
          "width",
          "params MiB",
          "K",
          "mode",
          "temporaries MiB",
          "÷ P",
          "wire MiB/step",
          "÷ P",
          "step ms (CPU)",
        ],
        rows,
        "rrrlrrrrr",
      ),
      *([fsdp_3d_section(fsdp["mesh_3d"])] if fsdp.get("mesh_3d") else []),
    ]
  )


def fsdp_3d_section(rows: list[dict[str, Any]]) -> str:
  axes = sorted({key for r in rows for key in r["bytes_per_step_by_axis"]})
  mib = lambda b: f"{b / 2**20:.2f}"
  table = [
    [
      r["mode"],
      mib(r["temp_bytes"]),
      *(mib(r["bytes_per_step_by_axis"].get(axis, 0)) for axis in axes),
    ]
    for r in rows
  ]
  first = rows[0]
  return "\n".join(
    [
      "\n### On a data × fsdp × tensor mesh (2 × 2 × 2)\n",
      f"Width {first['width']}, K = {first['K']}, params "
      f"{mib(first['params_bytes'])} MiB: FSDP over `fsdp`, replicas over "
      "`data`, each layer's output dimension over `tensor`. Per device, from "
      "the compiled program: temporaries, and the bytes on the wire per step "
      "over each mesh axis (`jaccum.inspect.collectives(...).by_axis`).\n",
      markdown_table(
        ["mode", "temporaries MiB", *(f"{axis} MiB/step" for axis in axes)],
        table,
        "l" + "r" * (1 + len(axes)),
      ),
    ]
  )


def reduction_section(reduction: dict[str, Any]) -> str:
  options = [
    [
      r["option"],
      f"{r['bytes_per_step']:,}",
      f"{r['step_ms_cpu']:.1f}",
      f"{r['max_rel_error']:.1e}",
    ]
    for r in reduction["options"]
  ]
  errors = [
    [r["devices"], r["K"], f"{r['float32']:.1e}", f"{r['bfloat16']:.1e}"]
    for r in reduction["bf16_error"]
  ]
  return "\n".join(
    [
      f"## The reduction after the loop: {reduction['devices']} simulated CPU "
      "devices\n",
      f"{reduction['model']}. Bytes per step per device from the program "
      "jaccum hands XLA (XLA:CPU widens bf16 collectives); one step's error "
      "against the exact float32 gradient (PowerSGD's is delayed by its error "
      "feedback, not lost).\n",
      markdown_table(
        ["option", "bytes per step", "step ms (CPU)", "one step's error"],
        options,
        "lrrr",
      ),
      "\nreduce_dtype=bfloat16 against float32: the largest error of the mean "
      "of K × devices gradients of 4,096 entries from N(1, 1), relative to its "
      "largest entry.\n",
      markdown_table(["devices", "K", "float32", "bf16 on the wire"], errors, "rrrr"),
    ]
  )


def deterministic_section(deterministic: dict[str, Any]) -> str:
  rows = [
    [
      r["model"],
      f"{r['params']:,}",
      r["K"],
      f"{r['ms']['plain']:.1f}",
      f"{r['ms']['deterministic']:.1f}",
      f"{r['ratio']:.3f}",
      f"{r['error']['plain']:.1e}",
      f"{r['error']['deterministic']:.1e}",
      f"{r['wire']['plain']['bytes']:,}",
      f"{r['wire']['deterministic']['bytes']:,}",
    ]
    for r in deterministic["rows"]
  ]
  return "\n".join(
    [
      "## deterministic=True against the plain step\n",
      f"The suite's models, K micro-batches on one device: step time (median of "
      f"{deterministic['rounds']} interleaved rounds, and of the per-round "
      "ratio); the largest error against the whole batch's float64 gradient, "
      "relative to each leaf's largest entry (the same micro-batches); bytes "
      f"per step per device of data_parallel on {deterministic['devices']} "
      "simulated devices, K = 2 each (none inside the loop).\n",
      markdown_table(
        [
          "model",
          "params",
          "K",
          "plain ms",
          "deterministic ms",
          "ratio",
          "error plain",
          "error deterministic",
          "bytes plain",
          "bytes deterministic",
        ],
        rows,
        "lrrrrrrrrr",
      ),
    ]
  )


def _plan_point(point: list[Any] | None) -> str:
  """`[K, remat]` as `K=4, dots_with_no_batch_dims_saveable`."""
  if point is None:
    return "–"
  return f"K={point[0]}, {point[1] or 'no remat'}"


def _plan_rows(model: dict[str, Any], key: str) -> list[list[str]]:
  """A row per budget of one model's searches (`budgets` or `measured`)."""
  rows = []
  for name, b in model.get(key, {}).items():
    vs_full = b["vs_full_remat"]
    timed = (
      f"{b['timed']}, {b['measure_spent_s']:.1f} of {b['measure_s']:g}"
      if b.get("measure_s")
      else "–"
    )
    rows.append(
      [
        model["name"],
        f"{name}, {b['budget_bytes'] / MIB:.2f}",
        f"{b['num_fitting']} of {len(model['rows'])}",
        _plan_point(b["chosen"]),
        f"{b['rank']} of {b['num_fitting']}",
        f"{b['vs_best']:.2f} ({b['vs_best_paired']:.2f})",
        "–"
        if vs_full is None
        else f"{vs_full:.2f} ({b['vs_full_remat_paired']:.2f})"
        + ("" if b["lighter_policy_fits"] else ", only full remat fits"),
        f"{b['compiled']} of {b['grid_size']}",
        timed
        if b.get("measure_s")
        else "yes"
        if b["model_best_found"]
        else f"no: {_plan_point(b['model_best'])}",
        f"{b['search_s']:.1f}",
      ]
    )
  return rows


PLAN_HEADER = [
  "model",
  "budget, MiB",
  "points that fit",
  "chosen",
  "rank (measured)",
  "÷ best that fits",
  "÷ full remat, smallest K",
  "compiled",
  "{}",
  "search s",
]


def plan_section(plan: dict[str, Any]) -> str:
  """`jaccum.fit_plan`'s choice at three budgets, against every point timed."""
  goals = plan["goals"]
  by_model = [row for model in plan["models"] for row in _plan_rows(model, "budgets")]
  measured = [row for model in plan["models"] for row in _plan_rows(model, "measured")]
  grids = []
  for model in plan["models"]:
    ks = model["candidates"]
    at = {(r["num_microbatches"], r["remat"]): r for r in model["rows"]}
    best = min(model["rows"], key=lambda r: r["step_s"])
    grid_rows = [
      [
        policy or "no remat",
        *(
          f"{at[k, policy]['peak_bytes'] / MIB:.1f} / "
          f"{at[k, policy]['predicted_s'] * 1e3:.1f} / "
          f"{at[k, policy]['step_s'] * 1e3:.1f}"
          for k in ks
        ),
      ]
      for policy in model["policies"]
    ]
    grids += [
      f"\n{model['name']}: {model['description']}, batch {model['batch_size']}; "
      "compiled peak MiB / predicted ms / measured ms (rank correlation of "
      f"predicted and measured: {_fmt(model['spearman'], '.2f')}; fastest: "
      f"{_plan_point([best['num_microbatches'], best['remat']])}):\n",
      markdown_table(["policy", *(f"K={k}" for k in ks)], grid_rows),
    ]
  cost = plan["cost_model"]
  measured_goals = ", ".join(
    f"≤ {goal:g} on the {name}"
    for name, goal in goals.get("measured_vs_best", {}).items()
  )
  return "\n".join(
    [
      "## Plans: `fit_plan`'s choice against every point of its grid, timed\n",
      "Every point of each model's grid (`fit_plan`'s default policies × the K "
      "candidates) compiled and timed on one device as "
      "`jax.jit(jaccum.accumulate(make_grad_fn(remat), K))`, median of "
      f"{plan['rounds']} interleaved rounds; peaks and predictions are "
      "`fit_plan`'s own, from one `CostModel.calibrate()` "
      f"({cost['flops_per_second'] / 1e9:.3g} GFLOP/s, "
      f"{cost['bytes_per_second'] / 1e9:.3g} GB/s, "
      f"{cost['seconds_per_microbatch'] * 1e6:.3g} µs per micro-step). "
      "Budgets sit at the grid's peaks so that a quarter (tight), half "
      "(middle) or all (generous) of its points fit. For each, `fit_plan`'s "
      "search: its choice's rank by "
      "the grid's measured times among the points that fit, its time ÷ the "
      f"fastest's (goal by the model alone ≤ {goals['vs_best']:g} on the MLP "
      f"and the CNN; with `measure=`, {measured_goals or '–'}) and ÷ that of "
      "the smallest K that fits with full remat (`nothing_saveable`; goal ≤ "
      f"{goals['vs_full_remat']:g} where a lighter policy fits): ratios of "
      "medians, in brackets medians of per-round ratios; the points it "
      "compiled; by the model alone, whether its choice is the point the "
      f"cost model predicts fastest of all that fit (within its tie of "
      f"{plan['tie']:.0%}), as compiling the whole grid would find; with "
      "`measure=`, the points it timed itself and the seconds that took, of "
      "its bound; its wall time.\n",
      "By the cost model alone:\n",
      markdown_table(
        [h.format("the model's best of the grid") for h in PLAN_HEADER],
        by_model,
        "llrlrrrrlr",
      ),
      *(
        [
          "\nWith `measure=` (timed on the device, chosen by the clock):\n",
          markdown_table(
            [h.format("timed, s of the bound") for h in PLAN_HEADER],
            measured,
            "llrlrrrrrr",
          ),
        ]
        if measured
        else []
      ),
      *grids,
    ]
  )


def coupled_section(coupled: dict[str, Any]) -> str:
  size, rows, goals = coupled["size"], coupled["rows"], coupled["goals"]
  whole = rows["whole batch"]

  def cell(name: str, what: str) -> str:
    row = rows[name]
    if what == "temp":
      return f"{row['temp_bytes'] / MIB:.1f} ({row['temp_ratio']:.2f}×)"
    return f"{row['step_s'] * 1e3:.1f} ({row['time_ratio']:.2f}×)"

  table = markdown_table(
    [
      "K",
      "coupled temporaries, MiB",
      "GradCache temporaries, MiB",
      "coupled step, ms",
      "GradCache step, ms",
    ],
    [
      [
        k,
        cell(f"coupled K={k}", "temp"),
        cell(f"gradcache K={k}", "temp"),
        cell(f"coupled K={k}", "time"),
        cell(f"gradcache K={k}", "time"),
      ]
      for k in coupled["ks"]
    ],
  )
  k = goals["k"]
  at_k = rows.get(f"coupled K={k}")
  verdict = ""
  if at_k is not None:
    temp, time = at_k["temp_ratio"], at_k["time_ratio"]
    met = lambda value, goal: "met" if value <= goal else "not met"
    verdict = (
      f"At K = {k}: temporaries {temp:.2f}× the whole batch's (goal ≤ "
      f"{goals['temp_ratio']:g}: {met(temp, goals['temp_ratio'])}), step time "
      f"{time:.2f}× (goal ≤ {goals['time_ratio']:g}: "
      f"{met(time, goals['time_ratio'])})."
    )
  return "\n".join(
    [
      "## Losses that couple the batch: `accumulate_coupled`\n",
      f"A CLIP loss over two towers of {size['blocks']} residual per-token MLP "
      f"blocks (width {size['width']}, {size['tokens']} tokens a row, mean-pooled "
      f"to {size['embed']}), batch {size['batch']}: the whole batch's step takes "
      f"{whole['step_s'] * 1e3:.1f} ms and {whole['temp_bytes'] / MIB:.1f} MiB of "
      f"temporaries (params {coupled['param_bytes'] / MIB:.1f} MiB). "
      "`accumulate_coupled` and GradCache written by hand (chunked scans, the "
      "chunks' gradients summed in the params' dtype) at each K, XLA's "
      "temporaries and the step time (median of "
      f"{coupled['rounds']} interleaved rounds; × whole batch: the median of "
      "per-round ratios). Every method's gradient was checked against the "
      "whole batch's first.\n",
      table,
      "",
      verdict,
    ]
  )


def overheads_section(overheads: dict[str, Any]) -> str:
  from benchmarks import overheads as part

  return part.section(overheads)


def diloco_section(diloco: dict[str, Any]) -> str:
  def axis(row: dict[str, Any], key: str) -> str:
    return f"{row['bytes_per_step'].get(key, 0):,.0f}"

  rows = [
    [
      r["method"],
      axis(r, "replica+data"),
      axis(r, "replica"),
      axis(r, "data"),
      f"{r['most_per_call_slow']:,.0f}",
      f"{r['extra_bytes_per_param']:.1f}",
      f"{r['step_ms_cpu']:.1f}",
    ]
    for r in diloco["rows"]
  ]
  return "\n".join(
    [
      f"## DiLoCo: bytes per mesh axis, {diloco['devices']} simulated CPU devices\n",
      f"{diloco['model']}, {diloco['mesh']}. Bytes a step sends per device over "
      f"each mesh axis, averaged over a round of {diloco['sync_every']} steps "
      "(each phase's program counted once; bf16 rows as jaccum hands them to "
      "XLA, which widens them on CPU), the most one call sends over the slow "
      "axis, the state DiLoCo adds per replica, and the CPU step time over a "
      "round.\n",
      markdown_table(
        [
          "method",
          "replica+data B/step",
          "replica B/step",
          "data B/step",
          "most a call, slow axis",
          "state B/param",
          "step ms (CPU)",
        ],
        rows,
        "lrrrrrr",
      ),
    ]
  )


SECTIONS = {
  "sweep": sweep_section,
  "loop": loop_section,
  "conv": conv_section,
  "multisteps": multisteps_section,
  "precision": precision_section,
  "distributed": distributed_section,
  "fsdp": fsdp_section,
  "reduction": reduction_section,
  "pipeline": pipeline_section,
  "plan": plan_section,
  "coupled": coupled_section,
  "deterministic": deterministic_section,
  "overheads": overheads_section,
  "diloco": diloco_section,
  "private": lambda part: importlib.import_module("benchmarks.private").section(part),
}


def render(record: dict[str, Any]) -> str:
  head = [
    "# jaccum benchmark results\n",
    f"{_record.caption(record)}.\n",
    "Load average (1 minute) before and after each part: "
    + ", ".join(
      f"{name} {part['load_average'][0]:.1f} → {part['load_average'][1]:.1f}"
      for name, part in record["parts"].items()
    )
    + ".",
  ]
  # Parts run again on their own since (`--parts`) say when, and how.
  later = []
  for name, part in record["parts"].items():
    if "date" in part:
      machine = part["machine"]
      same = machine["cpu"] == record["machine"]["cpu"]
      where = "" if same else f" on {machine['cpu']} ({machine['cores']} cores)"
      later.append(f"{name} on {part['date'][:10]}{where} (`{part['command']}`)")
  if later:
    head.append(f"\nRun again on its own later: {', '.join(later)}.")
  body = [
    SECTIONS[name](part) for name, part in record["parts"].items() if name in SECTIONS
  ]
  return "\n\n".join(["\n".join(head), *body]) + "\n"
