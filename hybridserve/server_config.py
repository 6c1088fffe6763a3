"""ServerConfig: the HTTP side of `hybridserve serve` (address, key, limits, timeouts), apart
from the engine's EngineConfig. Each field's help text is its CLI flag's help
(max_body_mb -> --max-body-mb), as for the engine settings."""
from __future__ import annotations

from dataclasses import dataclass, field

ANY_HOST = ("0.0.0.0", "::", "")  # bound to every interface: the Host header cannot be checked
LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={
        "help": "address to listen on (0.0.0.0: all interfaces; then also set --api-key)"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on every /v1 route (default: $HYBRIDSERVE_API_KEY; unset: "
                "no key)"})
    allowed_hosts: str | None = field(default=None, metadata={
        "help": "comma-separated host names the Host header may carry (against DNS rebinding), '*' for any; "
                "unset: the --host address and localhost, 127.0.0.1, ::1 (any host when bound to 0.0.0.0 or ::)"})
    chat_max_tokens: int = field(default=256, metadata={
        "help": "max_tokens of a chat request that sets neither max_completion_tokens nor max_tokens"})
    max_body_mb: float = field(default=8.0, metadata={
        "help": "largest request body in MiB (413 above it, refused before it is read)"})
    max_connections: int = field(default=1000, metadata={
        "help": "open connections at most; one beyond it is closed at once (the open-file limit is raised to "
                "fit them)"})
    keep_alive_s: int = field(default=5, metadata={"help": "an idle keep-alive connection is closed after this"})
    request_timeout_s: float = field(default=30.0, metadata={
        "help": "a connection that has not sent a whole request (head and body) this long after it opened or "
                "after its previous response is closed (slow or idle clients)"})
    shutdown_grace_s: float = field(default=10.0, metadata={
        "help": "after SIGTERM / SIGINT, open requests get this long to finish; then each gets an error "
                "(stream: an error event and [DONE]) and the server exits"})
    stream_backlog: int = field(default=1024, metadata={
        "help": "outputs a stream's reader may fall behind before its request is aborted with an error"})
    engine_process: bool = field(default=False, metadata={
        "help": "run the engine in its own process (the server keeps the tokenizer; an engine that crashes "
                "leaves the server answering 503); default: on a thread of the server"})
    docs: bool = field(default=False, metadata={
        "help": "serve the interactive API docs at /docs (their page loads scripts from a CDN); /openapi.json "
                "is always served"})

    def __post_init__(self):
        positive = ("port", "chat_max_tokens", "max_body_mb", "max_connections", "keep_alive_s", "request_timeout_s",
                    "stream_backlog")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def host_names(self) -> frozenset[str] | None:
        """The host names a request's Host header may carry (lower case, no port); None: any."""
        if self.allowed_hosts is not None:
            names = {h.strip().lower().strip("[]") for h in self.allowed_hosts.split(",") if h.strip()}
            return None if "*" in names else frozenset(names)
        if self.host in ANY_HOST:
            return None
        return frozenset({self.host.lower().strip("[]"), *LOOPBACK})
