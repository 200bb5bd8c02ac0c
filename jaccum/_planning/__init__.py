"""The planning wing: K, the remat policy and the FSDP mode from a memory budget.

`fit` is `fit_microbatches` and `fit_train_step` (the smallest K whose
compiled step fits), `fit_plan` chooses K, remat and FSDP mode together (the
fastest point that fits, costed by `cost` from the compiled programs, or
timed by `timing`); `peak` says what dominates the peak when nothing fits;
`hlo_cost` reads loops and FLOPs from compiled HLO text. It imports the
routes and core wings and `jaccum.inspect`.
"""
