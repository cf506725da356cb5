"""The gateway's core: one processor with its peers' streams, request accounting and scaler signals; pure.

``core`` is :class:`GatewayCore` (the very object the simulation drives), ``effects`` what it
asks its adapters to do and its configuration, ``due_times`` its peers' due times in one heap,
``ratelimit`` the per-API-key token buckets of the HTTP API.
"""
