"""The planner behind `python -m trainers.plan`: predicted step times of SGD and K-FAC
for a model on a cluster that has not been rented yet (docs/guide.md §5).

`hardware` holds the device and network profiles, `collectives` the α-β times of the
collectives, `step_model` the phases of a step from the library's own geometry,
packing and owner assignment, `measured_steps` steps to target read from the
batch-scaling benchmark's JSON, `pricing` the steps it measured scaled to the plan,
`report` the table, JSON and plot.
"""
