"""The training-loop wing: pieces of an optimizer loop around accumulation.

`multisteps` is `MultiSteps` (accumulation across calls, as an optax
transformation), `powersgd` a `reduce_fn` that compresses the one
reduction, `schedule` the batch-size schedules and the noise-scale
controller, `noise_scale` the smoothed noise scale, `diloco` `DiLoCo`
(local steps on replicas of a slow mesh axis, averaged every H steps),
`diloco_fragments` its groups of leaves that sync in turn and
`diloco_step` its train step on a mesh. It imports the routes wing (for
`accumulate`, the rules table) and the core wing.
"""
