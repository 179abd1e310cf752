"""The stages one request passes through, in order: admit, place (waiting in the gateway line),
forward (attempts, P/D, spill-over, cold holds), relay, record. They do I/O."""
