"""Expert parallelism's data plane: expert placement, the load balancer, and one rank's share of the experts."""
