"""The HTTP server's own settings (the engine's are ``EngineConfig``), with the limits that keep one client's
request from hurting the others: body size, prompt size, how long sending a request may take, and the shutdown
grace period."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

# A prompt of more characters than this many per context token could never fit: tokens of Llama-family vocabularies
# rarely exceed 16 characters. The limit bounds tokenization work (which grows with the text) before it starts.
PROMPT_CHARS_PER_TOKEN = 32
# Request bodies: at least 4 MiB, and room for a longest prompt as a JSON client may write it (Python's json.dumps
# escapes every non-ASCII character to 6 bytes, \uXXXX) plus 1 MiB of other fields, so --max-prompt-chars (or a long
# --max-model-len) is never cut short by the body limit first
MIN_BODY_BYTES = 4 * 2**20
BODY_BYTES_PER_PROMPT_CHAR = 6
BODY_BYTES_BESIDE_PROMPT = 2**20


# The context served when --max-model-len is unset, unless the model allows less (admission reserves a request's
# worst-case KV, so a longer default would shrink the batch the pool holds). One rule for the CLI and for the ingress
# of a Ray deployment, which loads no model and sizes request bodies for it.
DEFAULT_MAX_MODEL_LEN = 2048


def context_len(max_model_len: int | None, *model_limits: int | None) -> int:
    """``max_model_len`` if set, else ``DEFAULT_MAX_MODEL_LEN`` or the least of the model's limits below it."""
    return max_model_len or min([DEFAULT_MAX_MODEL_LEN, *(m for m in model_limits if m)])


def prompt_chars_limit(max_prompt_chars: int | None, max_model_len: int) -> int:
    """The longest prompt in characters: ``max_prompt_chars`` if set, else ``PROMPT_CHARS_PER_TOKEN`` a token."""
    return max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


def body_bytes_limit(max_body_bytes: int | None, max_prompt_chars: int | None, max_model_len: int) -> int:
    """The largest request body: ``max_body_bytes`` if set, else the prompt limit's JSON size (at least 4 MiB)."""
    if max_body_bytes is not None:
        return max_body_bytes
    chars = prompt_chars_limit(max_prompt_chars, max_model_len)
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_PROMPT_CHAR * chars + BODY_BYTES_BESIDE_PROMPT)


DEFAULT_TENANT_HEADER = "X-Tenant-Id"
MAX_TENANT_CHARS = 256  # a tenant id is a key the fairness policy keeps state under: bounded, printable ASCII
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")  # an RFC 9110 token, of sane length


def check_header_name(name: str) -> str:
    """``name`` if it can be an HTTP header name (RFC 9110 token characters, at most 64), else ValueError."""
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an HTTP header name (1-64 letters, digits and !#$%&'*+.^_`|~-)")
    if name.lower() in ("authorization", "content-length", "content-type", "host"):
        raise ValueError(f"{name!r} is a standard header with its own meaning; pick another for the tenant")
    return name


def check_api_key(key: str | None) -> None:
    """Refuse a key that would silently disable authentication (empty) or could never match (HTTP strips the
    whitespace around header values)."""
    if key is None:
        return
    if not key.strip():
        raise ValueError("the API key is empty: give a real key, or leave --api-key (and $SLORA_JAX_API_KEY) unset "
                         "to serve without authentication")
    if key != key.strip():
        raise ValueError("the API key starts or ends with whitespace, which no client can send")


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    allowed_adapter_dirs: tuple[Path, ...] = ()  # runtime loads only from below these (resolved) directories
    metrics_timeout_s: float = 5.0
    admin_timeout_s: float = 60.0
    max_body_bytes: int | None = None  # larger request bodies get 413; None: body_bytes_limit's default
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN per token of the context
    header_timeout_s: float = 10.0  # from a request's first byte (or the connection's start) to its last header
    body_timeout_s: float = 30.0  # from the last header to the last byte of the body (408 after)
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long running requests may take to finish
    tokenizer_threads: int = 4  # tokenization and chat templating run here, never on the event loop
    tenant_header: str = DEFAULT_TENANT_HEADER  # request header naming whose service a request counts towards
    # how long a thread may hold the GIL while another waits for it (``sys.setswitchinterval``; None: Python's 5 ms).
    # The engine thread gives the GIL up at every device wait; with the event loop busy streaming it then waited up
    # to the whole interval each time to get it back, so the step loop slowed with the HTTP load
    gil_switch_interval_s: float | None = 0.0005
    # hand a step's outputs to the event loop once the next step is queued on the device (the engine thread then
    # waits with the GIL released), not while the engine thread schedules and dispatches that step: the loop's
    # streaming then slows the step loop less, and each token reaches its client one step's host time later. Off
    # by default: on CPU the gain could not be shown (2026-12-01); the H200 A/B in benchmarks/NOTES.md decides
    defer_hand_over: bool = False
    # the engine runs in a child process (``--engine-process``; engine_process / engine_client), so the HTTP side and
    # the step loop each have a GIL of their own. Set by the CLI, which starts the process; informative here. Off by
    # default until the H200 A/B (benchmarks/NOTES.md, 2026-12-01 session 7) shows the gain
    engine_process: bool = False

    def __post_init__(self) -> None:
        check_api_key(self.api_key)
        check_header_name(self.tenant_header)
        for name in ("max_body_bytes", "header_timeout_s", "body_timeout_s", "tokenizer_threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_prompt_chars is not None and self.max_prompt_chars <= 0:
            raise ValueError(f"max_prompt_chars must be positive, got {self.max_prompt_chars!r}")
        if self.gil_switch_interval_s is not None and not 0 < self.gil_switch_interval_s <= 0.1:
            raise ValueError(f"gil_switch_interval_s must be in (0, 0.1], got {self.gil_switch_interval_s!r}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")

    def prompt_chars_limit(self, max_model_len: int) -> int:
        return prompt_chars_limit(self.max_prompt_chars, max_model_len)

    def body_bytes_limit(self, max_model_len: int) -> int:
        return body_bytes_limit(self.max_body_bytes, self.max_prompt_chars, max_model_len)
