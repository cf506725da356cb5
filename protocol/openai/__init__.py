"""OpenAI's HTTP API on one side, LLMariner's typed wire on the other; pure, no I/O.

``requests`` (OpenAI request JSON -> typed ``TaskRequest``), ``verbatim`` (the client's request
kept as it came, beside its typed form), ``runtime`` (typed ``TaskRequest`` -> the request a
runtime takes), ``completions`` (legacy completions, response side), ``task_forms`` (which form
an engine gets), ``json`` (typed reads of untrusted JSON), ``errors`` (every OpenAI error body,
error event and status line), ``sse`` (server-sent events) and ``observe`` (what an answer says
about itself: first token, usage).
"""
