"""The training-loop wing: pieces of an optimizer loop around accumulation.

`multisteps` is `MultiSteps` (accumulation across calls, as an optax
transformation), `powersgd` a `reduce_fn` that compresses the one
reduction, `schedule` the batch-size schedules and the noise-scale
controller, `noise_scale` the smoothed noise scale. It imports the core
wing only.
"""
