"""The inference processor: tasks, engines, routing, retries and ordered results; pure.

``core`` is :class:`Processor`, built on ``dispatcher`` (where a task goes, dispatch, the waiting
tasks that take freed slots), ``slots`` (engine slots, the cap and its reserve, a task's end) and
``tasks`` (its records and the queries over them); ``types`` holds its configuration, effects
and errors; ``fair_queue`` (held tasks by criticality, then fairly across callers),
``fair_share`` (slots held per caller, the reserve) and ``route_flow`` (routes that stopped
draining) are its policies.
"""
