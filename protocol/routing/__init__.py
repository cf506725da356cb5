"""Which engine a task goes to; pure, no I/O, no clock.

``router`` is the routing policy (bounded-load consistent hashing, the prefix index, sessions,
adapters), ``hints`` what a request tells the router, ``spills`` where spilled prompts went, as
every gateway learns it through the exchange.
"""
