"""The cluster around the replicas: routers."""
