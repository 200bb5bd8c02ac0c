"""The core wing: the loop that runs once the plan has decided.

It owns cutting micro-batches (`microbatch`), the traced micro-step and its
inputs (`step`), the rewrites the traced step goes through (`rewrites`), one accumulator per reduce mode (`accumulators`), exact sums
(`exact`), the loop's drivers (`loop`), FSDP inside the loop (`fsdp`), the
gradient noise scale's measurements (`stats`), device-varying types and the
collectives a program holds (`varying`), and the one reduction over devices
(`reduction`). Its modules read no options: each takes the piece the plan
hands it. It imports no other wing.
"""
