# kafka-quota-proxy: mount a config file at /etc/kafka-quota-proxy/config.yaml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package needs (tests, bench and .venv stay out of the image).
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY proxy ./proxy
COPY quotas ./quotas
COPY config ./config
COPY pipeline ./pipeline
COPY usage ./usage
RUN pip install . \
 && rm -rf /src \
 && useradd --system --uid 10001 --no-create-home kqp \
 && mkdir -p /etc/kafka-quota-proxy /var/lib/kafka-quota-proxy/usage \
 && chown kqp /var/lib/kafka-quota-proxy/usage
COPY deploy/proxy-config.yaml /etc/kafka-quota-proxy/config.yaml

WORKDIR /
USER kqp
# bootstrap, broker ports (broker_port_base + node id), /metrics and /healthz
EXPOSE 19092 19100-19109 9404
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9404/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["kafka-quota-proxy", "run", "--config", "/etc/kafka-quota-proxy/config.yaml"]
