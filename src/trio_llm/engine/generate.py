"""``trio-llm generate``: one-shot text completion, like llama-cli without a chat.

It runs the backend directly on the calling thread: a one-shot command has nothing
else to serve, so the backend actor and the event loop would add only hand-offs.
``generate_tokens`` is also the simplest correct decode loop in the project, which
the server's slots loop is tested against.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from trio_llm.engine.backend import Backend, SeqBatch
from trio_llm.engine.loader import BACKEND_KINDS, open_backend
from trio_llm.engine.sampling import DEFAULT_SEED, SamplingParams, make_rng, sample
from trio_llm.errors import ContextOverflow, InvalidRequest, TrioLLMError
from trio_llm.model.tokenizer import Tokenizer

#: how many tokens to generate by default (llama-cli's -1, "until the end", would run
#: a random-weight synthetic model to the end of its context)
DEFAULT_N_PREDICT = 128
#: the context when -c is 0 and the model trained on more (llama-cli's default too)
DEFAULT_N_CTX = 4096


def generate_tokens(
    backend: Backend,
    tokenizer: Tokenizer,
    prompt_tokens: Sequence[int],
    n: int,
    params: SamplingParams,
    rng: np.random.Generator,
    *,
    seq_id: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to ``n`` tokens after ``prompt_tokens`` in sequence ``seq_id``.

    Stops early at an end-of-generation token (which is not returned) or when the
    context is full; ``n < 0`` means "until one of those". The prompt must fit the
    context (``ContextOverflow`` otherwise). ``on_token`` sees each token as it is
    chosen, for streaming output.
    """
    prompt = np.asarray(prompt_tokens, dtype=np.int32)  # [n_prompt]
    if prompt.shape[0] == 0:
        raise InvalidRequest("the prompt is empty (and the model adds no BOS token)")
    if prompt.shape[0] > backend.n_ctx:
        raise ContextOverflow(int(prompt.shape[0]), backend.n_ctx)
    history = [int(t) for t in prompt]  # the tokens the repetition penalty looks at
    out: list[int] = []
    logits = backend.forward([SeqBatch(seq_id, prompt, 0)])[0]  # [n_vocab]
    while n < 0 or len(out) < n:
        tok = sample(logits, params, rng, history)
        if tokenizer.is_eog(tok):
            break
        out.append(tok)
        history.append(tok)
        if on_token is not None:
            on_token(tok)
        pos = len(history) - 1  # where the new token goes in the cache
        if (n >= 0 and len(out) == n) or pos >= backend.n_ctx:
            break
        logits = backend.forward([SeqBatch(seq_id, np.array([tok], np.int32), pos)])[0]
    return out


class _UsageError(Exception):
    """A bad flag: exit 2 after the message, as argparse does."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="trio-llm generate", description="Complete a prompt with a GGUF model.")
    p.add_argument("-m", "--model", type=Path, help="GGUF file (default: the embedded demo model)")
    p.add_argument("-p", "--prompt", default="", help="prompt text")
    p.add_argument("-f", "--file", type=Path, help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=int, default=DEFAULT_N_PREDICT,
                   help=f"tokens to generate; -1: until end of text or context (default {DEFAULT_N_PREDICT})")
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help=f"context size; 0: the model's, at most {DEFAULT_N_CTX}")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 is greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed; -1: random")
    p.add_argument("--backend", choices=BACKEND_KINDS, default="auto")
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_tokens": [...], "tokens": [...], "text": "..."}')
    return p


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.n_predict < -1:
            raise _UsageError(f"-n must be >= -1, got {args.n_predict}")
        if args.ctx_size < 0:
            raise _UsageError(f"-c must be >= 0, got {args.ctx_size}")
        params = SamplingParams(
            temperature=args.temp,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repeat_penalty=args.repeat_penalty,
            repeat_last_n=args.repeat_last_n,
            seed=DEFAULT_SEED if args.seed < 0 else args.seed,
        )
    except (_UsageError, InvalidRequest) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        print(parser.format_usage().rstrip(), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    logging.basicConfig(level=logging.WARNING, format=f"{parser.prog}: %(message)s")
    try:
        return _run(args, params)
    except TrioLLMError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C mid-generation is an ordinary way to stop a one-shot command
        print(file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, params: SamplingParams) -> int:
    from trio_llm.model.gguf import load_gguf

    text = args.prompt
    if args.file is not None:
        try:
            text = args.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot read the prompt file {str(args.file)!r}: {exc}") from None
    if args.model is None:
        from trio_llm.model.synth import default_model_path

        args.model = default_model_path()
    model = load_gguf(args.model)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    prompt = tokenizer.encode(text)
    n_ctx = args.ctx_size or min(model.config.n_ctx_train, DEFAULT_N_CTX)
    backend = open_backend(args.backend, model, n_ctx=n_ctx, n_seq=1)
    try:
        rng = make_rng(params.seed)
        if args.json:
            tokens = generate_tokens(backend, tokenizer, prompt, args.n_predict, params, rng)
            # the stream decoder's text: a continuation keeps its leading space
            stream = tokenizer.stream_decoder()
            record = {
                "prompt_tokens": prompt,
                "tokens": tokens,
                "text": stream.feed_many(tokens) + stream.flush(),
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            stream = tokenizer.stream_decoder()
            out = sys.stdout
            out.write(text)
            out.flush()

            def show(tok: int) -> None:
                out.write(stream.feed(tok))
                out.flush()

            generate_tokens(backend, tokenizer, prompt, args.n_predict, params, rng, on_token=show)
            out.write(stream.flush() + "\n")
            out.flush()
    finally:
        backend.close()
        model.close()
    return 0
