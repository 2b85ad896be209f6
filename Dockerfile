# The m3run training image: the base image's CUDA PyTorch (with Triton), the m3run package on
# top, an unprivileged user, tini as PID 1. Build and run: docker/README.md.
#
#   docker build -t m3run .
#   docker run --gpus all --shm-size 16g --stop-timeout 300 \
#       -v /srv/m3run/data:/data -v /srv/m3run/runs:/runs m3run
#
# Any pytorch/pytorch *-runtime tag (or an NGC PyTorch image) with torch >= 2.11 works; the
# build fails if its torch is not a CUDA build or has no Triton.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# tini: PID 1 that forwards signals to its one child and reaps orphaned zombies.
# gcc/g++/libc6-dev: Triton and torch.compile build small host-side launchers with the system
# compiler at first use; runtime images do not ship one.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Install the project as a package. The constraint pins torch to the base image's own build, so
# pip fails instead of replacing it with a PyPI wheel. s3fs/gcsfs: checkpoint.mirror_url backends.
COPY . /tmp/m3run-src
RUN python -c "import torch, triton; print(f'torch=={torch.__version__}')" > /tmp/keep-torch.txt \
 && pip install --no-cache-dir --constraint /tmp/keep-torch.txt /tmp/m3run-src "s3fs>=2024.2" "gcsfs>=2024.2" \
 && python -c "import torch, triton, runner.cli; assert torch.version.cuda, 'base image torch is not a CUDA build'" \
 && mkdir -p /opt/m3run \
 && cp -r /tmp/m3run-src/configs /opt/m3run/configs \
 && install -m 0755 /tmp/m3run-src/docker/entrypoint /usr/local/bin/m3run-entrypoint \
 && rm -rf /tmp/m3run-src /tmp/keep-torch.txt

# The unprivileged user (uid/gid 1000, which compose and the Kubernetes Job assume) owns the two
# volumes; a uid-1000 user the base image may ship (Ubuntu 24.04's `ubuntu`) makes way for it.
# ./runs in the working directory points at /runs, so `m3run status` with no argument finds it.
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 m3run \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash m3run \
 && mkdir -p /data /runs \
 && chown m3run:m3run /data /runs \
 && ln -s /runs /opt/m3run/runs

# Compile caches on the runs volume survive container restarts (no recompilation after a
# preemption); the tiktoken cache on the data volume survives for `prepare-data`.
ENV PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/runs/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/runs/.cache/inductor \
    TIKTOKEN_CACHE_DIR=/data/.cache/tiktoken

WORKDIR /opt/m3run
USER m3run
VOLUME ["/data", "/runs"]

# The supervisor turns SIGTERM into "worker: save at the next step, exit"; give it
# supervisor.stop_grace_s + checkpoint.mirror_flush_s (+ margin) before SIGKILL: --stop-timeout.
STOPSIGNAL SIGTERM

# Liveness from the run dir only (heartbeat age, phase); never touches the GPU. The start period
# covers the preflight smoke test and torch.compile.
HEALTHCHECK --interval=60s --timeout=30s --start-period=20m --retries=3 \
    CMD ["m3run", "health", "--liveness", "/runs/pretrain_a100_434m"]

# `docker run m3run <command> ...` is `m3run <command> ...`; see docker/entrypoint for what the
# wrapper adds to `launch` (signal forwarding, halting on exits 69/70/78).
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/m3run-entrypoint"]
CMD ["launch", "configs/pretrain_a100_434m.yaml", "--run-dir", "/runs/pretrain_a100_434m"]
