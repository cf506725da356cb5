# One image for the gateway (twistd infx) and the engine agent (twistd infx-engine).
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY infx ./infx
COPY protocol ./protocol
COPY twisted ./twisted
# Write Twisted's plugin caches now, as root: the non-root user below could not, and
# twistd would log "Unable to write to plugin cache" at every start.
RUN pip install --no-cache-dir . && cd / && python -m infx.plugin_cache && rm -rf /src
WORKDIR /
USER 65534
EXPOSE 8080 8082 8083
ENTRYPOINT []
CMD ["twistd", "-n", "--pidfile=", "infx"]
