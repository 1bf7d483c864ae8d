"""The SLA planner's decision core (docs/planner.md): step-time fits, the pool simulation
and the policy. Pure Python, no I/O: the cluster's actuator acts on its decisions."""
