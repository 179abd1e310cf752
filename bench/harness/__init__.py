"""What the benchmarks share and that is no benchmark itself: processes, fleets, workloads, the
streaming client, statistics and reports, and the bench model's tokenizer. A benchmark's own
module (``bench/<name>.py``) runs it; the register (``bench/registry.py``) names them."""
