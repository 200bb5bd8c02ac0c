"""Each kind of convolution in a loop body on CPU: rewritten, or as traced.

XLA:CPU runs a convolution in canonical layout (`b01f_01io->b01f`) on its
library kernels and any other on a generic loop nest it emits itself; in the
entry computation it makes every convolution canonical, in a loop body it
cannot (see `jaccum/_conv_layout.py`). Which of the two is faster depends on
the kind of convolution, and this script measures it, for the rule
`jaccum._core.rewrites` applies.

The kinds: dimensionality 1-D, 2-D, 3-D; groups: none, 4 groups, depthwise
(as many groups as input channels); the forward convolution plain, strided (2),
transposed (`lhs_dilation` 2, as `lax.conv_transpose` makes it) or dilated
(`rhs_dilation` 2); and the three convolutions `jax.grad` makes of it: the
forward, the input gradient and the kernel gradient (the transposes of the
forward, told apart by their outputs' shapes). A strided forward's input
gradient has `lhs_dilation` 2 and its kernel gradient `rhs_dilation` 2; a
transposed forward's kernel gradient has `lhs_dilation` 2; a dilated one's
input gradient `rhs_dilation` 2. Each in channels-last layout (Flax's,
whose forward is canonical already) and channels-first (`--quick`: only
channels-last).

Each convolution runs K=4 times in the body of a `lax.scan`, on fresh
operands chained through a scalar carry (so XLA can neither hoist it out of
the loop nor run the copies side by side), once as traced and once through
`canonicalize_convolutions` with every convolution rewritten. The two must
agree (relative difference <= 1e-5) before they are timed. Timings alternate
between the two within every round; "rewritten / as traced" is the median of
per-round ratios. Sizes are those of one micro-batch of the families in
`conv_families.py`: 8 rows; 32 channels over 64 positions (1-D) or 16x16
(2-D), 16 channels over 8x8x8 (3-D); 3-wide kernels.

    python -m benchmarks.conv_kinds           # about 4 minutes on 2 cores
    python -m benchmarks.conv_kinds --quick   # smaller, fewer rounds, for CI

Writes `conv_kinds.json` and `conv_kinds.md` into `benchmarks/results/`
(`benchmarks/results/quick/` with `--quick`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import sys
import time
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _measure, _record
from jaccum._core import rewrites as _conv_layout

RESULTS = pathlib.Path(__file__).parent / "results"
NUM_MICROBATCHES = 4
TOLERANCE = 1e-5
LAYOUTS = {
  ("channels_last", 1): ("NHC", "HIO", "NHC"),
  ("channels_last", 2): ("NHWC", "HWIO", "NHWC"),
  ("channels_last", 3): ("NDHWC", "DHWIO", "NDHWC"),
  ("channels_first", 1): ("NCH", "OIH", "NCH"),
  ("channels_first", 2): ("NCHW", "OIHW", "NCHW"),
  ("channels_first", 3): ("NCDHW", "OIDHW", "NCDHW"),
}
# (rows, channels, spatial sizes) of one micro-batch; --quick: a smaller one.
SIZES = {1: (8, 32, (64,)), 2: (8, 32, (16, 16)), 3: (8, 16, (8, 8, 8))}
QUICK_SIZES = {1: (4, 8, (16,)), 2: (4, 8, (6, 6)), 3: (4, 8, (4, 4, 4))}
GROUPS = ("none", "grouped", "depthwise")
FORWARDS = {
  "plain": {},
  "strided": {"window_strides": 2},
  "transposed": {"lhs_dilation": 2},
  "dilated": {"rhs_dilation": 2},
}
OPS = ("forward", "input grad", "kernel grad")


def dim_labels(dimension_numbers: Any) -> str:
  """XLA's name for a layout, e.g. `b01f_01io->b01f` (canonical, 2-D)."""
  lhs, rhs, out = (tuple(spec) for spec in dimension_numbers)

  def label(spec, first, second):
    chars = [""] * len(spec)
    for position, axis in enumerate(spec):
      chars[axis] = first if position == 0 else second if position == 1 else ""
      chars[axis] = chars[axis] or str(position - 2)
    return "".join(chars)

  return f"{label(lhs, 'b', 'f')}_{label(rhs, 'o', 'i')}->{label(out, 'b', 'f')}"


def describe(eqn: Any) -> dict[str, Any]:
  """The params that tell kinds of convolution apart."""
  params = eqn.params
  first = lambda values: int(values[0])  # the same along every axis here
  return {
    "dim_labels": dim_labels(params["dimension_numbers"]),
    "window_strides": first(params["window_strides"]),
    "lhs_dilation": first(params["lhs_dilation"]),
    "rhs_dilation": first(params["rhs_dilation"]),
    "feature_group_count": params["feature_group_count"],
    "batch_group_count": params["batch_group_count"],
    "operands": [v.aval.str_short() for v in eqn.invars],
  }


def gradient_convolutions(
  num_spatial: int, layout: str, groups: str, forward: str, quick: bool
) -> dict[str, Any]:
  """The forward, input-gradient and kernel-gradient equations `jax.grad` makes."""
  rows, channels, spatial = (QUICK_SIZES if quick else SIZES)[num_spatial]
  group_count = {"none": 1, "grouped": 4, "depthwise": channels}[groups]
  options = {"window_strides": 1, "lhs_dilation": 1, "rhs_dilation": 1}
  options |= FORWARDS[forward]
  # "SAME" padding for a 3-wide kernel, dilated or not.
  pad = options["rhs_dilation"]
  x_shape = (rows, *spatial, channels)
  w_shape = (3,) * num_spatial + (channels // group_count, channels)
  if layout == "channels_first":
    x_shape = (rows, channels, *spatial)
    w_shape = (channels, channels // group_count) + (3,) * num_spatial

  def conv(x, w):
    return jax.lax.conv_general_dilated(
      x,
      w,
      window_strides=(options["window_strides"],) * num_spatial,
      padding=[(pad, pad)] * num_spatial,
      lhs_dilation=(options["lhs_dilation"],) * num_spatial,
      rhs_dilation=(options["rhs_dilation"],) * num_spatial,
      dimension_numbers=LAYOUTS[layout, num_spatial],
      feature_group_count=group_count,
    )

  loss = lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
  w = jax.ShapeDtypeStruct(w_shape, jnp.float32)
  closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  x_var, w_var = closed.jaxpr.invars
  found = {}
  for eqn in closed.jaxpr.eqns:
    if eqn.primitive is not jax.lax.conv_general_dilated_p:
      continue
    shape = eqn.outvars[0].aval.shape
    if eqn.invars == [x_var, w_var]:
      found["forward"] = eqn
    elif shape == x_shape:
      found["input grad"] = eqn
    elif shape == w_shape:
      found["kernel grad"] = eqn
  assert sorted(found) == sorted(OPS), (num_spatial, layout, groups, forward, found)
  return found


def _operands(eqn: Any, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.normal(size=v.aval.shape).astype(np.float32) for v in eqn.invars]


def _single(eqn: Any, rewrite: bool) -> Any:
  """`eqn` alone as a closed jaxpr, as traced or rewritten (whatever the rule)."""
  closed = jax.make_jaxpr(lambda lhs, rhs: eqn.primitive.bind(lhs, rhs, **eqn.params))(
    *(v.aval for v in eqn.invars)
  )
  if not rewrite:
    return closed
  with mock.patch.object(_conv_layout, "_rewrite_wins", lambda eqn: True):
    rewritten = _conv_layout.canonicalize_convolutions(closed)
  assert rewritten is not closed, "nothing was rewritten"
  return rewritten


def _in_a_loop(closed: Any, operands: list[np.ndarray]) -> Any:
  """A compiled call running `closed` K times in a scan, each on fresh operands."""
  lhs, rhs = operands
  stacked = np.stack([np.roll(lhs, k) for k in range(NUM_MICROBATCHES)])

  def run(stacked, rhs):
    def body(total, lhs):
      # Each copy waits for the last, through the carry.
      out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, lhs + total, rhs)[0]
      return 1e-30 * jnp.sum(out), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), stacked)[0]

  compiled = jax.jit(run).lower(stacked, rhs).compile()
  return functools.partial(compiled, stacked, rhs)


def _evaluate(closed: Any, operands: list[np.ndarray]) -> np.ndarray:
  run = lambda *ops: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *ops)[0]
  return np.asarray(jax.jit(run)(*operands))


def measure(eqn: Any, rounds: int) -> dict[str, Any]:
  """One convolution as traced and rewritten: agreement, then time in a loop."""
  row = describe(eqn)
  row["rule_rewrites"] = _conv_layout._needs_rewrite(eqn)
  if _conv_layout._is_canonical(eqn):
    return row | {"canonical_as_traced": True}
  operands = _operands(eqn)
  closed = {"as traced": _single(eqn, False), "rewritten": _single(eqn, True)}
  expected = _evaluate(closed["as traced"], operands)
  difference = _measure.relative_difference(
    _evaluate(closed["rewritten"], operands), expected
  )
  assert difference <= TOLERANCE, (row, difference)
  calls = {name: _in_a_loop(c, operands) for name, c in closed.items()}
  times = _measure.interleaved(calls, rounds)
  per_op = {name: t / NUM_MICROBATCHES for name, t in times.items()}
  return row | {
    "canonical_as_traced": False,
    "difference": difference,
    "as_traced_us": float(np.median(per_op["as traced"]) * 1e6),
    "rewritten_us": float(np.median(per_op["rewritten"]) * 1e6),
    "rewritten_over_as_traced": _measure.paired_ratio(times, "rewritten", "as traced"),
  }


def run(quick: bool, rounds: int) -> dict[str, Any]:
  layouts = ("channels_last",) if quick else ("channels_last", "channels_first")
  rows = []
  for num_spatial, layout, groups, forward in itertools.product(
    (1, 2, 3), layouts, GROUPS, FORWARDS
  ):
    convs = gradient_convolutions(num_spatial, layout, groups, forward, quick)
    for op in OPS:
      row = {
        "num_spatial": num_spatial,
        "layout": layout,
        "groups": groups,
        "forward": forward,
        "op": op,
      } | measure(convs[op], rounds)
      rows.append(row)
      print(_line(row), flush=True)
  return {
    "num_microbatches": NUM_MICROBATCHES,
    "rounds": rounds,
    "sizes": {str(k): v for k, v in (QUICK_SIZES if quick else SIZES).items()},
    "rows": rows,
  }


def _line(row: dict[str, Any]) -> str:
  head = (
    f"{row['num_spatial']}-D {row['layout']:14} {row['groups']:9} "
    f"{row['forward']:10} {row['op']:11} {row['dim_labels']:22}"
  )
  if row["canonical_as_traced"]:
    return head + " canonical as traced"
  return head + (
    f" {row['as_traced_us']:9.1f} µs {row['rewritten_us']:9.1f} µs "
    f"{row['rewritten_over_as_traced']:7.2f}x  rule: "
    f"{'rewrite' if row['rule_rewrites'] else 'keep'}"
  )


def _verdict(row: dict[str, Any]) -> str:
  """Whether the rule picks the faster form; if not, how much slower its pick is."""
  ratio = row["rewritten_over_as_traced"]
  cost = max(ratio, 1.0) if row["rule_rewrites"] else max(1 / ratio, 1.0)
  return "yes" if cost == 1.0 else f"no ({cost:.2f}x)"


def table(record: dict[str, Any]) -> str:
  """The kinds as a markdown table, one row per convolution timed."""
  from benchmarks.report import markdown_table

  rows = []
  for r in record["rows"]:
    if r["canonical_as_traced"]:
      continue
    ratio = r["rewritten_over_as_traced"]
    rows.append(
      [
        f"{r['num_spatial']}-D",
        r["layout"].replace("channels_", ""),
        r["groups"],
        r["forward"],
        r["op"],
        f"`{r['dim_labels']}`",
        r["window_strides"],
        r["lhs_dilation"],
        r["rhs_dilation"],
        r["feature_group_count"],
        r["batch_group_count"],
        f"{r['as_traced_us']:.0f}",
        f"{r['rewritten_us']:.0f}",
        f"**{ratio:.2f}**" if ratio > 1 else f"{ratio:.2f}",
        "rewrite" if r["rule_rewrites"] else "keep",
        _verdict(r),
      ]
    )
  canonical = sum(r["canonical_as_traced"] for r in record["rows"])
  return "\n".join(
    [
      f"# Convolutions in a loop body: rewritten / as traced ({record['caption']})\n",
      f"Each convolution {record['num_microbatches']} times in a `lax.scan` body, "
      f"per-convolution µs, median of {record['rounds']} rounds; the ratio is the "
      "median of per-round ratios, in bold where the rewrite is slower. "
      f"{canonical} more convolutions (the channels-last forwards) are canonical "
      "as traced: nothing to rewrite. Sizes (rows, channels, spatial) by "
      f"dimensionality: {record['sizes']}. Command: `{record['command']}`.\n",
      "Rule: what `jaccum._core.rewrites` does with it; right: whether that is "
      "the faster form (if not, how much slower the rule's choice is).\n",
      markdown_table(
        [
          "dims",
          "layout",
          "groups",
          "forward",
          "op",
          "dim_labels",
          "stride",
          "lhs dil.",
          "rhs dil.",
          "feature groups",
          "batch groups",
          "as traced µs",
          "rewritten µs",
          "rewritten / as traced",
          "rule",
          "right",
        ],
        rows,
        "lllll" + "l" + "r" * 8 + "ll",
      ),
    ]
  )


def main() -> None:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.conv_kinds", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--quick", action="store_true", help="smaller, fewer rounds")
  parser.add_argument("--rounds", type=int, default=None, help="timed rounds")
  parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder")
  args = parser.parse_args()
  out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
  out.mkdir(parents=True, exist_ok=True)
  start, load_before = time.perf_counter(), _record.load()
  record = run(args.quick, args.rounds or (3 if args.quick else 15))
  record |= {
    "date": _record.now(),
    "machine": _record.machine(),
    "quick": args.quick,
    "command": " ".join(["python -m benchmarks.conv_kinds", *sys.argv[1:]]),
    "load_average": [load_before, _record.load()],
    "seconds": time.perf_counter() - start,
  }
  record["caption"] = _record.caption(record)
  (out / "conv_kinds.json").write_text(json.dumps(record, indent=1) + "\n")
  (out / "conv_kinds.md").write_text(table(record) + "\n")
  print(f"{record['seconds']:.0f} s; wrote {out / 'conv_kinds.md'}")


if __name__ == "__main__":
  main()
