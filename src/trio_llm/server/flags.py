"""llama-server's command line, flag for flag: the table and its parser.

Every flag llama-server accepts (its ``--help`` of October 2026, from llama.cpp's
``common/arg.cpp``: short and long names, negative spellings, ``LLAMA_ARG_*``
variables) is one ``Flag`` row of ``FLAGS``, of one of three kinds:

- ``works``: it does here what it does there;
- ``noop``: accepted and validated, with no effect, because what it tunes does not
  exist here (memory mapping, HTTP threads, a web UI...); its ``help`` says why;
- ``refused``: a feature not built (LoRA, a projector, a draft model...): one line
  naming the flag and why, exit status 2.

A ``works`` or ``noop`` flag may still refuse one *value* (``--spec-type draft-mtp``,
``-ctk iq4_nl``, ``--dry-multiplier 0.8``): what it asks for is then not silently
dropped. ``docs/server.md`` shows this table (``markdown_table``; a test keeps the
two equal).

The parser is llama.cpp's, not argparse: an argument is looked up whole (no prefix
matching, no bundling of short options, so ``-ctk`` is never ``-c tk``); after a
leading ``--`` underscores read as dashes (``--presence_penalty``); variables are
read first and a flag on the command line then wins; ``LLAMA_ARG_NO_X`` turns a
switch with negative spellings off; a repeated flag keeps its last value (those whose
help says "repeats add up" append). One extension: ``--name=value`` for a flag that takes a value.

A preset (``--fim-qwen-7b-default``...) is llama.cpp's too: a switch whose handler sets
several values when the parser reaches it, so what it sets replaces a variable or an
earlier flag, and a later flag replaces it; what it does not set (``-hff`` for the
presets without a file) is left as it was.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

Kind = Literal["works", "noop", "refused"]
KINDS: tuple[Kind, ...] = ("works", "noop", "refused")

#: KV cache types llama-server accepts for -ctk/-ctv
LLAMA_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: those this server knows how to size and store
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


class UsageError(Exception):
    """A flag the parser cannot accept: one line on stderr, exit status 2."""


class FlagValueError(ValueError):
    """A converter's complaint about a value; the parser prefixes the flag."""


@attrs.frozen
class Flag:
    """One row of the table: names, what it takes, what happens to it."""

    names: tuple[str, ...]
    kind: Kind
    help: str
    value: str | None = None  # the value's hint; None: a switch
    neg: tuple[str, ...] = ()  # a switch's negative spellings
    env: str | None = None
    dest: str | None = None  # the ServerConfig field (or a parser key starting "_")
    conv: Callable[..., Any] = str  # the value's text (each of them, with n_values > 1) -> the value
    refuse: Callable[[Any], str | None] | None = None  # why this value is not served
    #: the values the flag takes (--control-vector-layer-range START END: 2); no variable
    n_values: int = 1
    #: a preset switch (--fim-qwen-7b-default...): (dest, value) pairs it sets where it
    #: stands on the line, as llama.cpp's handler assigns them
    preset: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return "/".join(self.names[:2])


# ---------------------------------------------------------------------------
# value converters (a FlagValueError names what was expected)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FlagValueError(f"invalid value {text!r} (an integer)") from None


def _nonneg(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise FlagValueError(f"invalid value {text!r} (a count: 0 or more)")
    return n


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FlagValueError(f"invalid value {text!r} (a number)") from None


def _budget(text: str) -> float | str:
    """--arena-budget: a number of MiB > 0, or "auto"."""
    if text == "auto":
        return text
    try:
        mib = float(text)
    except ValueError:
        mib = math.nan
    if not (math.isfinite(mib) and mib > 0):
        raise FlagValueError(f"invalid value {text!r} (a number of MiB > 0, or auto)")
    return mib


def _inverse(text: str) -> float:
    """--rope-scale N: llama-server stores 1 / N as the frequency scale."""
    value = _float(text)
    if value <= 0:
        raise FlagValueError(f"invalid value {text!r} (a positive number)")
    return 1.0 / value


#: --dry-sequence-breaker none: clears the breakers given before it (to_config)
_NONE = "\x00none"


def _samplers(value: str | list[str]) -> tuple[str, ...]:
    from trio_llm.engine.sampling import sampler_names
    from trio_llm.errors import InvalidRequest

    try:
        return sampler_names(value)
    except InvalidRequest as exc:
        raise FlagValueError(str(exc)) from None


def _think_budget(text: str) -> int:
    n = _int(text)
    if n < -1:
        raise FlagValueError(f"invalid value {text!r} (-1, or a count of tokens)")
    return n


def _device(text: str) -> str:
    """-dev: llama.cpp's backend device names; "none" keeps everything on the CPU."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return "none"
    if len(names) != 1:
        raise FlagValueError(f"{text!r}: " + _ONE_DEVICE + ": name one device (VulkanN) or none")
    m = re.fullmatch(r"(?i)vulkan(\d+)", names[0])
    if m is None:
        raise FlagValueError(f"unknown device {names[0]!r} (VulkanN as --list-devices shows, or none)")
    return m[1]


def _dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise FlagValueError(f"static assets path not found: {text}")
    return path


def _prefix(text: str) -> str:
    prefix = text.rstrip("/")
    if prefix and not prefix.startswith("/"):
        raise FlagValueError(f"invalid value {text!r} (a path that starts with /)")
    return prefix


def _scaled_files(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for item in text.split(","):
        name, sep, scale = item.rpartition(":")
        try:
            out.append((name, float(scale)))
        except ValueError:
            sep = ""
        if not sep or not name:
            raise FlagValueError(f"invalid value {item!r} (FNAME:SCALE)")
    return tuple(out)


def _layer_range(start: str, end: str) -> tuple[int, int]:
    """--control-vector-layer-range START END, inclusive (0 or less: the first or last)."""
    return _int(start), _int(end)


def _one(text: str) -> tuple[str, ...]:
    """A flag that appends (``_apply`` joins tuples): -r."""
    return (text,)


def _bias(text: str) -> tuple[tuple[int, float], ...]:
    """-l: llama.cpp's ``TOKEN_ID(+/-)BIAS``, one pair per flag (repeats append)."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*([0-9.eE+-]+|inf)\s*", text)
    try:
        if m is None:
            raise ValueError
        bias = float(m[3]) * (-1.0 if m[2] == "-" else 1.0)
        if math.isnan(bias):
            raise ValueError
    except ValueError:
        raise FlagValueError(f"invalid value {text!r} (TOKEN_ID+BIAS or TOKEN_ID-BIAS)") from None
    return ((int(m[1]), bias),)


def _kv_override(text: str) -> dict[str, bool | int | float | str]:
    """--override-kv: llama.cpp's ``string_parse_kv_override`` over a comma-separated row
    (quotes protect commas): ``KEY=int:N``, ``float:X``, ``bool:true|false``, ``str:S``."""
    out: dict[str, bool | int | float | str] = {}
    for item in next(csv.reader([text], skipinitialspace=True), []):
        key, sep, typed = item.partition("=")
        kind, colon, raw = typed.partition(":")
        if not sep or not key or len(key) >= 128 or not colon:
            raise FlagValueError(f"malformed override {item!r} (KEY=TYPE:VALUE)")
        try:
            if kind == "int":
                out[key] = int(raw)
            elif kind == "float":
                out[key] = float(raw)
            elif kind == "bool" and raw in ("true", "false"):
                out[key] = raw == "true"
            elif kind == "str" and len(raw) <= 127:
                out[key] = raw
            else:
                raise ValueError
        except ValueError:
            raise FlagValueError(f"invalid value in override {item!r} (types: int, float, bool, str; a str of "
                                 "127 characters at most)") from None
    return out


def _choice(*choices: str) -> Callable[[str], str]:
    def conv(text: str) -> str:
        if text not in choices:
            raise FlagValueError(f"invalid value {text!r} (one of {', '.join(choices)})")
        return text

    return conv


TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")


def _bool(text: str) -> bool:
    """llama.cpp's is_truthy / is_falsey."""
    if text in TRUTHY:
        return True
    if text in FALSEY:
        return False
    raise FlagValueError(f"invalid value {text!r} (on/off, true/false, 1/0, enabled/disabled)")


def _on_off_auto(text: str) -> str:
    if text in TRUTHY:
        return "on"
    if text in FALSEY:
        return "off"
    if text in ("auto", "-1"):
        return "auto"
    raise FlagValueError(f"invalid value {text!r} (on, off or auto)")


def _gpu_layers(text: str) -> int:
    """-ngl takes a count, or "auto"/"all" (both: everything, as here)."""
    if text in ("auto", "all"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise FlagValueError(f"invalid value {text!r} (a number, 'auto' or 'all')") from None


def _cache_type(text: str) -> str:
    if text not in LLAMA_CACHE_TYPES:
        raise FlagValueError(f"unsupported cache type {text!r} (one of {', '.join(LLAMA_CACHE_TYPES)})")
    return text


def _no_iq4_nl(value: str) -> str | None:
    if value not in CACHE_TYPES:
        return f"cache type {value!r} is not supported here (one of {', '.join(CACHE_TYPES)})"
    return None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FlagValueError(f"not valid JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise FlagValueError(f"must be a JSON object, not {text!r}")
    return value


def _read_text(text: str) -> str:
    try:
        return Path(text).read_text(encoding="utf-8")
    except OSError as exc:
        raise FlagValueError(f"cannot read {text!r}: {exc.strerror or exc}") from None


def _api_key_file(text: str) -> str:
    """One key per line; ``#`` starts a comment line (as llama-server)."""
    keys = [ln.strip() for ln in _read_text(text).splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise FlagValueError(f"{text!r} holds no key")
    return ",".join(keys)


def _prio(text: str) -> int:
    value = _int(text)
    if not -1 <= value <= 3:
        raise FlagValueError(f"invalid value {value} (-1 low, 0 normal, 1 medium, 2 high, 3 realtime)")
    return value


def _prio_batch(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 3:
        raise FlagValueError(f"invalid value {value} (0 normal, 1 medium, 2 high, 3 realtime)")
    return value


def _fit_target(text: str) -> int:
    """MiB per device, comma-separated; one device here, so one value (the first)."""
    parts = [p for p in text.split(",") if p]
    if not parts:
        raise FlagValueError(f"invalid value {text!r} (MiB, or a comma-separated list)")
    values = [_int(p) for p in parts]
    if any(v < 0 for v in values):
        raise FlagValueError(f"invalid value {text!r} (MiB must be >= 0)")
    return values[0]


def _hf_repo(text: str) -> str:
    repo = text.split(":")[0]
    if len(repo.split("/")) != 2 or not all(repo.split("/")):
        raise FlagValueError(f"invalid HF repo {text!r}, expected <user>/<model>[:quant]")
    return text


def _template(text: str) -> str:
    """Jinja source, or the name of a built-in template (its source then)."""
    from trio_llm.model.builtin_templates import BUILTIN_TEMPLATES

    if text in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[text]
    if "{{" in text or "{%" in text:
        return text
    raise FlagValueError(
        f"{text!r} is neither Jinja source nor a built-in template here ({', '.join(sorted(BUILTIN_TEMPLATES))})"
    )


def _gbnf(text: str) -> str:
    from trio_llm.engine.constraint import from_gbnf
    from trio_llm.errors import InvalidRequest

    try:
        return from_gbnf(text)
    except InvalidRequest as exc:
        raise FlagValueError(str(exc).replace("'grammar' ", "")) from None


def _schema(text: str) -> str:
    from trio_llm.engine.constraint import from_json_schema
    from trio_llm.errors import InvalidRequest

    try:
        return from_json_schema(json.loads(text))
    except (json.JSONDecodeError, InvalidRequest) as exc:
        raise FlagValueError(f"not a usable JSON schema: {exc}") from None


def _not(default: Any, why: str) -> Callable[[Any], str | None]:
    """Refuse every value but ``default`` (the one that asks for nothing)."""
    return lambda value: None if value == default else why


# ---------------------------------------------------------------------------
# the table


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def W(names: str, help: str, **kw: Any) -> Flag:
    return Flag(_names(names), "works", help, neg=_names(kw.pop("neg", "")), **kw)


def N(names: str, help: str, **kw: Any) -> Flag:
    return Flag(_names(names), "noop", help, neg=_names(kw.pop("neg", "")), **kw)


def R(names: str, help: str, **kw: Any) -> Flag:
    return Flag(_names(names), "refused", help, neg=_names(kw.pop("neg", "")), **kw)


def P(names: str, model: str, *settings: tuple[str, str, Any], also: str = "") -> Flag:
    """One of llama-server's preset switches: ``settings`` are (the flag it stands for,
    its dest, the value) in the handler's order; the help shows them as that line."""
    line = " ".join(flag if value is True else f"{flag} {value:g}" if isinstance(value, float) else
                    f"{flag} {value}" for flag, _dest, value in settings)
    return Flag(_names(names), "works", f"{model}, downloaded as -hf: {line}{also}; " + _PRESET,
                preset=tuple((dest, value) for _flag, dest, value in settings))


_PRESET = "a flag after it overrides what it sets, one before it is overridden (as llama-server)"
_FIM = (("--port", "port", 8012), ("-ub", "ubatch_size", 1024), ("-b", "batch_size", 1024), ("-c", "ctx_size", 0),
        ("--cache-reuse", "cache_reuse", 256))
_GPT_OSS = (("--port", "port", 8013), ("-ub", "ubatch_size", 2048), ("-b", "batch_size", 32768),
            ("-np", "parallel", 2), ("-c", "ctx_size", 262144), ("--temp", "temp", 1.0), ("--top-p", "top_p", 1.0),
            ("--top-k", "top_k", 0), ("--min-p", "min_p", 0.01))
_CTX0 = " (-c 0: the model's context, which --fit may lower, as llama-server's)"
_JINJA = " --jinja (a no-op: always here)"
_NO_GPT_OSS = "; gpt-oss is not an architecture this build runs: the start ends after the download, in one line"
_ONE_DEVICE = "one device runs the whole model"
_NO_MMAP = "weights are read once into device (or numpy) memory: no mapping or locking to tune"
_NO_DRAFT = "speculative decoding is not implemented (no draft model)"
_NO_VISION = "no video input: images only (gemma3's projector)"
_FIXED_SIZE = "gemma3's projector makes a fixed number of tokens an image (as in llama-server, for fixed-size encoders)"
_LATER = "not implemented yet"

FLAGS: tuple[Flag, ...] = (
    # -- common ---------------------------------------------------------------------
    W("-h --help --usage", "print usage and exit", dest="_help"),
    W("--version", "print the version and exit", dest="_version"),
    W("-cl --cache-list", "print the models of the local Hugging Face cache (REPO:TAG, as -hf takes them) "
      "and exit", dest="_cache_list"),
    W("--completion-bash", "print a bash completion script for trio-llm serve (and llama-server) and exit",
      dest="_completion_bash"),
    W("-t --threads", "CPU threads of the numpy backend's BLAS (the Vulkan backend computes on the device)",
      value="N", env="LLAMA_ARG_THREADS", dest="threads", conv=_int),
    N("-tb --threads-batch", "one thread count serves prompt and generation here (-t)", value="N", conv=_int),
    N("-C --cpu-mask", "CPU affinity is left to the system", value="M"),
    N("-Cr --cpu-range", "CPU affinity is left to the system", value="lo-hi"),
    N("--cpu-strict", "CPU affinity is left to the system", value="<0|1>", conv=_int),
    W("--prio", "process priority as llama-server sets it: nice 5, 0, -5, -10, -20 for -1..3 "
      "(a warning when the system refuses)", value="N", dest="prio", conv=_prio),
    N("--poll", "no polling worker threads here", value="<0...100>", conv=_int),
    N("-Cb --cpu-mask-batch", "CPU affinity is left to the system", value="M"),
    N("-Crb --cpu-range-batch", "CPU affinity is left to the system", value="lo-hi"),
    N("--cpu-strict-batch", "CPU affinity is left to the system", value="<0|1>", conv=_int),
    N("--prio-batch", "--prio sets the whole process's priority", value="N", conv=_prio_batch),
    N("--poll-batch", "no polling worker threads here", value="<0|1>", conv=_int),
    W("-c --ctx-size", "context positions over all slots, split evenly (0: the model's)", value="N",
      env="LLAMA_ARG_CTX_SIZE", dest="ctx_size", conv=_int),
    W("-n --predict --n-predict", "default tokens to predict (-1: until end of generation or a full context)",
      value="N", env="LLAMA_ARG_N_PREDICT", dest="n_predict", conv=_int),
    W("-b --batch-size", "most prompt tokens in one forward pass (with -ub, the smaller)", value="N",
      env="LLAMA_ARG_BATCH", dest="batch_size", conv=_int),
    W("-ub --ubatch-size", "physical batch: a forward pass takes at most min(-b, -ub) prompt tokens (default "
      "512; the Vulkan backend takes up to 4096 a pass, rounded up to a power of two, and runs a larger batch as "
      "several passes; /props device.max_chunk)",
      value="N", env="LLAMA_ARG_UBATCH", dest="ubatch_size", conv=_int),
    W("--keep", "the prompt tokens a context shift keeps (-1: all); a request's n_keep over it", value="N",
      dest="n_keep", conv=_int),
    N("--swa-full", "the KV cache is always full-size", env="LLAMA_ARG_SWA_FULL"),
    W("-fa --flash-attn", "validated and shown in /props; one attention path exists (the fused one), used for all three",
      value="[on|off|auto]", env="LLAMA_ARG_FLASH_ATTN", dest="flash_attn", conv=_on_off_auto),
    N("--perf", "llama.cpp's internal timings; /completion's timings are always given", neg="--no-perf",
      env="LLAMA_ARG_PERF"),
    N("-e --escape", "escapes in -p prompts; the server takes prompts over HTTP", neg="--no-escape"),
    W("--rope-scaling", "RoPE frequency scaling over the file's (llama, qwen2, qwen3, qwen3moe; gemma3: none or "
      "linear; the partial-RoPE and MLA architectures refuse any scaling)", value="{none,linear,yarn}",
      env="LLAMA_ARG_ROPE_SCALING_TYPE", dest="rope_scaling", conv=_choice("none", "linear", "yarn")),
    W("--rope-scale", "RoPE context scaling factor: the positions are divided by N (--rope-freq-scale 1/N)",
      value="N", env="LLAMA_ARG_ROPE_SCALE", dest="rope_freq_scale", conv=_inverse),
    W("--rope-freq-base", "RoPE base frequency over the file's", value="N", env="LLAMA_ARG_ROPE_FREQ_BASE",
      dest="rope_freq_base", conv=_float),
    W("--rope-freq-scale", "RoPE frequency scaling factor: the positions are multiplied by N", value="N",
      env="LLAMA_ARG_ROPE_FREQ_SCALE", dest="rope_freq_scale", conv=_float),
    W("--yarn-orig-ctx", "YaRN: the model's original context (0: the file's, else its training context)",
      value="N", env="LLAMA_ARG_YARN_ORIG_CTX", dest="yarn_orig_ctx", conv=_int),
    W("--yarn-ext-factor", "YaRN: extrapolation mix factor (-1: 1 with yarn, else 0)", value="N",
      env="LLAMA_ARG_YARN_EXT_FACTOR", dest="yarn_ext_factor", conv=_float),
    W("--yarn-attn-factor", "YaRN: the magnitude factor where extrapolation is off (-1: 1)", value="N",
      env="LLAMA_ARG_YARN_ATTN_FACTOR", dest="yarn_attn_factor", conv=_float),
    W("--yarn-beta-slow", "YaRN: high correction dim (-1: 1)", value="N", env="LLAMA_ARG_YARN_BETA_SLOW",
      dest="yarn_beta_slow", conv=_float),
    W("--yarn-beta-fast", "YaRN: low correction dim (-1: 32)", value="N", env="LLAMA_ARG_YARN_BETA_FAST",
      dest="yarn_beta_fast", conv=_float),
    N("-kvo --kv-offload", "the KV cache lives with the model (on the device); --no-kv-offload is refused",
      neg="-nkvo --no-kv-offload", env="LLAMA_ARG_KV_OFFLOAD",
      refuse=_not(True, "the KV cache cannot be kept off the device here")),
    N("--repack", "no CPU weight repacking here", neg="-nr --no-repack", env="LLAMA_ARG_REPACK"),
    N("--no-host", "no host buffer types here", env="LLAMA_ARG_NO_HOST"),
    W("-ctk --cache-type-k", "K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 (iq4_nl is refused)",
      value="TYPE", env="LLAMA_ARG_CACHE_TYPE_K", dest="cache_type_k", conv=_cache_type, refuse=_no_iq4_nl),
    W("-ctv --cache-type-v", "V cache type, as -ctk", value="TYPE", env="LLAMA_ARG_CACHE_TYPE_V",
      dest="cache_type_v", conv=_cache_type, refuse=_no_iq4_nl),
    N("-dt --defrag-thold", "deprecated in llama-server too; the cache needs no defragmentation", value="N",
      env="LLAMA_ARG_DEFRAG_THOLD", conv=_float),
    R("--rpc", "RPC devices are not supported", value="SERVERS", env="LLAMA_ARG_RPC"),
    N("-lm --load-mode", _NO_MMAP, value="MODE", env="LLAMA_ARG_LOAD_MODE",
      conv=_choice("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")),
    N("--mlock", _NO_MMAP, env="LLAMA_ARG_MLOCK"),
    N("--mmap", _NO_MMAP, neg="--no-mmap", env="LLAMA_ARG_MMAP"),
    N("-dio --direct-io", _NO_MMAP, neg="-ndio --no-direct-io", env="LLAMA_ARG_DIO"),
    N("-lzm --lazy-mode", "every tensor is read at load", value="MODE", env="LLAMA_ARG_LAZY_MODE",
      conv=_choice("on", "auto", "off")),
    N("--numa", "no NUMA placement here", value="TYPE", env="LLAMA_ARG_NUMA",
      conv=_choice("distribute", "isolate", "numactl")),
    W("-dev --device", "the device: VulkanN (the N-th of --list-devices), or none (the CPU: --backend numpy); "
      "one device runs the whole model", value="<dev1,dev2,..>", env="LLAMA_ARG_DEVICE", dest="device",
      conv=_device),
    W("--list-devices", "print the Vulkan devices and exit", dest="_list_devices"),
    R("-ot --override-tensor", "tensor buffer overrides are not supported: " + _ONE_DEVICE,
      value="<pattern>=<type>,...", env="LLAMA_ARG_OVERRIDE_TENSOR"),
    N("-cmoe --cpu-moe", "no expert weights stay on the CPU: " + _ONE_DEVICE, env="LLAMA_ARG_CPU_MOE"),
    W("-ncmoe --n-cpu-moe", "keep the expert weights of the first N layers in host memory (fractional: the "
                            "next layer's gate, then up, too); the GPU reads them from there", value="N",
      env="LLAMA_ARG_N_CPU_MOE", dest="n_cpu_moe", conv=_float),
    N("--moe-cache-mib", "no expert weights stay on the CPU, so none are cached", value="N",
      env="LLAMA_ARG_MOE_CACHE_MIB", conv=_int),
    N("-ncffn --n-cpu-ffn", "no weights stay on the CPU: " + _ONE_DEVICE, value="N",
      env="LLAMA_ARG_N_CPU_FFN", conv=_int),
    W("-ngl --gpu-layers --n-gpu-layers", "the whole model runs on the device (Vulkan) or the CPU (numpy): a count "
      "below the model's layers is refused at load", value="N", env="LLAMA_ARG_N_GPU_LAYERS", dest="n_gpu_layers",
      conv=_gpu_layers),
    N("-sm --split-mode", _ONE_DEVICE, value="{none,layer,row,tensor}", env="LLAMA_ARG_SPLIT_MODE",
      conv=_choice("none", "layer", "row", "tensor")),
    N("-ts --tensor-split", _ONE_DEVICE, value="N0,N1,...", env="LLAMA_ARG_TENSOR_SPLIT"),
    N("-mg --main-gpu", _ONE_DEVICE + "; an index other than 0 is refused", value="INDEX",
      env="LLAMA_ARG_MAIN_GPU", conv=_int, refuse=_not(0, "only the first device is used")),
    W("-fit --fit", "adjust what the user did not set (the context size) so that weights + KV + compute "
      "fit the device's free memory minus --fit-target; logs what it chose", value="[on|off]",
      env="LLAMA_ARG_FIT", dest="fit", conv=_bool),
    W("-fitt --fit-target", "MiB --fit leaves free on the device (the first value of a list)",
      value="MiB0,MiB1,...", env="LLAMA_ARG_FIT_TARGET", dest="fit_target", conv=_fit_target),
    W("-fitc --fit-ctx", "smallest context --fit may choose", value="N", env="LLAMA_ARG_FIT_CTX",
      dest="fit_ctx", conv=_int),
    N("--check-tensors", "tensor data is not scanned for invalid values"),
    W("--override-kv", "model metadata over the file's, for the hyper-parameters, tokenizer and template "
      "(types int, float, bool, str; a value of another type than the file's key is ignored with a warning, "
      "as llama.cpp); repeats add up", value="KEY=TYPE:VALUE,...", dest="kv_overrides", conv=_kv_override),
    N("--op-offload", "every operation runs on the device", neg="--no-op-offload"),
    W("--lora", "LoRA adapters at scale 1 (comma-separated; repeats add up)", value="FNAME", dest="lora",
      conv=lambda t: tuple((f, 1.0) for f in t.split(",") if f)),
    W("--lora-scaled", "LoRA adapters with their scales (repeats add up); the scales are fixed for the server's "
      "life", value="FNAME:SCALE,...", dest="lora", conv=_scaled_files),
    W("--control-vector", "control vectors (GGUF files of direction.N tensors) at scale 1, each layer's summed "
      "vector added to its output (comma-separated; repeats add up)", value="FNAME", dest="control_vectors",
      conv=lambda t: tuple((f, 1.0) for f in t.split(",") if f)),
    W("--control-vector-scaled", "control vectors with their scales, summed with the others (repeats add up)",
      value="FNAME:SCALE,...", dest="control_vectors", conv=_scaled_files),
    W("--control-vector-layer-range", "the layers the control vectors are added to, start and end inclusive "
      "(default: 1 to the last; layer 0 never has one)", value="START END", dest="control_vector_layer_range",
      conv=_layer_range, n_values=2),
    W("-m --model", "GGUF file (default: the embedded demo model)", value="FNAME", env="LLAMA_ARG_MODEL",
      dest="model", conv=Path),
    W("-mu --model-url", "download the model from this URL to -m's path (else $LLAMA_CACHE's file of the URL's "
      "name) when it is missing or changed (its ETag), as llama-server", value="MODEL_URL",
      env="LLAMA_ARG_MODEL_URL", dest="model_url"),
    R("-dr --docker-repo", "Docker Hub model downloads are not implemented: use -hf (Hugging Face) or -m",
      value="[<repo>/]<model>[:quant]", env="LLAMA_ARG_DOCKER_REPO"),
    W("-hf -hfr --hf-repo", "a model from the Hugging Face hub ($MODEL_ENDPOINT, else $HF_ENDPOINT, else "
      "huggingface.co): downloaded at startup into llama.cpp's cache ($LLAMA_CACHE, else the Hugging Face hub "
      "cache) with its split parts and projector, as llama-server, unless the cache already has it (also the "
      "flat ~/.cache/llama.cpp layout)", value="<user>/<model>[:quant]",
      env="LLAMA_ARG_HF_REPO", dest="hf_repo", conv=_hf_repo),
    W("-hff --hf-file", "the file of --hf-repo to use (instead of the quant tag)", value="FILE",
      env="LLAMA_ARG_HF_FILE", dest="hf_file"),
    W("-hft --hf-token", "Hugging Face access token: bearer token of the -hf, -mu and --mmproj-url downloads",
      value="TOKEN", env="HF_TOKEN", dest="hf_token"),
    W("--log-disable", "log nothing", dest="log_disable"),
    W("--log-file", "log to this file too", value="FNAME", env="LLAMA_ARG_LOG_FILE", dest="log_file", conv=Path),
    N("--log-jsonl", "logs are plain lines", neg="--no-log-jsonl", env="LLAMA_ARG_LOG_JSONL"),
    N("--log-colors", "logs are plain lines", value="[on|off|auto]", env="LLAMA_ARG_LOG_COLORS", conv=_on_off_auto),
    W("-v --verbose --log-verbose", "log everything (debug)", dest="verbose"),
    W("--offline", "-hf, -mu and --mmproj-url use the local cache or file and ask the network nothing",
      env="LLAMA_ARG_OFFLINE",
      dest="offline"),
    W("-lv --verbosity --log-verbosity", "4 and above: debug logging", value="N",
      env="LLAMA_ARG_LOG_VERBOSITY", dest="verbosity", conv=_int),
    N("--log-prefix", "logs are plain lines", neg="--no-log-prefix", env="LLAMA_ARG_LOG_PREFIX"),
    N("--log-timestamps", "logs are plain lines", neg="--no-log-timestamps", env="LLAMA_ARG_LOG_TIMESTAMPS"),
    N("--spec-draft-type-k -ctkd --cache-type-k-draft", "only for a draft model (none here)", value="TYPE",
      env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K", conv=_cache_type),
    N("--spec-draft-type-v -ctvd --cache-type-v-draft", "only for a draft model (none here)", value="TYPE",
      env="LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V", conv=_cache_type),
    # -- sampling ------------------------------------------------------------------------
    W("--samplers", "default sampler order, names separated by ';' (llama.cpp's names and aliases)",
      value="SAMPLERS", dest="samplers", conv=lambda t: _samplers(t.split(";"))),
    W("--sampler-seq --sampling-seq", "default sampler order as llama.cpp's sampler characters (e.g. edskypmxt)",
      value="SEQUENCE", dest="samplers", conv=_samplers),
    W("-s --seed", "default seed (-1: a fresh random seed per request)", value="SEED", dest="seed", conv=_int),
    W("--ignore-eos", "default of the request field ignore_eos", dest="ignore_eos"),
    W("--temp --temperature", "default temperature", value="N", env="LLAMA_ARG_TEMPERATURE", dest="temp",
      conv=_float),
    W("--top-k", "default top-k", value="N", env="LLAMA_ARG_TOP_K", dest="top_k", conv=_int),
    W("--top-p", "default top-p", value="N", env="LLAMA_ARG_TOP_P", dest="top_p", conv=_float),
    W("--min-p", "default min-p", value="N", env="LLAMA_ARG_MIN_P", dest="min_p", conv=_float),
    W("--top-nsigma --top-n-sigma", "default top-n-sigma (-1: off)", value="N", dest="top_n_sigma", conv=_float),
    W("--xtc-probability", "default XTC probability (0: off)", value="N", dest="xtc_probability", conv=_float),
    W("--xtc-threshold", "default XTC threshold", value="N", dest="xtc_threshold", conv=_float),
    W("--typical --typical-p", "default locally typical p (1: off)", value="N", dest="typical_p", conv=_float),
    W("--repeat-last-n", "default repeat window", value="N", dest="repeat_last_n", conv=_int),
    W("--repeat-penalty", "default repeat penalty", value="N", env="LLAMA_ARG_REPEAT_PENALTY",
      dest="repeat_penalty", conv=_float),
    W("--presence-penalty", "default presence penalty", value="N", env="LLAMA_ARG_PRESENCE_PENALTY",
      dest="presence_penalty", conv=_float),
    W("--frequency-penalty", "default frequency penalty", value="N", env="LLAMA_ARG_FREQUENCY_PENALTY",
      dest="frequency_penalty", conv=_float),
    W("--dry-multiplier", "default DRY multiplier (0: off)", value="N", dest="dry_multiplier", conv=_float),
    W("--dry-base", "default DRY base (a value below 1 is ignored, as llama-server)", value="N",
      dest="_dry_base", conv=_float),
    W("--dry-allowed-length", "default DRY allowed length", value="N", dest="dry_allowed_length", conv=_int),
    W("--dry-penalty-last-n", "default DRY window (0: off)", value="N",
      dest="dry_penalty_last_n", conv=_nonneg),
    W("--dry-sequence-breaker", "a DRY sequence breaker; the first replaces the defaults, \"none\" clears them",
      value="STRING", dest="dry_sequence_breakers", conv=lambda t: (_NONE,) if t == "none" else (t,)),
    W("--adaptive-target", "default adaptive-p target (negative: off)", value="N", dest="adaptive_target",
      conv=_float),
    W("--adaptive-decay", "default adaptive-p decay", value="N", dest="adaptive_decay", conv=_float),
    W("--dynatemp-range", "default dynamic temperature range (0: off)", value="N", dest="dynatemp_range",
      conv=_float),
    W("--dynatemp-exp", "default dynamic temperature exponent", value="N", dest="dynatemp_exponent", conv=_float),
    W("--mirostat", "default Mirostat (0: off, 1: Mirostat, 2: Mirostat 2.0)", value="N", dest="mirostat",
      conv=_int),
    W("--mirostat-lr", "default Mirostat learning rate (eta)", value="N", dest="mirostat_eta", conv=_float),
    W("--mirostat-ent", "default Mirostat target entropy (tau)", value="N", dest="mirostat_tau", conv=_float),
    W("-l --logit-bias", "a default logit bias (TOKEN_ID+BIAS or TOKEN_ID-BIAS; repeats add up): a request "
      "without logit_bias gets it, a request's own replaces it, as llama-server", value="TOKEN_ID(+/-)BIAS",
      dest="logit_bias", conv=_bias),
    W("--grammar", "default GBNF grammar of every request (llguidance; a request's own grammar, json_schema "
      "or response_format replaces it)", value="GRAMMAR", dest="grammar", conv=_gbnf),
    W("--grammar-file", "--grammar from a file", value="FNAME", dest="grammar", conv=lambda t: _gbnf(_read_text(t))),
    W("-j --json-schema", "default JSON schema of every request", value="SCHEMA", dest="grammar", conv=_schema),
    W("-jf --json-schema-file", "--json-schema from a file", value="FILE", dest="grammar",
      conv=lambda t: _schema(_read_text(t))),
    N("-bs --backend-sampling", "sampling runs on the host", env="LLAMA_ARG_BACKEND_SAMPLING"),
    # -- server ----------------------------------------------------------------------------
    R("-lcs --lookup-cache-static", "lookup decoding is not implemented", value="FNAME"),
    R("-lcd --lookup-cache-dynamic", "lookup decoding is not implemented", value="FNAME"),
    W("--kv-unified-per-slot", "positions per slot: without -c, the context is -np x N", value="N",
      env="LLAMA_ARG_KV_UNIFIED_PER_SLOT", dest="_kv_per_slot", conv=_int),
    W("-ctxcp --ctx-checkpoints --swa-checkpoints", "copies of a hybrid (gated delta-net) model's recurrent "
      "state kept per slot, taken during prefill, so a prompt sharing a prefix continues from the newest at or "
      "before it (default 32; 0: off; sliding-window caches are not checkpointed: a prefix their ring no longer "
      "holds is computed again)", value="N",
      env="LLAMA_ARG_CTX_CHECKPOINTS", dest="ctx_checkpoints", conv=_nonneg),
    W("-cms --checkpoint-min-step", "positions between the context checkpoints taken while a prompt is "
      "processed (default 8192; 0: after every prompt piece); one is always taken before the prompt's last "
      "token", value="N", env="LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT", dest="checkpoint_min_step", conv=_nonneg),
    N("-cram --cache-ram", "no host-RAM prompt cache: each slot's KV cache is its prompt cache", value="N",
      env="LLAMA_ARG_CACHE_RAM", conv=_int),
    N("-kvu --kv-unified", "each slot has its own cache of -c/-np positions", neg="-no-kvu --no-kv-unified",
      env="LLAMA_ARG_KV_UNIFIED"),
    N("--cache-idle-slots", "no host-RAM prompt cache", neg="--no-cache-idle-slots",
      env="LLAMA_ARG_CACHE_IDLE_SLOTS"),
    W("--context-shift", "a full context drops tokens after n_keep (half of the rest, or n_discard) and the "
      "answer goes on (KV shifting; off by default, as llama-server; not for sliding-window, recurrent or "
      "latent caches, nor with images)", neg="--no-context-shift", env="LLAMA_ARG_CONTEXT_SHIFT",
      dest="ctx_shift"),
    W("-r --reverse-prompt", "a default stop word (repeats add up): a request without stop words (or with "
      "only empty ones) stops on these, as llama-server", value="PROMPT", dest="reverse_prompt", conv=_one),
    W("-sp --special", "control tokens' text is part of the answer (the end-of-generation token's too)",
      dest="special"),
    W("--warmup", "warm-up passes before the server reports ready", neg="--no-warmup", dest="warmup"),
    W("--spm-infill", "/infill puts the suffix before the prefix (SPM order), as llama-server", dest="spm_infill"),
    W("--pooling", "pooling of --embeddings (default: the file's pooling type, else none); rank: --reranking",
      value="{none,mean,cls,last,rank}", env="LLAMA_ARG_POOLING", dest="pooling",
      conv=_choice("none", "mean", "cls", "last", "rank")),
    W("-np --parallel", "slots: requests decoded together (-1, llama-server's auto: 1 here)", value="N",
      env="LLAMA_ARG_N_PARALLEL", dest="parallel", conv=_int),
    N("-cb --cont-batching", "batching is always continuous", neg="-nocb --no-cont-batching",
      env="LLAMA_ARG_CONT_BATCHING"),
    W("-mm --mmproj", "multimodal projector file (gemma3's vision encoder; images through /completion's "
      "multimodal_data and chat image_url parts)", value="FILE", env="LLAMA_ARG_MMPROJ", dest="mmproj", conv=Path),
    W("-mmu --mmproj-url", "download the projector from this URL to --mmproj's path (else $LLAMA_CACHE's file of "
      "the URL's name), as -mu; not fetched for a text model without image input here", value="URL",
      env="LLAMA_ARG_MMPROJ_URL", dest="mmproj_url"),
    W("--mmproj-auto", "with -hf, use the projector file cached beside the model (as llama-server picks it)",
      neg="--no-mmproj --no-mmproj-auto", env="LLAMA_ARG_MMPROJ_AUTO", dest="mmproj_auto"),
    N("--mmproj-offload", "the image encoder runs on the CPU (numpy) whatever this says: there is no GPU "
      "encoder yet (--no-mmproj-offload is what happens)", neg="--no-mmproj-offload", env="LLAMA_ARG_MMPROJ_OFFLOAD"),
    N("-mmdev --mmproj-device", "the image encoder runs on the CPU (numpy)", value="DEVICE", env="MTMD_BACKEND_DEVICE"),
    N("--image-min-tokens", _FIXED_SIZE, value="N", env="LLAMA_ARG_IMAGE_MIN_TOKENS", conv=_int),
    N("--image-max-tokens", _FIXED_SIZE, value="N", env="LLAMA_ARG_IMAGE_MAX_TOKENS", conv=_int),
    N("--mtmd-batch-max-tokens", "an image is decoded in one pass (gemma3's attention over it is not causal)", value="N", env="LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", conv=_int),
    N("--video-fps", _NO_VISION, value="N", env="LLAMA_ARG_VIDEO_FPS", conv=_float),
    N("--video-timestamp-interval", _NO_VISION, value="N", env="LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL", conv=_int),
    N("--video-ffmpeg-dir", _NO_VISION, value="DIR", env="LLAMA_ARG_VIDEO_FFMPEG_DIR"),
    W("-a --alias", "model names, comma-separated: the first is the id in /v1/models and answers",
      value="STRING", env="LLAMA_ARG_ALIAS", dest="alias"),
    W("--tags", "model tags, comma-separated: /v1/models shows them (informational, as in llama-server)",
      value="STRING", env="LLAMA_ARG_TAGS", dest="tags"),
    W("--embd-normalize", "normalization of pooled embeddings: -1 none, 0 max-abs int16, 1 taxicab, 2 euclidean "
      "(default), >2 p-norm", value="N", dest="embd_normalize", conv=_int),
    W("--host", "addresses to listen on, comma-separated (no UNIX sockets)", value="HOST", env="LLAMA_ARG_HOST", dest="host"),
    W("--port", "port to listen on (0: any free port, logged)", value="PORT", env="LLAMA_ARG_PORT", dest="port",
      conv=_int),
    N("--reuse-port", "the port is bound once", env="LLAMA_ARG_REUSE_PORT"),
    W("--path", "serve the files of this directory (GET, / is its index.html) before the API routes",
      value="PATH", env="LLAMA_ARG_STATIC_PATH", dest="static_path", conv=_dir),
    W("--cors-origins", "allowed origins, comma-separated: * echoes any Origin; localhost only a loopback one",
      value="ORIGINS", env="LLAMA_ARG_CORS_ORIGINS", dest="cors_origins"),
    W("--cors-methods", "Access-Control-Allow-Methods of a preflight", value="METHODS", env="LLAMA_ARG_CORS_METHODS",
      dest="cors_methods"),
    W("--cors-headers", "Access-Control-Allow-Headers of a preflight", value="HEADERS", env="LLAMA_ARG_CORS_HEADERS",
      dest="cors_headers"),
    W("--cors-credentials", "Access-Control-Allow-Credentials: true", neg="--no-cors-credentials",
      env="LLAMA_ARG_CORS_CREDENTIALS", dest="cors_credentials"),
    W("--api-prefix", "serve every route under this path prefix (no trailing slash)", value="PREFIX",
      env="LLAMA_ARG_API_PREFIX", dest="api_prefix", conv=_prefix),
    N("--ui-config --webui-config", "there is no web UI", value="JSON", env="LLAMA_ARG_UI_CONFIG"),
    N("--ui-config-file --webui-config-file", "there is no web UI", value="PATH", env="LLAMA_ARG_UI_CONFIG_FILE"),
    N("--ui-mcp-proxy --webui-mcp-proxy", "there is no web UI", neg="--no-ui-mcp-proxy --no-webui-mcp-proxy",
      env="LLAMA_ARG_UI_MCP_PROXY"),
    R("--tools", "built-in agent tools are not implemented", value="TOOL1,TOOL2,...", env="LLAMA_ARG_TOOLS"),
    R("--tools-runtime", "built-in agent tools are not implemented", value="OPTION", env="LLAMA_ARG_TOOLS_RUNTIME"),
    R("--mcp-servers-config", "MCP servers are not implemented", value="PATH", env="LLAMA_ARG_MCP_SERVERS_CONFIG"),
    R("--mcp-servers-json", "MCP servers are not implemented", value="JSON", env="LLAMA_ARG_MCP_SERVERS_JSON"),
    N("-ag --agent", "built-in agent tools are not implemented; --agent is refused", neg="-no-ag --no-agent",
      env="LLAMA_ARG_AGENT", refuse=_not(False, "built-in agent tools are not implemented")),
    N("--ui --webui", "there is no web UI", neg="--no-ui --no-webui", env="LLAMA_ARG_UI"),
    W("--embedding --embeddings", "serve /embedding and /v1/embeddings (an embedding-only server: generation "
      "endpoints answer 501)", env="LLAMA_ARG_EMBEDDINGS", dest="embeddings"),
    W("--rerank --reranking", "serve /rerank (--embeddings with --pooling rank; the model needs a rank head, "
      "cls.output.weight)", env="LLAMA_ARG_RERANKING", dest="_reranking"),
    W("--api-key", "required key(s), comma-separated: Authorization: Bearer KEY (or X-Api-Key)", value="KEY",
      env="LLAMA_API_KEY", dest="api_key"),
    W("--api-key-file", "keys, one per line (# comments)", value="FNAME", env="LLAMA_ARG_API_KEY_FILE",
      dest="_api_key_file", conv=_api_key_file),
    W("--ssl-key-file", "TLS private key (PEM)", value="FNAME", env="LLAMA_ARG_SSL_KEY_FILE", dest="ssl_key_file",
      conv=Path),
    W("--ssl-cert-file", "TLS certificate (PEM)", value="FNAME", env="LLAMA_ARG_SSL_CERT_FILE",
      dest="ssl_cert_file", conv=Path),
    W("--chat-template-kwargs", "a JSON object of template variables (a request's chat_template_kwargs "
      "override them)", value="STRING", env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS", dest="chat_template_kwargs",
      conv=_json_object),
    N("-to --timeout", "requests are not timed out by the server", value="N", env="LLAMA_ARG_TIMEOUT", conv=_int),
    N("--sse-ping-interval", "no SSE pings are sent", value="N", env="LLAMA_ARG_SSE_PING_INTERVAL", conv=_int),
    N("--threads-http", "HTTP runs on trio tasks, not threads", value="N", env="LLAMA_ARG_THREADS_HTTP",
      conv=_int),
    W("--cache-prompt", "default of the request field cache_prompt", neg="--no-cache-prompt",
      env="LLAMA_ARG_CACHE_PROMPT", dest="cache_prompt"),
    W("--cache-reuse", "default of the request field n_cache_reuse: after the common prefix, cached chunks of at "
      "least N tokens that the new prompt repeats further on are moved there (KV shifting: K re-roped, on the "
      "host), not evaluated again; 0: off. Only where every layer is a full KV cache (no sliding window, no "
      "recurrent state: those keep prefix reuse)", value="N", env="LLAMA_ARG_CACHE_REUSE", dest="cache_reuse",
      conv=_int),
    W("--metrics", "serve Prometheus metrics at /metrics", env="LLAMA_ARG_ENDPOINT_METRICS", dest="metrics"),
    W("--props", "allow POST /props (accepted and answered as llama-server: nothing to change)",
      env="LLAMA_ARG_ENDPOINT_PROPS", dest="endpoint_props"),
    W("--slots", "the /slots endpoint (on by default; 501 without it)", neg="--no-slots",
      env="LLAMA_ARG_ENDPOINT_SLOTS", dest="endpoint_slots"),
    W("--slot-save-path", "folder of POST /slots/{id}?action=save|restore files", value="PATH",
      env="LLAMA_ARG_SLOT_SAVE_PATH", dest="slot_save_path", conv=Path),
    W("--media-path", "directory file:// image URLs are read from (relative paths inside it only; default: "
      "file:// refused)", value="PATH", dest="media_path", conv=Path),
    R("--models-dir", "router mode is not supported: run one server per model (llama-swap routes)",
      value="PATH", env="LLAMA_ARG_MODELS_DIR"),
    R("--models-preset", "router mode is not supported: run one server per model", value="PATH",
      env="LLAMA_ARG_MODELS_PRESET"),
    N("--models-max", "only for router mode", value="N", env="LLAMA_ARG_MODELS_MAX", conv=_int),
    N("--models-autoload", "only for router mode", neg="--no-models-autoload", env="LLAMA_ARG_MODELS_AUTOLOAD"),
    N("--jinja", "the Jinja template engine is always used", neg="--no-jinja", env="LLAMA_ARG_JINJA"),
    W("--reasoning-format", "none: thoughts stay in content; auto and deepseek: <think>...</think> goes to "
      "reasoning_content; deepseek-legacy: both (a request's reasoning_format overrides it)", value="FORMAT",
      env="LLAMA_ARG_THINK", dest="reasoning_format",
      conv=_choice("none", "auto", "deepseek", "deepseek-legacy")),
    W("-rea --reasoning", "on/off: the template's enable_thinking; auto: the template's default",
      value="[on|off|auto]", env="LLAMA_ARG_REASONING", dest="reasoning", conv=_on_off_auto),
    W("--reasoning-effort", "given to the template as reasoning_effort (default: the template's own)",
      value="LEVEL", env="LLAMA_ARG_REASONING_EFFORT", dest="reasoning_effort"),
    W("--reasoning-budget", "thinking tokens of a chat answer (-1: no limit, 0: none): past them </think> is "
      "forced and the answer goes on; a request's reasoning_budget_tokens / thinking_budget_tokens over it",
      value="N", env="LLAMA_ARG_THINK_BUDGET", dest="reasoning_budget", conv=_think_budget),
    W("--reasoning-budget-message", "text written before the forced </think>", value="MESSAGE",
      env="LLAMA_ARG_THINK_BUDGET_MESSAGE", dest="reasoning_budget_message"),
    N("--reasoning-preserve", "the template sees the messages as sent", neg="--no-reasoning-preserve",
      env="LLAMA_ARG_REASONING_PRESERVE"),
    W("--chat-template", "a Jinja template, or any of llama-server's 54 built-in names (chatml, command-r, "
      "llama2, mistral-v7, ...), rendered as its --no-jinja formatter does", value="JINJA_TEMPLATE", env="LLAMA_ARG_CHAT_TEMPLATE", dest="chat_template", conv=_template),
    W("--chat-template-file", "a file holding a Jinja chat template", value="JINJA_TEMPLATE_FILE",
      env="LLAMA_ARG_CHAT_TEMPLATE_FILE", dest="chat_template", conv=_read_text),
    W("--skip-chat-parsing", "answers are not parsed: reasoning and tool calls stay in content",
      neg="--no-skip-chat-parsing", env="LLAMA_ARG_SKIP_CHAT_PARSING", dest="skip_chat_parsing"),
    W("--prefill-assistant", "a last assistant message is continued: no generation prompt, the prompt ends "
      "with its text", neg="--no-prefill-assistant", env="LLAMA_ARG_PREFILL_ASSISTANT", dest="prefill_assistant"),
    N("-sps --slot-prompt-similarity", "a request takes the free slot with the longest cached prefix",
      value="SIMILARITY", conv=_float),
    R("--lora-init-without-apply", "LoRA adapters are not supported"),
    W("--sleep-idle-seconds", "release device memory after N idle seconds (-1: never)", value="SECONDS",
      dest="sleep_idle_seconds", conv=_float),
    N("--log-prompts-dir", "prompts are not logged", value="PATH"),
    R("--spec-draft-hf -hfd -hfrd --hf-repo-draft", _NO_DRAFT, value="<user>/<model>[:quant]",
      env="LLAMA_ARG_SPEC_DRAFT_HF_REPO"),
    N("--spec-draft-threads -td --threads-draft", _NO_DRAFT, value="N", conv=_int),
    N("--spec-draft-threads-batch -tbd --threads-batch-draft", _NO_DRAFT, value="N", conv=_int),
    N("--spec-draft-cpu-mask -Cd --cpu-mask-draft", _NO_DRAFT, value="M"),
    N("--spec-draft-cpu-range -Crd --cpu-range-draft", _NO_DRAFT, value="lo-hi"),
    N("--spec-draft-cpu-strict --cpu-strict-draft", _NO_DRAFT, value="<0|1>", conv=_int),
    N("--spec-draft-prio --prio-draft", _NO_DRAFT, value="N", conv=_prio_batch),
    N("--spec-draft-poll --poll-draft", _NO_DRAFT, value="<0|1>", conv=_int),
    N("--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft", _NO_DRAFT, value="M"),
    N("--spec-draft-cpu-strict-batch --cpu-strict-batch-draft", _NO_DRAFT, value="<0|1>", conv=_int),
    N("--spec-draft-prio-batch --prio-batch-draft", _NO_DRAFT, value="N", conv=_prio_batch),
    N("--spec-draft-poll-batch --poll-batch-draft", _NO_DRAFT, value="<0|1>", conv=_int),
    N("--spec-draft-override-tensor -otd --override-tensor-draft", _NO_DRAFT, value="<pattern>=<type>,..."),
    N("--spec-draft-cpu-moe -cmoed --cpu-moe-draft", _NO_DRAFT, env="LLAMA_ARG_SPEC_DRAFT_CPU_MOE"),
    N("--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft", _NO_DRAFT, value="N",
      env="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE", conv=_int),
    N("--spec-draft-n-max", "only matters with --spec-type", value="N", env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
      conv=_int),
    N("--spec-draft-n-min", "only matters with --spec-type", value="N", env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
      conv=_int),
    N("--spec-synth-len", "only matters with --spec-type", value="L", env="LLAMA_ARG_SPEC_SYNTH_LEN",
      conv=_float),
    N("--spec-synth-rates", "only matters with --spec-type", value="P0,P1,...", env="LLAMA_ARG_SPEC_SYNTH_RATES"),
    N("--spec-draft-p-split --draft-p-split", "only matters with --spec-type", value="P",
      env="LLAMA_ARG_SPEC_DRAFT_P_SPLIT", conv=_float),
    N("--spec-draft-p-min --draft-p-min", "only matters with --spec-type", value="P",
      env="LLAMA_ARG_SPEC_DRAFT_P_MIN", conv=_float),
    N("--spec-draft-backend-sampling", "only matters with --spec-type", neg="--no-spec-draft-backend-sampling",
      env="LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING"),
    N("--spec-draft-sampling", "only matters with --spec-type", value="{greedy,probabilistic}",
      env="LLAMA_ARG_SPEC_DRAFT_SAMPLING", conv=_choice("greedy", "probabilistic")),
    N("--spec-draft-device -devd --device-draft", _NO_DRAFT, value="<dev1,dev2,..>"),
    N("--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft", _NO_DRAFT, value="N",
      env="LLAMA_ARG_N_GPU_LAYERS_DRAFT", conv=_gpu_layers),
    R("--spec-draft-model -md --model-draft", _NO_DRAFT, value="FNAME", env="LLAMA_ARG_SPEC_DRAFT_MODEL"),
    N("--spec-type", "speculative decoding is not implemented: only none is accepted", value="TYPES",
      env="LLAMA_ARG_SPEC_TYPE", refuse=_not("none", _NO_DRAFT)),
    N("--spec-ngram-mod-n-min", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-mod-n-max", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-mod-n-match", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-simple-size-n", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-simple-size-m", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-simple-min-hits", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k-size-n", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k-size-m", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k-min-hits", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k4v-size-n", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k4v-size-m", "only matters with --spec-type", value="N", conv=_int),
    N("--spec-ngram-map-k4v-min-hits", "only matters with --spec-type", value="N", conv=_int),
    R("--draft --draft-n --draft-max", "removed from llama-server too: use --spec-draft-n-max or "
      "--spec-ngram-mod-n-max", value="N", env="LLAMA_ARG_DRAFT_MAX"),
    R("--draft-min --draft-n-min", "removed from llama-server too: use --spec-draft-n-min", value="N",
      env="LLAMA_ARG_DRAFT_MIN"),
    R("--spec-ngram-size-n", "removed from llama-server too", value="N"),
    R("--spec-ngram-size-m", "removed from llama-server too", value="N"),
    R("--spec-ngram-min-hits", "removed from llama-server too", value="N"),
    P("--embd-gemma-default", "EmbeddingGemma 300M", ("-hf", "hf_repo", "ggml-org/embeddinggemma-300M-qat-q4_0-GGUF"),
      ("-hff", "hf_file", "embeddinggemma-300M-qat-Q4_0.gguf"), ("--port", "port", 8011),
      ("-ub", "ubatch_size", 2048), ("-b", "batch_size", 2048), ("-np", "parallel", 32), ("-c", "ctx_size", 65536),
      ("--embeddings", "embeddings", True),
      also="; llama-server's verbose_prompt too, which its server does not read either"),
    *(P(f"--fim-qwen-{size}-default", f"Qwen 2.5 Coder {size.upper()}",
        ("-hf", "hf_repo", f"ggml-org/Qwen2.5-Coder-{size.upper()}-Q8_0-GGUF"),
        ("-hff", "hf_file", f"qwen2.5-coder-{size}-q8_0.gguf"), *_FIM, also=_CTX0) for size in ("1.5b", "3b", "7b")),
    R("--fim-qwen-7b-spec", _NO_DRAFT + ": the preset needs one (llama-server's: Qwen 2.5 Coder 7B + a 0.5B draft)"),
    R("--fim-qwen-14b-spec", _NO_DRAFT + ": the preset needs one (llama-server's: Qwen 2.5 Coder 14B + a 0.5B draft)"),
    P("--fim-qwen-30b-default", "Qwen 3 Coder 30B A3B Instruct",
      ("-hf", "hf_repo", "ggml-org/Qwen3-Coder-30B-A3B-Instruct-Q8_0-GGUF"),
      ("-hff", "hf_file", "qwen3-coder-30b-a3b-instruct-q8_0.gguf"), *_FIM, also=_CTX0),
    P("--gpt-oss-20b-default", "gpt-oss-20b", ("-hf", "hf_repo", "ggml-org/gpt-oss-20b-GGUF"),
      ("-hff", "hf_file", "gpt-oss-20b-mxfp4.gguf"), *_GPT_OSS, also=_JINJA + _NO_GPT_OSS),
    P("--gpt-oss-120b-default", "gpt-oss-120b", ("-hf", "hf_repo", "ggml-org/gpt-oss-120b-GGUF"), *_GPT_OSS,
      also=_JINJA + _NO_GPT_OSS),
    P("--vision-gemma-4b-default", "Gemma 3 4B QAT", ("-hf", "hf_repo", "ggml-org/gemma-3-4b-it-qat-GGUF"),
      ("--port", "port", 8014), ("-c", "ctx_size", 0), also=_JINJA + "; the repository's projector too" + _CTX0),
    P("--vision-gemma-12b-default", "Gemma 3 12B QAT", ("-hf", "hf_repo", "ggml-org/gemma-3-12b-it-qat-GGUF"),
      ("--port", "port", 8014), ("-c", "ctx_size", 0), also=_JINJA + "; the repository's projector too" + _CTX0),
    R("--spec-default", "speculative decoding is not implemented (the preset turns on ngram-mod drafts)"),
    # -- trio-llm's own ------------------------------------------------------------------
    W("--backend", "compute backend (auto: Vulkan, else numpy)", value="{auto,numpy,vulkan}", dest="backend",
      conv=_choice("auto", "numpy", "vulkan")),
    W("--sleep-mode", "what an idle or yielding server releases", value="{unload,weights,all}",
      dest="sleep_mode", conv=_choice("unload", "weights", "all")),
    W("--vram-arena", "directory shared by servers time-sharing one GPU", value="DIR", env="LLAMA_VRAM_ARENA",
      dest="vram_arena", conv=Path),
    W("--shutdown-timeout", "seconds in-flight requests get after SIGTERM", value="S", dest="shutdown_timeout",
      conv=_float),
    W("--arena-quantum", "with --vram-arena: after this long resident, a waiting server gets the GPU at the next "
      "step boundary, even with requests in flight (0: yield only when idle; default 5)", value="SECONDS",
      dest="arena_quantum", conv=_float),
    W("--arena-budget", "with --vram-arena: servers whose footprints fit this many MiB of device memory together "
      "are resident at once and never swap (auto: the device's VK_EXT_memory_budget less --fit-target; the numpy "
      "backend needs a figure); default: off, servers take turns", value="MIB/auto", dest="arena_budget",
      conv=_budget),
    W("--arena-pin", "with --arena-budget: this server never yields the GPU (the budget left for the others is "
      "the rest)", dest="arena_pin"),
    W("--arena-priority", "with --vram-arena: among waiting servers the higher goes first (equal: first come), "
      "and it halves a lower holder's quantum per step of difference (default 0)", value="N",
      dest="arena_priority", conv=_int),
)

#: trio-llm's own flags (not llama-server's), for the docs
OWN = frozenset({"--backend", "--sleep-mode", "--vram-arena", "--shutdown-timeout", "--arena-quantum",
                 "--arena-budget", "--arena-pin", "--arena-priority"})


def _index(flags: Sequence[Flag]) -> dict[str, tuple[Flag, bool]]:
    out: dict[str, tuple[Flag, bool]] = {}
    for flag in flags:
        for name in flag.names:
            assert name not in out, f"{name} twice in the flag table"
            assert flag.n_values == 1 or flag.env is None, f"{name}: a variable holds one value"
            out[name] = (flag, True)
        for name in flag.neg:
            assert name not in out, f"{name} twice in the flag table"
            out[name] = (flag, False)
    return out


INDEX = _index(FLAGS)


# ---------------------------------------------------------------------------
# parsing


@attrs.frozen
class Parsed:
    """What the command line and the environment asked for."""

    values: dict[str, Any]  # dest -> value
    explicit: frozenset[str]  # dests the user set (by flag or variable)
    used: tuple[str, ...]  # the flags (and variables) given, for the log


def _apply(flag: Flag, shown: str, value: Any, values: dict[str, Any]) -> None:
    if flag.kind == "refused":
        raise UsageError(f"{shown}: {flag.help}")
    values.update(flag.preset)  # assigned, as the preset's handler does: never added to
    if flag.refuse is not None and (why := flag.refuse(value)) is not None:
        raise UsageError(f"{shown} {value if flag.value else ''}".rstrip() + f": {why}")
    if flag.dest is not None:
        old = values.get(flag.dest)
        # a repeated object flag adds its keys (llama.cpp: --override-kv appends, and
        # --chat-template-kwargs sets each key it names), a list flag its items (-r, -l);
        # any other flag: the last wins
        if isinstance(old, dict) and isinstance(value, dict):
            value = {**old, **value}
        elif isinstance(old, tuple) and isinstance(value, tuple):
            value = old + value
        values[flag.dest] = value


def _convert(flag: Flag, shown: str, *texts: str) -> Any:
    try:
        return flag.conv(*texts)
    except FlagValueError as exc:
        raise UsageError(f"{shown}: {exc}") from None


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Parsed:
    """The values of ``argv`` over those of ``environ`` (llama.cpp's order); a
    ``UsageError`` names the flag (or variable) and what is wrong."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    used: list[str] = []
    for flag in FLAGS:
        if flag.env is None:
            continue
        neg_env = flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if flag.neg else None
        if neg_env and neg_env in env:
            name, text = neg_env, "0"
        elif env.get(flag.env):
            name, text = flag.env, env[flag.env]
        else:
            continue
        shown = f"{name} ({flag.label})"
        if flag.value is None:
            on = _convert(attrs.evolve(flag, conv=_bool), shown, text)
            if not on and not flag.neg:
                continue  # llama.cpp: a plain switch's variable acts only when truthy
            _apply(flag, shown, on, values)
        else:
            _apply(flag, shown, _convert(flag, shown, text), values)
        if flag.dest:
            explicit.add(flag.dest)
        used.append(name)
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        inline: str | None = None
        if arg.startswith("--"):
            if "=" in arg:
                arg, inline = arg.split("=", 1)
            arg = arg.replace("_", "-")
        hit = INDEX.get(arg)
        if hit is None:
            raise UsageError(f"invalid argument: {arg}")
        flag, positive = hit
        if flag.kind == "refused":
            raise UsageError(f"{arg}: {flag.help}")
        if flag.value is None:
            if inline is not None:
                raise UsageError(f"{arg}: takes no value")
            _apply(flag, arg, positive, values)
        else:
            texts = [] if inline is None else [inline]
            while len(texts) < flag.n_values:
                if i >= len(args):
                    what = "a value" if flag.n_values == 1 else f"{flag.n_values} values"
                    raise UsageError(f"{arg}: expected {what} ({flag.value})")
                texts.append(args[i])
                i += 1
            _apply(flag, arg, _convert(flag, arg, *texts), values)
        if flag.dest:
            explicit.add(flag.dest)
        for dest, value in flag.preset:
            # llama.cpp fits a context of 0 (the model's), whoever set it: a preset's
            # -c 0 counts as not set (a typed one is set, and --fit then reads its 0 as llama.cpp)
            if (dest, value) == ("ctx_size", 0):
                explicit.discard(dest)
            else:
                explicit.add(dest)
        used.append(arg)
    return Parsed(values, frozenset(explicit), tuple(used))


# ---------------------------------------------------------------------------
# help and docs


def usage() -> str:
    lines = ["usage: trio-llm serve [FLAGS]  (llama-server's flags; see docs/server.md)", ""]
    for flag in FLAGS:
        names = ", ".join(flag.names + flag.neg) + (f" {flag.value}" if flag.value else "")
        tag = "" if flag.kind == "works" else f"[{flag.kind}] "
        env = f" (env: {flag.env})" if flag.env else ""
        lines.append(f"  {names:<44} {tag}{flag.help}{env}")
    return "\n".join(lines)


def counts() -> dict[Kind, int]:
    """How many rows of each kind (trio-llm's own flags excluded)."""
    out: dict[Kind, int] = dict.fromkeys(KINDS, 0)
    for flag in FLAGS:
        if flag.names[0] not in OWN:
            out[flag.kind] += 1
    return out


def completion_bash() -> str:
    """``--completion-bash``: a script that completes every flag that is not refused, and
    files by kind after -m / --grammar-file / --chat-template-file (llama.cpp's)."""
    names = " ".join(n for f in FLAGS if f.kind != "refused" for n in (*f.names, *f.neg))
    gguf = "--model|-m|--mmproj|-mm|--lora|--lora-scaled|--control-vector|--control-vector-scaled"
    files = [(gguf, "*.gguf"), ("--grammar-file", "*.gbnf"),
             ("--chat-template-file", "*.jinja")]
    cases = "".join(f"        {flags})\n            COMPREPLY=( $(compgen -f -X '!{pattern}' -- \"$cur\") "
                    f"$(compgen -d -- \"$cur\") )\n            return 0\n            ;;\n" for flags, pattern in files)
    return ("_trio_llm_completions() {\n    local cur prev opts\n    COMPREPLY=()\n"
            "    cur=\"${COMP_WORDS[COMP_CWORD]}\"\n    prev=\"${COMP_WORDS[COMP_CWORD-1]}\"\n"
            f"    opts=\"{names}\"\n    case \"$prev\" in\n{cases}"
            "        *)\n            COMPREPLY=( $(compgen -W \"${opts}\" -- \"$cur\") )\n            return 0\n"
            "            ;;\n    esac\n}\n\ncomplete -F _trio_llm_completions trio-llm llama-server\n")


def markdown_table() -> str:
    """The table of ``docs/server.md`` (between its flag-table markers)."""
    c = counts()
    rows = [
        f"{c['works']} flags work, {c['noop']} are accepted without effect (no-op), "
        f"{c['refused']} are refused; plus trio-llm's own {', '.join(f'`{o}`' for o in sorted(OWN))}.",
        "",
        "| flag | env | kind | here |",
        "| --- | --- | --- | --- |",
    ]
    for flag in FLAGS:
        names = ", ".join(f"`{n}`" for n in flag.names + flag.neg)
        if flag.value:
            names += f" `{flag.value}`"
        env = f"`{flag.env}`" if flag.env else ""
        kind = "own" if flag.names[0] in OWN else flag.kind
        text = flag.help.replace("|", "\\|")
        rows.append(f"| {names} | {env} | {kind} | {text} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------
# parsed flags -> ServerConfig


def to_config(parsed: Parsed, environ: Mapping[str, str] | None = None) -> Any:
    """A validated ``ServerConfig`` (``ConfigError`` names the flag); ``-hf`` is
    resolved here from the local cache when it is there (``--offline``: else
    ``trio_llm.model.hf_cache.NotCached``), else ``model`` stays None for the download
    at startup."""
    from trio_llm.config import ServerConfig

    fields = {f.name for f in attrs.fields(ServerConfig)}
    values = {k: v for k, v in parsed.values.items() if k in fields}
    explicit = set(parsed.explicit)
    if values.get("parallel") == -1:  # llama-server's "auto"
        del values["parallel"]
    per_slot = parsed.values.get("_kv_per_slot")
    if per_slot is not None and "ctx_size" not in explicit:
        values["ctx_size"] = values.get("parallel", ServerConfig().parallel) * per_slot
        explicit.add("ctx_size")
    if "_api_key_file" in parsed.values:
        keys = [k for k in (values.get("api_key"), parsed.values["_api_key_file"]) if k]
        values["api_key"] = ",".join(keys)
    if values.get("hf_repo") and values.get("model") is None:
        from trio_llm.model.hf_cache import find_mmproj, resolve
        from trio_llm.model.hf_download import Fetched, from_cache

        spec, hf_file = values["hf_repo"], values.get("hf_file")
        # llama-server's -hf takes the repository's projector too (--no-mmproj: not)
        with_mmproj = values.get("mmproj") is None and values.get("mmproj_auto", True) and not values.get("mmproj_url")
        values.setdefault("alias", spec)
        cached = from_cache(spec, hf_file, os.environ if environ is None else environ, with_mmproj)
        if cached is None and values.get("offline"):
            model = resolve(spec, hf_file, environ)  # NotCached when it is not there
            cached = Fetched(model, find_mmproj(model, spec) if with_mmproj else None)
        if cached is not None:
            values["model"] = cached.model
            if with_mmproj:
                values["mmproj"] = cached.mmproj
        # else: not (all) in the cache: downloaded at startup (runtime.fetch_hf)
    # -mu / --mmproj-url: llama-server's local path for a URL when none is given; the
    # download itself runs at startup (runtime.fetch_urls)
    for url_key, path_key in (("model_url", "model"), ("mmproj_url", "mmproj")):
        if values.get(url_key) and values.get(path_key) is None:
            from trio_llm.model.download import cache_dir, default_path

            values[path_key] = default_path(values[url_key], cache_dir(environ))
    breakers = values.get("dry_sequence_breakers")
    if breakers is not None and _NONE in breakers:  # "none" clears what came before it
        values["dry_sequence_breakers"] = breakers[len(breakers) - breakers[::-1].index(_NONE):]
    base = parsed.values.get("_dry_base")
    if base is not None and base >= 1.0:  # llama-server ignores a base below 1
        values["dry_base"] = base
    if values.get("device") == "none":  # llama.cpp's -dev none: nothing offloaded
        if values.get("backend", "auto") == "vulkan":
            raise UsageError("-dev none: the CPU runs the model, which --backend vulkan does not")
        values["backend"], values["device"] = "numpy", None
    if parsed.values.get("_reranking"):  # llama-server: --reranking is --embeddings --pooling rank
        values["embeddings"] = True
        values["pooling"] = "rank"
    values["set_by_user"] = frozenset(explicit)
    return ServerConfig(**values)


if __name__ == "__main__":  # the table of docs/server.md
    print(markdown_table())
