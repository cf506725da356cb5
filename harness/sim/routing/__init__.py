"""A deterministic routing simulation: production ``Processor`` instances (1 or 3
gateways seeing the same engines) in front of modelled runtimes whose time to
first token and throughput depend on what their prefix caches hold.

``runtime`` models an engine (LRU prefix cache, prefill proportional to
uncached tokens, batched decode); ``workloads`` makes the clients (shared
system prompts, multi-turn conversations, a bursty tenant); ``run`` drives a
seeded run and measures it. ``python -m harness.sim.routing`` (``tools/routing_sim``)
prints the side-by-side table.
"""
