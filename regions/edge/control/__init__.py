"""The edge's channel with the control plane: table sync (and its heartbeats) and the table file."""
