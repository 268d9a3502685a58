"""The server's configuration: one frozen record, validated once at the edge.

``trio-llm serve`` turns its flags into a ``ServerConfig``; everything below the
runtime trusts the values (a slot count is positive, a port fits in 16 bits), so no
actor re-checks them. Validation failures raise ``ConfigError`` with a message that
names the flag the user typed, because that is what they can fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import attrs

from trio_llm.errors import ConfigError

BackendKind = Literal["auto", "numpy", "vulkan"]
SleepMode = Literal["unload", "weights", "all"]

BACKEND_KINDS: tuple[str, ...] = ("auto", "numpy", "vulkan")
SLEEP_MODES: tuple[str, ...] = ("unload", "weights", "all")

#: the largest context we accept; beyond it a typo (an extra zero) is likelier than intent
MAX_CTX = 1 << 22


def _check(ok: bool, flag: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}: {problem}")


@attrs.frozen(kw_only=True)
class ServerConfig:
    """What ``trio-llm serve`` was asked to do. Field names follow llama-server's flags."""

    model: Path | None = None  # -m; None: the embedded demo model (default_model_path())
    alias: str | None = None  # -a: the model id reported by /v1/models
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int = 4096  # -c: total positions, split evenly over the slots; 0 = from model
    parallel: int = 1  # -np: slots (sequences decoded together)
    batch_size: int = 512  # -b: most tokens in one forward pass
    n_predict: int = -1  # -n: default tokens to predict; -1 = until EOG or context full
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0  # --typical: 1 = off
    # llama.cpp's other samplers (trio_llm.engine.sampling): defaults are llama-server's
    top_n_sigma: float = -1.0  # --top-n-sigma: -1 = off
    xtc_probability: float = 0.0  # --xtc-probability: 0 = off
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0  # --dynatemp-range: 0 = off
    dynatemp_exponent: float = 1.0
    dry_multiplier: float = 0.0  # --dry-multiplier: 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0: off
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    mirostat: int = 0  # 1: Mirostat, 2: Mirostat 2.0
    mirostat_tau: float = 5.0  # --mirostat-ent
    mirostat_eta: float = 0.1  # --mirostat-lr
    min_keep: int = 0
    adaptive_target: float = -1.0  # --adaptive-target: negative = off
    adaptive_decay: float = 0.9
    samplers: tuple[str, ...] | None = None  # --samplers / --sampler-seq; None: llama.cpp's order
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1  # -1: a fresh random seed per request
    api_key: str | None = None
    slot_save_path: Path | None = None  # --slot-save-path: where slot files go
    ctx_checkpoints: int = 32  # --ctx-checkpoints: recurrent-state copies per slot (hybrid models)
    checkpoint_min_step: int = 8192  # --checkpoint-min-step: positions between copies during prefill
    metrics: bool = False
    warmup: bool = True
    backend: BackendKind = "auto"
    n_gpu_layers: int | None = None  # -ngl: accepted for compatibility; see docs/server.md
    n_cpu_moe: float | None = None  # --n-cpu-moe: experts of this many layers in host memory (fractional)
    sleep_mode: SleepMode = "weights"
    vram_arena: Path | None = None
    arena_quantum: float = 5.0  # --arena-quantum: a waiter makes a busy holder yield after this; 0: only when idle
    arena_priority: int = 0  # --arena-priority: among queued waiters the higher goes first
    arena_budget: float | str | None = None  # --arena-budget: MiB, or "auto"; None: off (take turns)
    arena_pin: bool = False  # --arena-pin: never yield (needs --arena-budget)
    sleep_idle_seconds: float = -1.0  # -1: idle sleep off
    shutdown_timeout: float = 5.0  # SIGTERM: in-flight work gets this long, then is cancelled
    # llama-server's flags beyond the basics (trio_llm.server.flags has the whole table)
    threads: int = -1  # -t: BLAS threads of the numpy backend; -1: the library's default
    prio: int = 0  # --prio: -1 low .. 3 realtime
    ubatch_size: int = 512  # -ub: a forward pass takes at most min(-b, -ub) prompt tokens
    flash_attn: str = "auto"  # -fa on|off|auto: validated; one attention path exists
    cache_type_k: str = "f16"  # -ctk
    cache_type_v: str = "f16"  # -ctv
    fit: bool = True  # --fit: shrink the context the user did not set to fit the device
    fit_target: int = 1024  # --fit-target: MiB left free on the device
    fit_ctx: int = 4096  # --fit-ctx: the smallest context --fit chooses
    # --rope-* / --yarn-*: over the file's RoPE (trio_llm.models.llama.rope_scaling); 0 or
    # a negative value (llama-server's "not set"): the file's
    rope_scaling: str | None = None  # --rope-scaling none|linear|yarn
    rope_freq_base: float = 0.0  # --rope-freq-base
    rope_freq_scale: float = 0.0  # --rope-freq-scale, or 1 / --rope-scale
    yarn_orig_ctx: int = 0  # --yarn-orig-ctx
    yarn_ext_factor: float = -1.0  # --yarn-ext-factor
    yarn_attn_factor: float = -1.0  # --yarn-attn-factor
    yarn_beta_slow: float = -1.0  # --yarn-beta-slow
    yarn_beta_fast: float = -1.0  # --yarn-beta-fast
    kv_overrides: dict[str, Any] = attrs.field(factory=dict)  # --override-kv: metadata over the file's
    reverse_prompt: tuple[str, ...] = ()  # -r: the stop words of a request without any
    logit_bias: tuple[tuple[int, float], ...] = ()  # -l: the logit bias of a request without one
    hf_repo: str | None = None  # -hf REPO[:QUANT]: model from the cache at parse time, else downloaded at startup
    hf_file: str | None = None  # -hff
    mmproj: Path | None = None  # --mmproj: gemma3's vision projector (with -hf: found beside the model)
    mmproj_auto: bool = True  # --no-mmproj: -hf takes no projector
    model_url: str | None = None  # -mu: downloaded to ``model`` at startup (runtime.fetch_urls)
    mmproj_url: str | None = None  # --mmproj-url: downloaded to ``mmproj`` at startup
    hf_token: str | None = None  # -hft / HF_TOKEN: the downloads' bearer token
    offline: bool = False  # --offline: the downloads use the local file only
    device: str | None = None  # -dev VulkanN: the Vulkan device's index (None: the best one)
    api_prefix: str = ""  # --api-prefix: every route under this path
    special: bool = False  # -sp: control tokens' text in the answers
    lora: tuple[tuple[str, float], ...] = ()  # --lora / --lora-scaled: (adapter file, scale)
    control_vectors: tuple[tuple[str, float], ...] = ()  # --control-vector(-scaled): (file, scale), summed
    control_vector_layer_range: tuple[int, int] = (-1, -1)  # --control-vector-layer-range (0 or less: 1 / n_layer)
    ctx_shift: bool = False  # --context-shift: a full context drops tokens instead of ending the answer
    n_keep: int = 0  # --keep: the prompt tokens a context shift keeps (-1: all)
    static_path: Path | None = None  # --path: static files served before the routes
    media_path: Path | None = None  # --media-path: where file:// image URLs are read (None: refused)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    cache_prompt: bool = True  # --no-cache-prompt: the request field's default
    cache_reuse: int = 0  # --cache-reuse: the request field n_cache_reuse's default (KV shifting; 0: off)
    chat_template: str | None = None  # --chat-template(-file): Jinja source replacing the file's
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # --chat-template-kwargs
    reasoning: str = "auto"  # --reasoning on|off|auto: the template's enable_thinking
    reasoning_effort: str = "default"  # --reasoning-effort: the template's reasoning_effort
    reasoning_budget: int = -1  # --reasoning-budget: thinking tokens of a chat answer (-1: no limit)
    reasoning_budget_message: str = ""  # --reasoning-budget-message: written before the forced </think>
    reasoning_format: str = "auto"  # --reasoning-format
    grammar: str | None = None  # --grammar/-j: the default llguidance grammar of a request
    prefill_assistant: bool = True  # --no-prefill-assistant: a last assistant message is not continued
    tags: str | None = None
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True  # --tags: informational, shown in /v1/models
    skip_chat_parsing: bool = False  # --skip-chat-parsing: the answer is all content
    endpoint_slots: bool = True  # --slots / --no-slots
    endpoint_props: bool = False  # --props: POST /props allowed
    embeddings: bool = False  # --embeddings (--reranking too): an embedding-only server
    pooling: str = ""  # --pooling none|mean|cls|last|rank; "": the model's, else none
    embd_normalize: int = 2  # --embd-normalize: llama.cpp's common_embd_normalize kind
    spm_infill: bool = False  # --spm-infill: /infill's suffix before its prefix
    ssl_key_file: Path | None = None
    ssl_cert_file: Path | None = None
    log_file: Path | None = None
    log_disable: bool = False
    verbose: bool = False
    verbosity: int = 3
    set_by_user: frozenset[str] = frozenset()  # the fields a flag or variable set (for --fit)

    def __attrs_post_init__(self) -> None:
        _check(0 < self.port < 65536 or self.port == 0, "--port", f"{self.port} is not a TCP port")
        _check(bool(self.host), "--host", "empty host")
        _check(0 <= self.ctx_size <= MAX_CTX, "-c/--ctx-size", f"{self.ctx_size} is not in [0, {MAX_CTX}]")
        _check(1 <= self.parallel <= 256, "-np/--parallel", f"{self.parallel} is not in [1, 256]")
        _check(self.rope_freq_base >= 0, "--rope-freq-base", f"{self.rope_freq_base} is negative")
        _check(self.rope_freq_scale >= 0, "--rope-freq-scale", f"{self.rope_freq_scale} is negative")
        _check(self.yarn_orig_ctx >= 0, "--yarn-orig-ctx", f"{self.yarn_orig_ctx} is negative")
        _check(1 <= self.batch_size <= 1 << 16, "-b/--batch-size", f"{self.batch_size} is not in [1, 65536]")
        _check(self.n_predict >= -1, "-n/--n-predict", "must be -1 (unlimited) or >= 0")
        _check(0.0 <= self.temp <= 100.0, "--temp", f"{self.temp} is not in [0, 100]")
        _check(self.top_k >= 0, "--top-k", "must be >= 0 (0 disables it)")
        _check(0.0 <= self.top_p <= 1.0, "--top-p", f"{self.top_p} is not in [0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "--min-p", f"{self.min_p} is not in [0, 1]")
        _check(0.0 <= self.typical_p <= 1.0, "--typical", f"{self.typical_p} is not in [0, 1]")
        _check(0.0 <= self.xtc_probability <= 1.0, "--xtc-probability", f"{self.xtc_probability} is not in [0, 1]")
        _check(0.0 <= self.xtc_threshold <= 1.0, "--xtc-threshold", f"{self.xtc_threshold} is not in [0, 1]")
        _check(self.dry_multiplier >= 0.0, "--dry-multiplier", f"{self.dry_multiplier} is negative")
        _check(self.dry_allowed_length >= 0, "--dry-allowed-length", f"{self.dry_allowed_length} is negative")
        _check(self.mirostat in (0, 1, 2), "--mirostat", f"{self.mirostat} is not 0, 1 or 2")
        _check(self.min_keep >= 0, "--min-keep", f"{self.min_keep} is negative")
        _check(self.adaptive_target <= 1.0, "--adaptive-target", f"{self.adaptive_target} is above 1")
        _check(0.0 <= self.adaptive_decay <= 0.99, "--adaptive-decay", f"{self.adaptive_decay} is not in [0, 0.99]")
        _check(0.0 < self.repeat_penalty <= 100.0, "--repeat-penalty", "must be in (0, 100]")
        _check(self.repeat_last_n >= -1, "--repeat-last-n", "must be >= -1")
        _check(-1 <= self.seed < 1 << 64, "--seed", "must be -1 (random) or a 64-bit unsigned integer")
        _check(self.backend in BACKEND_KINDS, "--backend", f"{self.backend!r} is not one of {BACKEND_KINDS}")
        _check(self.media_path is None or Path(self.media_path).is_dir(), "--media-path",
               f"{self.media_path} is not a directory")
        _check(self.sleep_mode in SLEEP_MODES, "--sleep-mode", f"{self.sleep_mode!r} is not one of {SLEEP_MODES}")
        _check(
            self.sleep_idle_seconds == -1 or self.sleep_idle_seconds >= 0,
            "--sleep-idle-seconds",
            "must be -1 (off) or >= 0",
        )
        _check(math.isfinite(self.arena_quantum) and self.arena_quantum >= 0, "--arena-quantum",
               f"{self.arena_quantum} is not a number of seconds >= 0 (0: yield only when idle)")
        _check(-100 <= self.arena_priority <= 100, "--arena-priority", f"{self.arena_priority} is not in [-100, 100]")
        if self.arena_budget is not None:
            _check(self.arena_budget == "auto" or (isinstance(self.arena_budget, float | int)
                                                   and math.isfinite(self.arena_budget) and self.arena_budget > 0),
                   "--arena-budget", f"{self.arena_budget!r} is not a number of MiB > 0 or auto")
            _check(self.vram_arena is not None, "--arena-budget", "needs --vram-arena (or LLAMA_VRAM_ARENA)")
        if self.arena_pin:
            _check(self.arena_budget is not None, "--arena-pin",
                   "needs --arena-budget (a pinned server is co-resident beside the others)")
        _check(self.shutdown_timeout >= 0, "shutdown timeout", "must be >= 0")
        _check(self.api_key is None or bool(self.api_key), "--api-key", "empty key")
        _check(self.threads == -1 or self.threads >= 1, "-t/--threads", f"{self.threads} is not -1 or >= 1")
        _check(1 <= self.ubatch_size <= 1 << 16, "-ub/--ubatch-size", f"{self.ubatch_size} is not in [1, 65536]")
        _check(self.fit_ctx >= 1, "-fitc/--fit-ctx", "must be >= 1")
        _check(-2.0 <= self.presence_penalty <= 2.0, "--presence-penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "--frequency-penalty", "must be in [-2, 2]")
        _check(all(h and not h.endswith(".sock") for h in self.hosts), "--host",
               f"{self.host!r}: TCP addresses only (UNIX sockets are not supported)")
        _check((self.ssl_key_file is None) == (self.ssl_cert_file is None), "--ssl-key-file/--ssl-cert-file",
               "give both or neither")
        if self.model is not None:
            # existence is checked by the loader, which can say what is wrong with the file
            _check(str(self.model) != "", "-m/--model", "empty path")

    @property
    def hosts(self) -> tuple[str, ...]:
        """--host takes several addresses, comma-separated (as llama-server)."""
        return tuple(h.strip() for h in self.host.split(","))

    def cors_allows(self, origin: str) -> bool:
        """--cors-origins: * (any, echoed), localhost (only a loopback origin), or a list."""
        if self.cors_origins == "*":
            return True
        allowed = {o.strip() for o in self.cors_origins.split(",")}
        if "localhost" in allowed:
            from urllib.parse import urlsplit

            try:
                host = urlsplit(origin).hostname
            except ValueError:
                host = None
            if host in ("localhost", "127.0.0.1", "::1"):
                return True
        return origin in allowed

    @property
    def api_keys(self) -> frozenset[str]:
        """--api-key takes several keys, comma-separated (as llama-server)."""
        return frozenset(k for k in (self.api_key or "").split(",") if k)

    @property
    def model_ids(self) -> tuple[str, ...]:
        """--alias takes several names, comma-separated; as llama-server (a std::set)
        they are kept sorted and the first is the id."""
        return tuple(sorted({a.strip() for a in (self.alias or "").split(",") if a.strip()}))

    @property
    def n_batch(self) -> int:
        """Prompt tokens per forward pass: llama.cpp caps the logical batch by the physical."""
        return min(self.batch_size, self.ubatch_size)

    def template_kwargs(self) -> dict[str, Any]:
        """Template variables from the flags: --reasoning's enable_thinking (always
        given, as llama-server does: true unless --reasoning off) and --reasoning-effort,
        under --chat-template-kwargs (which wins)."""
        out: dict[str, Any] = {"enable_thinking": self.reasoning != "off"}
        if self.reasoning_effort != "default":
            out["reasoning_effort"] = self.reasoning_effort
        return out | self.chat_template_kwargs

    def model_overrides(self) -> dict[str, Any]:
        """What the command line sets over the file (``load_gguf``'s ``overrides``): the
        --rope-* / --yarn-* values that were given, --override-kv's keys ("kv"), the
        LoRA adapters ("lora") and the control vectors ("cvec", "cvec_range")."""
        out: dict[str, Any] = {}
        for name in ("rope_scaling", "rope_freq_base", "rope_freq_scale", "yarn_orig_ctx"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        for name in ("yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow", "yarn_beta_fast"):
            if getattr(self, name) >= 0:
                out[name] = getattr(self, name)
        if self.kv_overrides:
            out["kv"] = dict(self.kv_overrides)
        if self.lora:
            out["lora"] = list(self.lora)
        if self.control_vectors:
            out["cvec"] = list(self.control_vectors)
            out["cvec_range"] = self.control_vector_layer_range
        return out

    def slot_ctx(self, n_ctx_train: int) -> int:
        """Positions per slot: ``-c`` split evenly over ``-np``, as llama-server does."""
        total = self.ctx_size or n_ctx_train
        return max(1, total // self.parallel)

    def sampling_defaults(self) -> dict[str, Any]:
        """The server-wide sampler settings a request starts from (``/props`` shows them)."""
        return {
            "temperature": self.temp,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "typical_p": self.typical_p,
            "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n,
            "seed": self.seed,
            "n_predict": self.n_predict,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "top_n_sigma": self.top_n_sigma,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
            "dynatemp_range": self.dynatemp_range,
            "dynatemp_exponent": self.dynatemp_exponent,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "dry_sequence_breakers": list(self.dry_sequence_breakers),
            "mirostat": self.mirostat,
            "mirostat_tau": self.mirostat_tau,
            "mirostat_eta": self.mirostat_eta,
            "min_keep": self.min_keep,
            "adaptive_target": self.adaptive_target,
            "adaptive_decay": self.adaptive_decay,
        }
