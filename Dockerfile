# The m3run training image: the base image's CUDA PyTorch (with Triton), the m3run package on
# top, an unprivileged user, tini as PID 1. Build and run: docker/README.md.
#
#   docker build -t m3run .
#   docker run --gpus all --shm-size 16g --stop-timeout 300 \
#       -v /srv/m3run/data:/data -v /srv/m3run/runs:/runs m3run
#
# BASE_IMAGE: any pytorch/pytorch *-runtime tag (or an NGC PyTorch image) with torch >= 2.11
# works; the build fails if its torch is not a CUDA build or has no Triton. The default is pinned
# by digest, so a rebuild gets the same base even after the tag is moved, and fully qualified, so
# podman and buildah (which refuse unqualified short names) build it as Docker does. It is the tag
#   docker.io/pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
# (to move on: `docker buildx imagetools inspect pytorch/pytorch:<tag>` prints the new digest).
# Podman and buildah need `--format docker`: the OCI format has no SHELL or HEALTHCHECK, and
# they ignore both with one warning line in the build's output (docker/README.md).
ARG BASE_IMAGE=docker.io/pytorch/pytorch@sha256:eee11b3b3872a8c838e35ef48f08b2d5def2080902c7f666831310ca1a0ef2be
FROM ${BASE_IMAGE}

# A failing command on the left of a pipe fails the build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# tini: PID 1 that forwards signals to its one child and reaps orphaned zombies.
# gcc/g++/libc6-dev: Triton and torch.compile build small host-side launchers with the system
# compiler at first use; runtime images do not ship one.
# The versions are those of the base image's Ubuntu release, which the digest above fixes.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# The unprivileged user (uid/gid 1000, which compose and the Kubernetes Jobs assume) owns the two
# volumes; a uid-1000 user the base image may ship (Ubuntu 24.04's `ubuntu`) makes way for it.
# ./runs in the working directory points at /runs, so `m3run status` with no argument finds it.
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 m3run \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash m3run \
 && mkdir -p /data /runs /opt/m3run \
 && chown 1000:1000 /data /runs \
 && ln -s /runs /opt/m3run/runs

# Dependencies first, from pyproject.toml alone: a change to the code reuses this layer and only
# the layer below reinstalls. The constraint pins torch to the base image's own build, so pip
# fails instead of replacing it with a PyPI wheel. It is the installed distribution's version
# (its metadata, as pip sees it), not torch.__version__: a torch installed from PyPI reports
# 2.x.y+cu130 there, a local version pip cannot find, while its metadata says 2.x.y. Extras:
# mirror (s3fs/gcsfs for checkpoint.mirror_url), wandb and tensorboard (the metric trackers).
# REQUIRE_CUDA=false accepts a base whose torch is a CPU build without Triton: for the image
# test on a machine without a GPU (docker/test-image), never for an image that trains.
ARG REQUIRE_CUDA=true
COPY pyproject.toml docker/project_requirements.py /tmp/m3run-deps/
RUN case "$REQUIRE_CUDA" in \
        true) python -c "import importlib.util as u, torch; assert torch.version.cuda, f'the base image torch {torch.__version__} is not a CUDA build: use a CUDA PyTorch BASE_IMAGE'; assert u.find_spec('triton'), 'the base image has no Triton: use a PyTorch BASE_IMAGE that ships it'" ;; \
        false) python -c "import torch" ;; \
        *) echo "REQUIRE_CUDA must be true or false, got '$REQUIRE_CUDA'" >&2; exit 1 ;; \
    esac \
 && python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > /tmp/keep-torch.txt \
 && python /tmp/m3run-deps/project_requirements.py /tmp/m3run-deps/pyproject.toml \
        mirror wandb tensorboard > /tmp/m3run-deps/requirements.txt \
 && pip install --no-cache-dir --constraint /tmp/keep-torch.txt \
        --requirement /tmp/m3run-deps/requirements.txt \
 && rm -rf /tmp/m3run-deps

# The package itself: its requirements are all met above, so pip installs m3run alone.
COPY . /tmp/m3run-src
RUN pip install --no-cache-dir --constraint /tmp/keep-torch.txt \
        "/tmp/m3run-src[mirror,wandb,tensorboard]" \
 && python -c "import m3run.runner.cli, m3run.model" \
 && cp -r /tmp/m3run-src/configs /opt/m3run/configs \
 && install -m 0755 /tmp/m3run-src/docker/entrypoint /usr/local/bin/m3run-entrypoint \
 && install -m 0755 /tmp/m3run-src/docker/prepare-a100-data /usr/local/bin/m3run-prepare-a100-data \
 && rm -rf /tmp/m3run-src /tmp/keep-torch.txt

# Caches on the runs volume survive container restarts: no recompilation after a preemption
# (Triton, inductor), no second sha256 pass over the token shards (the shard checks are cached
# under XDG_CACHE_HOME). The tiktoken cache on the data volume serves `prepare-data`. Set here
# rather than left to $HOME, which a container run under another uid (compose) does not have.
# (DL3064 reads the TOKEN in TIKTOKEN_CACHE_DIR as a secret; it is a directory.)
# hadolint ignore=DL3064
ENV PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/runs/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/runs/.cache/inductor \
    XDG_CACHE_HOME=/runs/.cache \
    TIKTOKEN_CACHE_DIR=/data/.cache/tiktoken

WORKDIR /opt/m3run
USER 1000:1000
VOLUME ["/data", "/runs"]

# The supervisor turns SIGTERM into "worker: save at the next step, exit"; give it
# supervisor.stop_grace_s + checkpoint.mirror_flush_s (+ margin) before SIGKILL: --stop-timeout.
STOPSIGNAL SIGTERM

# Liveness from the run dir only (heartbeat age, phase); never touches the GPU. The start period
# covers the preflight smoke test and torch.compile. A container that runs something else
# (prepare-data) turns it off: compose's `prepare` service does.
HEALTHCHECK --interval=60s --timeout=30s --start-period=20m --retries=3 \
    CMD ["m3run", "health", "--liveness", "/runs/pretrain_a100_434m"]

# `docker run m3run <command> ...` is `m3run <command> ...`; see docker/entrypoint for what the
# wrapper adds to `launch` (signal forwarding, halting on exits 69/70/78).
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/m3run-entrypoint"]
CMD ["launch", "configs/pretrain_a100_434m.yaml", "--run-dir", "/runs/pretrain_a100_434m"]
