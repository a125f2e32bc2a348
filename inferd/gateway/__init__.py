"""The edge: API keys, rate limits, routing and replicas (``inferd gateway``)."""
