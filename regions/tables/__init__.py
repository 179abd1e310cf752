"""Routing-table documents shared by the control plane (which signs) and the edge (which
verifies). Pure: no Django, no I/O."""
