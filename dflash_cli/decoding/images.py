"""A vision-language engine's images: the checkpoint's own processor, our vision graph, one image per call.

`ImageReader.prompt(ids, pixel_values, grids)` turns a processed prompt (token ids with each image's
tokens already expanded, the processor's pixel rows and patch grids) into the per-slot inputs the target
takes (vision_feeds.ImagePrompt). `encode(text_or_messages, images)` runs the checkpoint's processor
first (its chat template, resizing and normalising, image-token expansion).
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cli.errors import GenerationError
from dflash_cli.vision.feeds import ImagePrompt

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decoded image larger than this is refused, not resized
QWEN_MAX_ASPECT_RATIO = 200  # transformers' Qwen2-VL smart_resize (Qwen3-VL's, Qwen3.5's) raises past it


class ImageReader:
    def __init__(self, target_dir: Path, vision_onnx: Path) -> None:
        from dflash_cli.modeling.loading import multimodal_config

        self.target_dir = target_dir  # an inject artifact's target/
        self.config = multimodal_config(target_dir.parent)
        self._vision_onnx = vision_onnx
        self._session = None
        self._processor = None

    def _run_tower(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if self._session is None:
            import onnxruntime as ort

            from dflash_cli.host.ort_threads import apply_thread_pool

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            apply_thread_pool(opts)  # the engine's shared pool, where it has one
            self._session = ort.InferenceSession(str(self._vision_onnx), opts, providers=["CPUExecutionProvider"])
        types = {i.name: i.type for i in self._session.get_inputs()}  # an fp16 export's tower (QAIC builds)
        feeds = {n: v.astype(np.float16) if types.get(n) == "tensor(float16)" else v for n, v in feeds.items()}
        return tuple(out.astype(np.float32) for out in self._session.run(None, feeds))

    @property
    def pooled(self) -> bool:
        """Gemma 4's tower (pooled patches, boi/eoi around an image's tokens), not Qwen's (merged patches)."""
        from dflash_cli.families import traits_of

        return traits_of(self.config.model_type).pooled_vision

    def prompt(self, input_ids: list[int], pixel_values: np.ndarray, layout: np.ndarray) -> ImagePrompt:
        """`layout`: the processor's patch grids (Qwen3-VL's `image_grid_thw`) or patch positions (Gemma 4's
        `image_position_ids`)."""
        from dflash_cli.vision.images import gemma4_image_prompt, image_prompt

        make = gemma4_image_prompt if self.pooled else image_prompt
        try:
            return make(input_ids, np.asarray(pixel_values), np.asarray(layout), self.config, self._run_tower)
        except ValueError as exc:
            raise GenerationError(
                f"images do not match the prompt: {exc}", hint="one image per image placeholder"
            ) from exc

    @property
    def image_processor(self):
        """The checkpoint's own image processor (its Pillow form: torchvision is not needed)."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                self._processor = AutoImageProcessor.from_pretrained(str(self.target_dir))
            except (OSError, ValueError) as exc:
                raise GenerationError(
                    f"this target has no usable image processor: {str(exc).splitlines()[0][:200]}",
                    hint="copy the checkpoint's preprocessor_config.json beside its config.json",
                ) from None
        return self._processor

    def check_shape(self, image, name: str) -> None:
        """Refuse an image the processor would raise a ValueError on (Gemma 4's resize takes any shape)."""
        w, h = image.size
        ratio = max(w, h) / max(1, min(w, h))
        if not self.pooled and ratio > QWEN_MAX_ASPECT_RATIO:
            raise GenerationError(
                f"{name} is {w}x{h} pixels: its aspect ratio {ratio:.4g} is over {QWEN_MAX_ASPECT_RATIO}, "
                "the most this model's image processor takes",
                hint=f"crop the image or pad its short side to at least 1/{QWEN_MAX_ASPECT_RATIO} of its long side",
            )

    def encode(self, tokenizer, messages: list[dict[str, Any]], images: list) -> tuple[list[int], ImagePrompt]:
        """Chat messages whose content parts place the images ({"type": "image"}) through the tokenizer's
        chat template, and the images (PIL): each image placeholder expanded to its image tokens as the
        model's processor does (one per merged patch group). Without a chat template the images lead."""
        batch = self.image_processor(images=images, return_tensors="np")
        c = self.config
        if self.pooled:  # boi, one image token per soft token, eoi (Gemma4Processor.replace_image_token)
            layout = np.asarray(batch["image_position_ids"], np.int64)
            runs = [
                [c.boi_token_id] + [c.image_token_id] * int(n) + [c.eoi_token_id]
                for n in batch["num_soft_tokens_per_image"]
            ]
            lead = [c.image_token_id]
        else:  # one image token per merged patch group, between the template's start and end tokens
            layout = np.asarray(batch["image_grid_thw"], np.int64).reshape(-1, 3)
            unit = c.vision_config.spatial_merge_size**2
            runs = [[c.image_token_id] * (int(g.prod()) // unit) for g in layout]
            lead = [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            words = "\n\n".join(p["text"] for m in messages for p in _parts(m) if p.get("type") == "text")
            ids = lead * len(images) + list(tokenizer(words)["input_ids"])
        placeholders = [i for i, t in enumerate(ids) if t == c.image_token_id]
        if len(placeholders) != len(runs):
            raise GenerationError(
                f"the prompt places {len(placeholders)} image(s) but {len(runs)} were given",
                hint="one {'type': 'image'} content part per image",
            )
        expanded: list[int] = []
        image = 0
        for t in ids:
            if t == c.image_token_id:
                expanded += runs[image]
                image += 1
            else:
                expanded.append(t)
        return expanded, self.prompt(expanded, batch["pixel_values"], layout)


def encode_with_images(engine, prompt: str | list[dict], images: list) -> tuple[list[int], ImagePrompt]:
    """`engine`'s ids and image inputs for chat messages with image parts, or for a string prompt (the images
    first, then its text); `images`: local paths or PIL images."""
    if engine.images is None:
        raise GenerationError(
            f"this target ({engine.settings.family}) takes no images",
            hint="a vision-language target does (qwen3_vl, gemma4, qwen3_5 from a multimodal checkpoint)",
        )
    pictures = []
    for k, i in enumerate(images):
        pictures.append(open_image(i) if isinstance(i, (str, Path)) else i)
        engine.images.check_shape(pictures[-1], f"image {i}" if isinstance(i, (str, Path)) else f"image {k + 1}")
    if isinstance(prompt, str):
        parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
        prompt = [{"role": "user", "content": parts}]
    return engine.images.encode(engine.tokenizer, prompt, pictures)


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def open_image(path: str | Path):
    """A local image file as RGB, or a one-line error (missing, not a regular file, not an image, truncated, huge)."""
    hint = "give a path to a local image file"
    try:  # non-blocking: opening a FIFO would wait for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise GenerationError(f"image not found: {path}", hint=hint) from None
    except OSError as exc:
        raise GenerationError(f"cannot open image {path}: {exc.strerror or exc}", hint=hint) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # a FIFO could block, /dev/zero never end
        os.close(fd)
        device = stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        kind = "a directory" if stat.S_ISDIR(mode) else "a device" if device else "a pipe or other special file"
        raise GenerationError(f"image {path} is {kind}, not a regular file", hint=hint)
    with os.fdopen(fd, "rb") as f:
        return decode_image(f, f"image {path}")


def decode_image(source, name: str | None = None):
    """An image file or file-like object (`name`: what messages call it) as RGB, or a one-line GenerationError."""
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS  # Pillow refuses twice this, and warns from it on
    name = name or f"image {source}"
    hint = f"a PNG, JPEG or WebP image of at most {MAX_IMAGE_PIXELS // 2**20} megapixels"
    try:
        with warnings.catch_warnings():  # over the limit is refused below, in one line rather than a warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(source)
        with img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise GenerationError(f"{name} is {img.width}x{img.height} pixels: too large", hint=hint)
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:  # its message holds the source's repr (a BytesIO's says nothing)
        reason = "not an image PIL can read (an unknown format or a damaged header)"
    except (OSError, Image.DecompressionBombError, SyntaxError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:160]
    raise GenerationError(f"cannot read {name}: {reason}", hint=hint)
