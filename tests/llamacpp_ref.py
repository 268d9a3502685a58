"""llama.cpp itself as the reference: greedy continuations with top logprobs.

``xllamacpp`` is a prebuilt CPU llama.cpp whose ``Server`` runs llama-server's request
handling in-process and also listens on a loopback port. The native ``/completion``
endpoint is used (not the OpenAI one that ``Server.handle_completions`` serves) because
only it returns the generated token ids (``return_tokens``): llama-server reports one
probability entry for a *run* of tokens that together complete a UTF-8 character (a
byte token that leaves the text incomplete gets no entry of its own; the entry of the
token that completes it carries the run's bytes and the last token's distribution).
``Reference.greedy`` puts the two back together: one ``Step`` per token, with llama.cpp's
top logprobs where it reported them and ``None`` inside such a run.

``agree`` is the rule the agreement tests apply (issue 11, "How it is checked"): the
same tokens, llama.cpp's top logprobs within ``LOGPROB_TOL`` of ours at every step, and
where the two greedy paths first part, both candidates within ``TIE_TOL`` in llama.cpp's
distribution at that step (random weights make near-ties, and llama.cpp's CPU matmuls
quantize activations to 8 bits). Past that point the two continue different texts, so
nothing after it is compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import httpx
import numpy as np
import xllamacpp

from trio_llm.engine.backend import Backend, SeqBatch
from trio_llm.model.tokenizer import Tokenizer

N_PREDICT = 24
N_PROBS = 10
LOGPROB_TOL = 0.15
TIE_TOL = 0.1


def plain_tokens(tok: Tokenizer) -> list[int]:
    """The ordinary token ids: neither special nor end-of-generation."""
    return [i for i in range(tok.n_vocab) if not tok.is_special(i) and not tok.is_eog(i)]


def partial_utf8_tokens(tok: Tokenizer) -> list[int]:
    """The token ids whose piece alone is not valid UTF-8 (a part of a character)."""
    out = []
    for i in range(tok.n_vocab):
        try:
            tok.token_to_piece(i).decode("utf-8")
        except UnicodeDecodeError:
            out.append(i)
    return out


def plain_prompt(tok: Tokenizer, n: int, seed: int) -> list[int]:
    """``n`` random ordinary token ids, fixed by the seed."""
    return [int(t) for t in np.random.default_rng(seed).choice(plain_tokens(tok), n)]


@attrs.frozen
class Step:
    token: int
    #: llama.cpp's top ``N_PROBS`` logprobs at this step (token id -> logprob); None for
    #: a token inside a UTF-8 run, which llama-server reports no entry for
    top: dict[int, float] | None


@attrs.frozen
class Continuation:
    steps: list[Step]
    stop: str  # llama-server's stop_type: "limit", "eos", ...

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.steps]


def server_params(path: Path, n_ctx: int) -> xllamacpp.CommonParams:
    """llama-server's parameters as every reference here starts it: one slot, one CPU
    thread, no warm-up, quiet."""
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = n_ctx
    params.n_parallel = 1
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.warmup = False
    params.verbosity = -1
    return params


class Reference:
    """One GGUF file loaded in llama.cpp (CPU, one thread, no prompt cache).

    ``cache_type_k`` / ``cache_type_v`` are llama-server's ``-ctk`` / ``-ctv`` names
    (f16 is its default), for rows that compare a KV cache type; ``n_ubatch`` its
    ``-ub`` (512 by default); ``rope`` its --rope-* / --yarn-* settings by CommonParams
    name (``rope_scaling_type`` as none, linear or yarn)."""

    def __init__(self, path: Path, *, n_ctx: int = 256, cache_type_k: str = "f16", cache_type_v: str = "f16",
                 n_ubatch: int | None = None, rope: dict[str, object] | None = None) -> None:
        params = server_params(path, n_ctx)
        for name, value in (rope or {}).items():  # llama-server's --rope-* / --yarn-* (CommonParams names)
            if name == "rope_scaling_type":
                value = getattr(xllamacpp.llama_rope_scaling_type, f"LLAMA_ROPE_SCALING_TYPE_{str(value).upper()}")
            setattr(params, name, value)
        if n_ubatch is not None:  # llama-server's -ub (and -b, so that it is the pass size)
            params.n_batch = max(params.n_batch, n_ubatch)
            params.n_ubatch = n_ubatch
        params.cache_type_k = getattr(xllamacpp.ggml_type, f"GGML_TYPE_{cache_type_k.upper()}")
        params.cache_type_v = getattr(xllamacpp.ggml_type, f"GGML_TYPE_{cache_type_v.upper()}")
        self._server = xllamacpp.Server(params)  # raises if llama.cpp refuses the file
        self._client = httpx.Client(base_url=self._server.listening_address, timeout=60.0)

    def close(self) -> None:
        self._client.close()
        del self._server

    def greedy(self, prompt: Sequence[int], piece: Callable[[int], bytes], n_predict: int = N_PREDICT) -> Continuation:
        """llama.cpp's greedy continuation of ``prompt`` (token ids, no BOS added);
        ``piece`` gives a token's bytes, to split the UTF-8 runs back into tokens."""
        body = {
            "prompt": [int(t) for t in prompt], "n_predict": n_predict, "temperature": 0.0,
            "n_probs": N_PROBS, "cache_prompt": False, "return_tokens": True,
        }
        r = self._client.post("/completion", json=body)
        r.raise_for_status()
        out = r.json()
        tokens = [int(t) for t in out["tokens"]]
        entries = out.get("completion_probabilities") or []
        steps: list[Step] = []
        i = 0
        for e in entries:
            want = bytes(e["bytes"])
            run, got = [], b""
            while i < len(tokens) and (len(got) < len(want) or not run):
                run.append(tokens[i])
                got += piece(tokens[i])
                i += 1
            assert got == want and run[-1] == e["id"], (tokens, e)
            steps += [Step(t, None) for t in run[:-1]]
            steps.append(Step(run[-1], {int(p["id"]): float(p["logprob"]) for p in e["top_logprobs"]}))
        steps += [Step(t, None) for t in tokens[i:]]  # a trailing incomplete run
        return Continuation(steps, str(out.get("stop_type", "")))


def stops_on(ref: Reference, prompt: Sequence[int], token: int) -> bool:
    """Whether llama.cpp ends a generation at ``token`` (forced by a logit bias): its
    end-of-generation set, as the server applies it."""
    body = {
        "prompt": [int(t) for t in prompt], "n_predict": 2, "temperature": 0.0, "cache_prompt": False,
        "logit_bias": [[int(token), 1000.0]], "return_tokens": True,
    }
    r = ref._client.post("/completion", json=body)
    r.raise_for_status()
    return bool(r.json()["stop_type"] == "eos")


def our_greedy(
    backend: Backend, prompt: Sequence[int], is_eog: Callable[[int], bool], n_predict: int = N_PREDICT
) -> tuple[list[int], list[np.ndarray]]:
    """Our greedy continuation and the log-softmax of the logits at every step (the
    distribution the step's token was chosen from); stops after an end-of-generation
    token, as llama.cpp does."""
    toks = np.asarray(prompt, np.int32)
    logits = backend.forward([SeqBatch(0, toks, 0)])[0]  # [n_vocab]
    pos = len(toks)
    out: list[int] = []
    lps: list[np.ndarray] = []
    while True:
        x = logits.astype(np.float64)
        m = x.max()
        lp = x - m - np.log(np.exp(x - m).sum())  # [n_vocab]
        tok = int(np.argmax(logits))
        out.append(tok)
        lps.append(lp)
        if len(out) == n_predict or is_eog(tok):
            return out, lps
        logits = backend.forward([SeqBatch(0, np.array([tok], np.int32), pos)])[0]
        pos += 1


def server_piece(tok: Tokenizer) -> Callable[[int], bytes]:
    """A token's bytes as llama-server reports them: control tokens as none (it
    detokenizes without specials), for ``Reference.greedy``."""
    return lambda t: b"" if tok.is_special(t) else tok.token_to_piece(t)


@attrs.frozen
class Verdict:
    ok: bool
    #: steps compared (up to and including the first difference, if any)
    compared: int
    #: the step where the greedy paths part, or None
    parted_at: int | None
    #: largest |ours - llama.cpp| over the top logprobs of the compared steps
    max_diff: float
    why: str = ""


def agree(ours: tuple[list[int], list[np.ndarray]], theirs: Continuation) -> Verdict:
    """Apply the agreement rule (module docstring) to one prompt's continuations."""
    toks, lps = ours
    max_diff = 0.0
    n = min(len(toks), len(theirs.steps))
    for i in range(n):
        step = theirs.steps[i]
        if step.top is not None:
            for tid, lp in step.top.items():
                d = abs(float(lps[i][tid]) - lp)
                max_diff = max(max_diff, d)
                if d > LOGPROB_TOL:
                    return Verdict(False, i + 1, None, max_diff,
                                   f"step {i}: token {tid} logprob {lps[i][tid]:.4f} here, {lp:.4f} in llama.cpp")
        if toks[i] == step.token:
            continue
        # the paths part: both candidates must be near-ties in llama.cpp's distribution
        if step.top is None:
            # inside a UTF-8 run llama-server reports nothing: judge by our distribution
            gap = float(lps[i][step.token] - lps[i][toks[i]])
            src = "ours (llama.cpp reports no entry inside a UTF-8 run)"
        elif toks[i] not in step.top:
            return Verdict(False, i + 1, i, max_diff,
                           f"step {i}: our token {toks[i]} is not in llama.cpp's top {N_PROBS} (it chose {step.token})")
        else:
            gap = step.top[step.token] - step.top[toks[i]]
            src = "llama.cpp's"
        ok = abs(gap) <= TIE_TOL
        why = "" if ok else f"step {i}: tokens {toks[i]} vs {step.token} are {gap:.4f} nats apart in {src}"
        return Verdict(ok, i + 1, i, max_diff, why)
    if len(toks) != len(theirs.steps):
        return Verdict(False, n, None, max_diff,
                       f"lengths differ with equal prefixes: {len(toks)} here, {len(theirs.steps)} in llama.cpp "
                       f"(its stop: {theirs.stop})")
    return Verdict(True, n, None, max_diff)

