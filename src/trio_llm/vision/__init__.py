"""gemma-3 vision (llama-server's ``--mmproj``): image bytes -> the embedding rows
llama.cpp's libmtmd feeds the text model. CPU only (numpy); see ``siglip``."""

from trio_llm.vision.image import decode_image, preprocess
from trio_llm.vision.mmproj import Projector, load_projector

__all__ = ["Projector", "decode_image", "load_projector", "preprocess"]
