"""The `trio-llm` command: routes a sub-command to the module that owns it.

Each sub-command module exposes ``main(argv: list[str]) -> int`` and owns its own
argument parser, so the modules stay independent and imports stay lazy (``trio-llm
make-model`` does not import Vulkan or the HTTP stack).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("trio_llm.runtime", "run the HTTP server (llama-server compatible flags)"),
    "generate": ("trio_llm.engine.generate", "one-shot generation, like llama-cli"),
    "make-model": ("trio_llm.model.synth", "write a deterministic synthetic GGUF"),
    "compile-shaders": ("trio_llm.vulkan.shaders", "compile the GLSL shaders to SPIR-V"),
    "scenario": ("trio_llm.scenario.runner", "run a scripted contention scenario"),
}


def _usage() -> str:
    lines = ["usage: trio-llm COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from trio_llm import __version__

        print(f"trio-llm {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"trio-llm: unknown command {name!r} (try: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    raise SystemExit(main())
