"""What the HTTP edge can see of the running server.

The runtime creates a ``ServerContext`` before the model loads (so ``/health`` can
answer 503 meanwhile) and fills in ``engine`` exactly once, when every actor has
started. Handlers only read it; they reach the actors through their public methods
(``TaskQueue.post``/``cancel``, the gate's requests, the ``statistics()`` records).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import trio
from prometheus_client import CollectorRegistry

from trio_llm.config import ServerConfig
from trio_llm.model.config import ModelConfig
from trio_llm.server.gate import ResidencyGate
from trio_llm.server.queue import TaskQueue
from trio_llm.server.slots import SlotsEngine


@attrs.define(eq=False)
class Engine:
    """The loaded model and the actors serving it."""

    model_path: Path
    model_config: ModelConfig
    metadata: dict[str, Any]
    tokenizer: Any  # trio_llm.model.tokenizer.Tokenizer
    template: Any  # trio_llm.model.chat.ChatTemplate
    queue: TaskQueue
    slots: SlotsEngine
    gate: ResidencyGate
    registry: CollectorRegistry
    n_ctx: int  # positions per slot
    backend_name: str
    device: dict[str, Any]
    n_params: int
    file_bytes: int
    created: int  # the model file's modification time, for /v1/models
    grammars: Any = None  # trio_llm.engine.constraint.Grammars: constrained decoding
    embedder: Any = None  # trio_llm.server.embeddings.Embedder: with --embeddings only
    media: Any = None  # trio_llm.server.media.MediaEncoder: with --mmproj only


@attrs.define(eq=False)
class ServerContext:
    config: ServerConfig
    engine: Engine | None = None
    loaded: trio.Event = attrs.Factory(trio.Event)
    # fraction of the model loaded, for the 503 body of /health while loading
    load_progress: float = 0.0

    @property
    def model_id(self) -> str:
        if self.config.model_ids:
            return self.config.model_ids[0]
        if self.engine is not None:
            return self.engine.model_path.name
        return self.config.model.name if self.config.model else "default"

    def set_engine(self, engine: Engine) -> None:
        assert self.engine is None, "the engine is set once"
        self.engine = engine
        self.loaded.set()
