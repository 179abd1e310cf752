"""HTTP in and out: the lean server, the upstream client, request parsing, error bodies and the
endpoints served."""
