"""The routes wing: the door, the plan, and where the loop runs.

The public fronts `accumulate`, `data_parallel` (`accumulate`),
`accumulate_coupled` (`coupled`) and `dp_value_and_grad` (`private`) turn
their keywords into `Options` (`options`; `private` wraps them in its own
`PrivateOptions`), checked once with the option-only rules of the table
(`rules`). Each call is planned once per trace (`plan`, reading the call
through `arguments`) and run on its route (`routes`; the per-device route
over a mesh in `mesh`, laid out by `placement`). What the Flax wrappers
share is in `wrappers`. It imports the core wing only.
"""
