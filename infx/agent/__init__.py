"""The engine agent on Twisted (``twistd infx-engine``): its gateway streams and its runtime.

``engine`` performs :class:`protocol.agent.core.EngineAgentCore`'s effects, ``runtimes`` runs
tasks on the built-in echo or an OpenAI-compatible server, ``runtime_watch`` and
``runtime_load_watch`` check the runtime's health and scrape its load over ``side_http``,
``upstream_key`` holds the credentials for the runtime.
"""
