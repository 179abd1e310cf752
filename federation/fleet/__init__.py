"""Fleet operations: the worker's side of the lifecycle (start, probe, ready, drain, stop),
replica counts kept at ``desired_replicas``, and automatic failover of instances and regions."""
