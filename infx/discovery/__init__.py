"""Peer discovery on Twisted: ``kube`` is the Kubernetes informer's one adapter and the pod watcher on it."""
