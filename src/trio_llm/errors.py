"""The domain exceptions, all in one place.

Backends map driver errors to these at their boundary; the HTTP edge maps them to
OpenAI-shaped error bodies and the CLI to one line and a non-zero exit.
"""

from __future__ import annotations


class TrioLLMError(Exception):
    """Base of every error trio-llm raises on purpose."""


class ModelLoadError(TrioLLMError):
    """A GGUF file cannot be used. The message names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedModelError(ModelLoadError):
    """The file is well formed but uses an architecture or tensor type we do not run."""


class GraphError(TrioLLMError):
    """A model's graph is inconsistent (a shape mismatch, a missing tensor): raised while
    the graph is built, naming the node and the shapes."""


class TokenizerError(TrioLLMError):
    """The tokenizer section of a model is missing or malformed."""


class TemplateError(TrioLLMError):
    """A chat template failed to render."""


class BackendError(TrioLLMError):
    """The compute backend failed; raised at the backend boundary."""


class BackendUnavailable(BackendError):
    """The requested backend cannot run on this machine (no Vulkan loader or device)."""


class DeviceOutOfMemory(BackendError):
    """The device refused an allocation (VK_ERROR_OUT_OF_DEVICE_MEMORY and friends)."""


class DeviceLost(BackendError):
    """The device was lost (VK_ERROR_DEVICE_LOST); the backend is unusable afterwards."""


class ShaderCompileError(BackendError):
    """glslc failed or is missing."""


class ContextOverflow(TrioLLMError):
    """A prompt (plus the tokens to generate) does not fit the context."""

    def __init__(self, n_tokens: int, n_ctx: int) -> None:
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx
        super().__init__(
            f"the request needs {n_tokens} tokens but the context holds {n_ctx} per slot"
        )


class InvalidRequest(TrioLLMError):
    """A request that is well-formed JSON but asks for something invalid."""


class InputTooLarge(TrioLLMError):
    """A prompt of a model without memory (non-causal attention: gemma-embedding) longer
    than one forward pass; llama-server's words and status (500): it runs such a
    prompt in one ubatch."""

    def __init__(self, n_tokens: int, n_batch: int) -> None:
        self.n_tokens = n_tokens
        self.n_batch = n_batch
        super().__init__(f"input ({n_tokens} tokens) is too large to process. increase the physical batch size "
                         f"(current batch size: {n_batch})")


class ArenaUnavailable(TrioLLMError):
    """The VRAM arena directory cannot be opened or written."""


class ConfigError(TrioLLMError):
    """A command-line flag or configuration value is out of range or inconsistent."""


class ScenarioError(TrioLLMError):
    """A scenario file is malformed, or a scenario cannot be set up (model, ports, processes).

    The message names the file and the place in it (``phase[1].step[0].server``).
    """


class ArenaRefused(TrioLLMError):
    """This server cannot take part in the arena as configured (a pin that does not fit
    beside the other pins, a footprint larger than the budget): one line, no start."""


class EncodeCancelled(TrioLLMError):
    """An image encode stopped early because its cancel event was set: the request it
    was for is gone (``server.media.run_sync_cancellable`` turns it into the request's
    ``trio.Cancelled``). Nothing of it is kept."""
