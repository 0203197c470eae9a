"""Vision-language models: each image of a chat request through the checkpoint's own vision
tower and projector (mlx-vlm), into the prompt as embedding spans the engine takes."""

from llm_server.vision.load import VisionUnavailable, load_vision
from llm_server.vision.renderer import VisionRenderer

__all__ = ["VisionRenderer", "VisionUnavailable", "load_vision"]
