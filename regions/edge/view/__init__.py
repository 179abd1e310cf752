"""What the edge sees of its engines and peers: health probes, live load, KV-cache events,
exact cached prefixes and peer sync."""
