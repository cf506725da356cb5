"""The gateway's engine side on Twisted: the core's owner, engine streams, API keys, metrics.

``dispatcher`` feeds :class:`protocol.gateway.core.GatewayCore` its inputs and performs its
effects, ``workers`` serves the engines' ``ProcessTasks`` streams, ``tasks`` is what the HTTP API
needs from them, ``auth`` and ``key_reload`` the API keys and their reload, ``metrics`` the
gateway's Prometheus metrics.
"""
