"""The exchange between gateways: each end of a ``ProcessTasksInternal`` stream; pure.

``accepted_peer`` is this gateway's side of a stream a peer opened to it (the peer's engines, their
results), ``dialled_peer`` its side of a stream it dialled to a peer (the tasks the peer forwards,
our reports), ``status_reports`` the reports between them (full snapshots or numbered deltas).
"""
