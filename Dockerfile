# The fleetwire image: one image for the coordinator and the workers (docs/OPERATIONS.md,
# "Deploying to a fleet"). Build it from the repository root:
#
#   docker build -t fleetwire:0.1.0 .        # tag it with pyproject.toml's version
#   docker run --rm fleetwire:0.1.0 --version
#
# The image's wheel is the compiled core's (docs/OPERATIONS.md §The compiled core): the build stage gets a C
# compiler (python:3.11-slim has Python's headers, no compiler) and the run stage stays slim, without one.
# FLEETWIRE_MYPYC, a build arg, is setup.py's switch: 1 (the image's default) compiled or the build fails,
# 0 pure Python and no compiler installed, "" compiled where it can be, else pure with a warning line:
#
#   docker build --build-arg FLEETWIRE_MYPYC=0 -t fleetwire:0.1.0-pure .
#   docker run --rm --entrypoint python fleetwire:0.1.0 -m fleetwire.build_info   # compiled core, 37 modules ...
#
# tests/e2e/test_deploy_path.py copies what the COPY lines name into an empty directory and runs
# the `pip wheel` line below there, so the build context here is known to be enough.

# ---- build: the wheel, from the sources only (no tests, benches or docs in the image)
FROM python:3.11-slim AS build
ARG FLEETWIRE_MYPYC=1
# gcc and libc's headers for mypyc's C (pip fetches mypy into the isolated build itself); none for a pure build.
RUN if [ "$FLEETWIRE_MYPYC" != "0" ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi
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
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist && python -m fleetwire.build_info
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
