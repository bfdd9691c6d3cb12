"""Expert parallelism's process plane: launching the ranks, the lockstep tick protocol, and the front that drives them."""
