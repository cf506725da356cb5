"""Scaling decisions for engine deployments; pure, effects are values.

``scaler`` is :class:`Scaler`, composing ``coldstart`` (single-flight cold start, held
requests), ``crash`` (crash-loop blocks) and ``autoscale`` (load windows, desired replicas);
``types`` holds its effects, errors and configuration, ``labels`` the deployments' labels,
``lease`` the leader election's decisions.
"""
