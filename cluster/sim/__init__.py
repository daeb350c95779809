"""The simulated engine (`engine: sim`): the same actors, router and transfer as a
real cluster, with model execution replaced by a cost model (cost.py) whose
parameters live in params/*.yaml, every number commented with its source."""
