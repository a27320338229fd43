# The fleetwire image: one image for the coordinator and the workers (docs/OPERATIONS.md,
# "Deploying to a fleet"). Build it from the repository root:
#
#   docker build -t fleetwire:0.1.0 .        # tag it with pyproject.toml's version
#   docker run --rm fleetwire:0.1.0 --version
#
# tests/e2e/test_deploy_path.py copies what the COPY lines name into an empty directory and runs
# the `pip wheel` line below there, so the build context here is known to be enough.

# ---- build: the wheel, from the sources only (no tests, benches or docs in the image)
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protocol ./protocol
COPY wireio ./wireio
COPY coordinator ./coordinator
COPY worker_agent ./worker_agent
COPY fleetwire ./fleetwire
RUN pip wheel --no-cache-dir --no-deps . -w /dist

# ---- run: the wheel and its dependencies, as a user without privileges
FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /var/lib/fleetwire fleetwire
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist
USER fleetwire
WORKDIR /var/lib/fleetwire
# The coordinator's SQLite store (mount a volume here; back it up with `fleetwire store backup`).
ENV FLEETWIRE_DATA_DIR=/var/lib/fleetwire PYTHONUNBUFFERED=1
VOLUME ["/var/lib/fleetwire"]
EXPOSE 8765
# Stop with SIGTERM: a worker drains (--drain-timeout) and says goodbye; give `docker stop -t` more.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fleetwire"]
CMD ["--help"]
