"""The pipeline wing: micro-batches through stages on a mesh axis.

`front` is `jaccum.pipeline` (its options, the layout of stages on devices,
the tracing of the user's stage and loss); the schedules (GPipe, 1F1B, and
ZB-H1 and ZB-V in `zero_bubble`) each run as one loop; `tables` holds the
tick tables that say which device does what at each tick
(`jaccum.pipeline_schedule`); `backward` splits a stage's backward pass
into its input and weight parts (the zero bubble's B and W). It imports the
core wing only.
"""
