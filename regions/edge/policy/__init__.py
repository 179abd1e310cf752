"""The edge's pure rules: plain data in, a decision out, no I/O (admission, budgets, the
scheduler, sessions, speeds, spill-over and the demand split, the route header, the prefix
index, the KV-event wire format, signed hops and peer seals)."""
