"""The exchange between gateway replicas on Twisted: peer streams, accepted and dialled, and their TLS.

``exchanger`` serves and dials ``ProcessTasksInternal`` and performs the core's peer effects;
``peer_tls`` is mutual TLS between replicas.
"""
