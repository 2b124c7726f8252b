# The gpuwatch image for deploy/kubernetes: `docker build -t registry.example/gpuwatch:0.1.0 .`
# from the top of the checkout. The package is built into a wheel in a first stage and installed
# from that wheel, so the image holds what `pip install gpuwatch` would, and no source tree.
# NVML (libnvidia-ml.so.1) is not in the image: the NVIDIA container runtime mounts the node's
# driver library (NVIDIA_VISIBLE_DEVICES=all in the DaemonSet; docs/kubernetes.md).
ARG BASE=python:3.12-slim-bookworm

FROM ${BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY gpuwatch ./gpuwatch
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${BASE}
# Its own unprivileged account, the image's default user (`gpuwatch status`, `doctor`); the
# DaemonSet runs the daemon as UID 0 with three capabilities instead, and gives it this group
# for state.sock (docs/kubernetes.md says why).
RUN groupadd --system --gid 10001 gpuwatch \
    && useradd --system --uid 10001 --gid gpuwatch --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin gpuwatch
COPY --from=wheel /dist/ /tmp/dist/
# With the kubernetes extra (grpcio): the kubelet's PodResources names pods and their GPUs.
RUN python -m pip install --no-cache-dir "$(ls /tmp/dist/gpuwatch-*.whl)[kubernetes]" \
    && rm -rf /tmp/dist
# The root file system is read-only in the DaemonSet: no bytecode written at run time.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 9966
CMD ["gpuwatch", "daemon"]
