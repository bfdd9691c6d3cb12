"""Expert parallelism: rank launch, the lockstep protocol, expert placement and EPLB, rank-local weights."""
