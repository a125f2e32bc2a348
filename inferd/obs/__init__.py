"""Metric and trace helpers shared by the server, the gateway and the engine."""
