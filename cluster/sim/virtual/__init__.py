"""The simulated cluster on a virtual clock: one process, no Ray, no sleeping (docs/sim.md).

The same scheduler core (cluster/sim/scheduler_core.py), block pools, cost model, routing
policies and prefix index (router/routing.py, router/prefix_index.py) and records
(router/timeline.py) as the real-time simulated cluster; time advances from event to event.
`simulate` (run.py) runs a whole load on a whole cluster in one call.
"""
