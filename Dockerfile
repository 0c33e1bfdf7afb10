FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY asyncflow ./asyncflow
COPY shared ./shared
COPY oss_api ./oss_api
COPY modules ./modules
COPY flows.yaml ./
RUN pip install --no-cache-dir . && useradd --create-home asyncflow
USER asyncflow
ENV ASYNCFLOW_FLOWS=/app/flows.yaml ASYNCFLOW_HOME=/home/asyncflow/.asyncflow
EXPOSE 8000
CMD ["asyncflow", "api", "--host", "0.0.0.0"]
