"""The inference processor: tasks, engines, routing, retries and ordered results; pure.

``core`` is :class:`Processor`, every input, made of collaborating parts each with its own
state: ``tasks`` (the task table and the task life cycle), ``engines`` (the engine table and
its (tenant, model) index), ``slots`` (slots held and tasks waiting), ``dispatcher`` (where a
task goes, and which waiting task takes a freed slot), ``endings`` (a task's end), ``retries``
(a failed attempt) and ``control`` (heartbeats, go-aways, cancels); ``types`` holds its
configuration, effects and errors, ``counters`` its metrics; ``attempts`` (one task's
attempts), ``fair_queue`` (held tasks by criticality, then fairly across callers),
``fair_share`` (slots held per caller, the reserve) and ``route_flow`` (routes that stopped
draining) are its policies. Which engine a task goes to is :mod:`protocol.routing`'s.
"""
