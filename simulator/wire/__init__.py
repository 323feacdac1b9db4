"""The wire between clients and replicas: the client-to-server half (``network``), the
server-to-client half (``stream``, ``clientstream``), the per-request wire of a run with
the rich network/stream model (``per_request``), and the real HTTP load client
(``benchclient``)."""
