"""The engine agent, pure: its streams to the gateway, the built-in echo runtime, its runtime's health and load.

``core`` is :class:`EngineAgentCore`, ``echo`` the echo runtime, ``runtime_health`` the health
check of the runtime, ``runtime_metrics`` the runtimes' own load signals parsed and
``runtime_load`` the monitor that turns them into reports.
"""
