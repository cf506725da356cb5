"""Which peers a gateway has: the Kubernetes informer and the pods it makes peers; pure.

``informer`` lists, then watches, with a cache whose changes come out as effects; ``peers``
decides which pods are peer gateways from those changes.
"""
