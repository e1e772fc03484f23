# Production image: the gateway on an NVIDIA GPU, with the model weights and the IVR script's
# pre-rendered prompts baked in, so a new replica serves from its own disk and never waits on the
# Hugging Face hub.
#
#   docker build -t ivr-gateway .
#   docker run --gpus all --stop-timeout 120 -p 8080:8080 -e GATEWAY_TWILIO_AUTH_TOKEN ivr-gateway
#
# docs/operators/deploy.md has the build args, the ports and where the image's ~9 GB go.
# tests/deployment/test_dockerfile.py checks this file's structure (no Docker engine runs in CI).

# The Hugging Face model baked in (a CustomVoice model; see docs/authors/scripts.md for Base models).
# Declared once here; each stage that reads it re-declares it without a value.
ARG MODEL_ID=Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice

# --- the CUDA variant: which NVIDIA driver the hosts need ----------------------------------------
# PyPI's torch 2.14.1 wheels are CUDA 13.0 builds, and NVIDIA's minor-version compatibility runs a
# CUDA 13.x build on driver >= 580 only (12.x: >= 525). The reference deployment (infra/) runs the
# ECS GPU-optimised Amazon Linux 2023 AMI, which ships driver 580.x: the defaults fit it. For a
# host on an older driver (the ECS GPU AMI for Amazon Linux 2 ships 550.x), build for CUDA 12:
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 \
#                --build-arg CUDA_DRIVER_MIN=525 -t ivr-gateway .
# The image's label io.qwen3-tts-ivr-gateway.cuda-driver-min states what it needs; on a host below
# it, the gateway (GATEWAY_DEVICE=cuda) refuses to start and /readyz names the driver it found.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
# Empty: PyPI (CUDA 13). Else a PyTorch wheel index (https://download.pytorch.org/whl/cu126, ...).
ARG TORCH_INDEX_URL=
ARG CUDA_DRIVER_MIN=580

# --- os: the base every stage shares ------------------------------------------------------------
# The `base` flavour of the CUDA image on purpose: PyPI's torch wheels carry their own CUDA 13
# user-space libraries (cuBLAS, cuDNN, NCCL... as nvidia-* wheels, 3.2 GB installed), so the
# `runtime`/`cudnn-runtime` flavours would ship a second, unused copy of them. `base` still has
# cudart, the CUDA forward-compat libraries and the NVIDIA_* variables the container toolkit reads.
# Its CUDA version matches torch's wheels (CUDA_IMAGE above).
# Ubuntu 24.04's python3 is 3.12: >= 3.11 as pyproject.toml asks, < 3.13 so no audioop-lts.
FROM ${CUDA_IMAGE} AS os

ARG DEBIAN_FRONTEND=noninteractive
# sox: qwen_tts's python "sox" dependency shells out to it (as in .ci/run); ca-certificates: the
# IVR webhooks are https.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 sox ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# --- deps: the virtual environment, from the project's own files --------------------------------
FROM os AS deps

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv

# The torch/torchaudio pair exactly as run.sh's TORCH_PAIR (tests/deployment/test_dockerfile.py keeps the two
# equal), installed first: qwen_tts imports torchaudio at import time, and PyPI's torchaudio only
# loads beside a CUDA build of torch (PyPI's default torch wheel for Linux is one).
ARG TORCH_PAIR="torch==2.14.1 torchaudio==2.11.1"
ARG TORCH_INDEX_URL
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} $TORCH_PAIR

# The dependencies alone, read from pyproject.toml, before the code is copied: a code change then
# rebuilds from the `app` stage on and does not reinstall ~6 GB of wheels. The pair is named
# again so that pip can never swap it out.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt $TORCH_PAIR \
    && rm /tmp/requirements.txt

# --- weights: the model, fetched once at build time ---------------------------------------------
FROM deps AS weights

# A Qwen3-TTS repo holds the talker and its 12 Hz speech tokenizer (speech_tokenizer/) together.
# Pin MODEL_REVISION to a commit for a reproducible image.
ARG MODEL_ID
ARG MODEL_REVISION=main
RUN hf download "$MODEL_ID" --revision "$MODEL_REVISION" --local-dir "/models/$MODEL_ID" \
    && rm -rf "/models/$MODEL_ID/.cache" \
    && test -f "/models/$MODEL_ID/model.safetensors" \
    && test -f "/models/$MODEL_ID/speech_tokenizer/model.safetensors"

# --- app: the gateway itself ---------------------------------------------------------------------
FROM deps AS app

COPY README.md ./
COPY gateway ./gateway
# --no-deps: every dependency came from this same pyproject.toml above; `pip check` proves it.
# The import also compiles librosa's numba functions into its cache beside its sources (~20 CPU-s
# that every replica's start would otherwise spend; see run.sh).
RUN pip install --no-cache-dir --no-deps . \
    && pip check \
    && python -c "import qwen_tts, faster_qwen3_tts, torchaudio, gateway.app, librosa.core.audio, librosa.util.utils"

# --- prompts: the scripts' fixed sentences, rendered into the prompt cache -----------------------
FROM app AS prompts

ARG MODEL_ID
# Space-separated scripts (paths in the build context) whose cached sentences are rendered now.
ARG PROMPT_SCRIPTS="prompts/demo.yaml"
COPY --from=weights /models /models
COPY prompts ./prompts
# On the CPU: a build has no GPU. A cache key holds the model's fingerprint, a digest of the weight
# files at GATEWAY_MODEL (not the device), and the settings that change the audio, the dtype among
# them: rendering from the same /models path in the dtype the GPU runs (bfloat16, about twice as
# slow as float32 on a CPU) finds every prompt again at run time. HF_HUB_OFFLINE proves nothing
# is fetched. Scripts with a cloned voice need the voices registry, which is not in the image:
# their prompts render at start-up instead.
RUN set -e; \
    mkdir -p /var/cache/gateway/prompts; \
    for script in $PROMPT_SCRIPTS; do \
        gateway script validate "$script"; \
        HF_HUB_OFFLINE=1 GATEWAY_DTYPE=bfloat16 gateway script render "$script" \
            --model "/models/$MODEL_ID" \
            --device cpu --cache-dir /var/cache/gateway/prompts; \
    done

# --- runtime: what ships -------------------------------------------------------------------------
FROM os AS runtime

ARG MODEL_ID
ARG CUDA_IMAGE
ARG CUDA_DRIVER_MIN
# The IVR script the gateway runs (a path in the build context; render it via PROMPT_SCRIPTS).
ARG SCRIPT=prompts/demo.yaml

LABEL org.opencontainers.image.title="qwen3-tts-ivr-gateway" \
      org.opencontainers.image.description="Telephony IVR media gateway: Twilio Media Streams and SIP in, streaming Qwen3-TTS out." \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.qwen3-tts-ivr-gateway.model="$MODEL_ID" \
      io.qwen3-tts-ivr-gateway.cuda-image="$CUDA_IMAGE" \
      io.qwen3-tts-ivr-gateway.cuda-driver-min="$CUDA_DRIVER_MIN"

# A fixed numeric UID/GID, so orchestrators can check runAsNonRoot and volumes can be chowned.
RUN groupadd --gid 10001 gateway \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/gateway \
        --shell /usr/sbin/nologin gateway

# The venv and the weights stay root-owned (read-only to the gateway); it writes only the prompt
# cache (live sentences marked `cache: true`, prompts of re-registered voices) and the voices.
COPY --from=app /opt/venv /opt/venv
COPY --from=weights /models /models
COPY --from=prompts /src/prompts /app/prompts
COPY --from=prompts --chown=10001:10001 /var/cache/gateway /var/cache/gateway
RUN install -d -o 10001 -g 10001 /var/lib/gateway /var/lib/gateway/voices

WORKDIR /app
# Settings the image decides (gateway/config.py); the rest, secrets above all
# (GATEWAY_TWILIO_AUTH_TOKEN, GATEWAY_SIP_USERS), come from the environment at run time.
# GATEWAY_DEVICE=cuda: a replica without a GPU fails its load (/readyz says why) instead of
# serving callers at 0.15x real time. GATEWAY_DTYPE: the dtype the prompts were rendered in.
# HF_HUB_OFFLINE: the weights are here; never reach the hub.
ENV GATEWAY_MODEL=/models/$MODEL_ID \
    GATEWAY_SCRIPT=/app/$SCRIPT \
    GATEWAY_CACHE_DIR=/var/cache/gateway/prompts \
    GATEWAY_VOICES_DIR=/var/lib/gateway/voices \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8080 \
    GATEWAY_DEVICE=cuda \
    GATEWAY_DTYPE=bfloat16 \
    HF_HUB_OFFLINE=1

# HTTP (Twilio webhooks + Media Streams WebSocket, /healthz /readyz /metrics); SIP over UDP and the
# RTP range, used only when GATEWAY_SIP is set (docs/operators/sip.md).
EXPOSE 8080/tcp 5060/udp 20000-20999/udp

USER 10001:10001

# Liveness only (/readyz is the load balancer's). The start period covers model load, CUDA graph
# capture and the warm-up generation; python's urllib because the image has no curl.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GATEWAY_PORT', '8080') + '/healthz', timeout=4)"]

# Exec form: the gateway is PID 1 and gets SIGTERM itself, stops taking calls and drains the
# active ones for up to GATEWAY_DRAIN_GRACE_S (110 s), so give it a stop timeout above that
# (docker run --stop-timeout 120; ECS stopTimeout 120).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/venv/bin/gateway"]
CMD ["serve"]
