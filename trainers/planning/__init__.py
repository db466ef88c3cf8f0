"""The planner behind `python -m trainers.plan`: predicted step times of SGD and K-FAC
for a model on a cluster that has not been rented yet (docs/guide.md §5).

`hardware` holds the device and network profiles, `collectives` the α-β times of the
collectives, `floor_model` and `workloads` a step's kernels as the library's blocks and
methods declare them (`Block.cost`, `Method.decomposition_kernels`,
`Method.precondition_kernels`), `step_model` the phases of a step from them and the
library's packing and owner assignment, `measured_steps` steps to target read from the
batch-scaling benchmark's JSON, `pricing` the steps it measured scaled to the plan,
`report` the table, JSON and plot.
"""
