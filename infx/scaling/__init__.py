"""The scaler on Twisted: performs :mod:`protocol.scaling`'s decisions against Kubernetes.

``scaler`` is the service (its one timer, writes, metrics), ``kube`` its Scale, Event and Lease
adapters, ``lease`` leader election, ``watch`` the deployment and pod informers.
"""
