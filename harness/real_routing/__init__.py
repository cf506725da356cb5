"""The real-runtime routing benchmark's parts (issue #24): scripted workloads, a run on fresh llama.cpp servers
behind a router, and the figures read from the runtimes' own answers.

``workloads`` makes the clients (the same requests for every router), ``run`` runs them once through a
router on fresh runtimes (infx as real ``twistd`` processes here; the Rust routers are
``tools/bench/real_routing.py``'s), ``figures`` turns the answers into the benchmark's figures.
"""
