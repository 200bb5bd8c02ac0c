"""The core wing: the loop that runs once the plan has decided.

It owns cutting micro-batches (`microbatch`); the micro-step, traced once,
with its inputs made ready for this device (`step`); the rewrites the traced
step goes through, and reading the collectives it holds (`rewrites`); one
accumulator per reduce mode (`accumulators`); exact sums (`exact`); the
loop's drivers (`loop`); FSDP inside the loop (`fsdp`); the gradient noise
scale's measurements (`stats`); the one reduction over devices
(`reduction`); and DP-SGD's micro-step, each example's gradient clipped
(`clipping`), its norms read from the batched backward pass (`ghost`).
Its modules read no options: each takes the piece the plan hands it. It
imports no other wing.
"""
