"""The gateway's worker processes (``twistd infx --workers N``); pure.

``pool`` decides when the supervisor starts, restarts, stops and kills its workers;
``siblings`` what workers of one supervisor tell each other and every other gateway: the
internal ports of all of them (so a peer dials each), and which of a sibling's engines are
copies of a worker's own (so each worker serves them itself, never through a sibling).
"""
