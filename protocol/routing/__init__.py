"""Which engine a task goes to; pure, no I/O, no clock.

``router`` is what the processor talks to: the pools every policy reads (``pools``: routable
engines per (tenant, model), loads, adapters, spilled tips) and the policy ``config`` names,
each policy an implementation of ``policy.Policy`` in a file of its own (``affinity``,
``least_in_progress``, ``round_robin``); ``prefix_index`` is the affinity policy's memory of
prompts, ``hints`` what a request tells the router, ``spills`` where spilled prompts went, as
every gateway learns it through the exchange.
"""
