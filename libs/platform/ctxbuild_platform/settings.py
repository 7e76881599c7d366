"""Settings shared by every service; each service subclasses with its own fields (one BaseSettings each)."""

from __future__ import annotations

from pydantic import AnyUrl, Field, NatsDsn
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CTX_", env_file=None, extra="ignore")

    service_name: str = Field(description="logical service name (resource attribute, log field)")
    nats_url: NatsDsn = Field(description="NATS server URL")
    nats_inbox_prefix: str = Field(
        "_INBOX", pattern=r"^_INBOX(\.[A-Za-z0-9_-]+)*$",
        description="prefix of this process's reply inboxes; with per-service NATS users (k8s components/nats-auth) "
                    "`_INBOX.<user>`, the only inboxes that user may subscribe to, so no service reads another's "
                    "replies (it stays under `_INBOX.`: the blob store's transfer accepts only inboxes there)")
    http_port: int = Field(8080, description="health/metrics HTTP port")
    http_host: str = "127.0.0.1"
    log_level: str = "INFO"
    otel_exporter_otlp_endpoint: AnyUrl | None = Field(
        None, description="OTLP/HTTP traces endpoint; unset = spans carry trace ids (propagated, logged) but are not "
                          "recorded")
    drain_timeout_s: float = Field(10.0, description="SIGTERM: time to finish in-flight requests")
    max_workers: int = Field(16, description="concurrent handlers per subscriber")
    startup_timeout_s: float = Field(60.0, description="how long start-up waits for its dependencies")
    request_timeout_s: float = Field(10.0, description="default timeout for requests to other services")
    claims_bucket: str = Field("CTX_CLAIMS", description="JetStream Object Store bucket for claim-checked payloads")
    claims_max_age_s: float = Field(3600.0, gt=0, description="TTL of a claim (readers delete point-to-point "
                                                             "claims at once; the TTL is the backstop)")
    claims_replicas: int = Field(1, ge=1, le=5, description="replicas of the claim bucket when this process "
                                                           "creates it (3 on a three-node JetStream cluster)")
    message_inline_max_bytes: int | None = Field(
        None, ge=0, description="largest message body sent inline; unset = the server's max_payload minus headroom")
    claims_timeout_s: float = Field(30.0, gt=0, description="one claim store operation")
