"""Hostile image inputs (`dflash run --image`, serve's image_url parts) are one clear error each: no
traceback, no hang, no read of another host's file. A fake engine around the real reading code and the
checkpoints' real image processors (the tiny pairs' settings); the CLI and the server on a built pair:
tests/test_qwen3_vl.py."""

from __future__ import annotations

import base64
import io
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from dflash_cli.decoding.images import ImageReader, encode_with_images, open_image
from dflash_cli.errors import GenerationError
from dflash_cli.serve.media import read_image
from dflash_cli.serve.protocol import ApiError


def _done_in_time(fn, *args, seconds: float = 10.0):
    """fn(*args)'s result or exception, failing (not hanging) if it blocks."""
    box: dict = {}

    def call():
        try:
            box["value"] = fn(*args)
        except Exception as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "reading the image blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _reader(model_type: str) -> ImageReader:
    """An ImageReader with the tiny pairs' real image processor (no vision graph: encode fails before it)."""
    from transformers import Gemma4ImageProcessorPil, Qwen2VLImageProcessorPil

    reader = ImageReader.__new__(ImageReader)
    reader.config = SimpleNamespace(model_type=model_type)
    if model_type == "gemma4":
        reader._processor = Gemma4ImageProcessorPil(patch_size=8, pooling_kernel_size=2, max_soft_tokens=70)
    else:
        pixels = {"min_pixels": 16 * 16, "max_pixels": 96 * 96}
        reader._processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, **pixels)
    return reader


def test_an_image_too_long_for_the_qwen_processor_is_a_clear_error_naming_it(tmp_path) -> None:
    """A 4000x16 image (aspect ratio 250) made Qwen-VL's processor raise a ValueError (a traceback in `dflash run`,
    a 500 in serve); it is refused first, at the processor's own limit, naming the image and its size."""
    wide = tmp_path / "wide.png"
    Image.new("RGB", (4000, 16)).save(wide)
    reader = _reader("qwen3_vl")
    engine = SimpleNamespace(images=reader, tokenizer=None, settings=SimpleNamespace(family="qwen3_vl"))
    with pytest.raises(GenerationError, match=f"image {wide} is 4000x16 pixels: its aspect ratio 250 is over 200"):
        encode_with_images(engine, "what is here?", [wide])
    with pytest.raises(GenerationError, match="image 1 is 16x4000 pixels"):  # a PIL image (serve's): by place
        encode_with_images(engine, "what is here?", [Image.new("RGB", (16, 4000))])
    # the limit is the processor's own: it takes 200 (3200x16) and raises from 201 (3216x16)
    reader.image_processor(images=[Image.new("RGB", (3200, 16))], return_tensors="np")
    reader.check_shape(Image.new("RGB", (3200, 16)), "x")
    with pytest.raises(ValueError, match="aspect ratio"):
        reader.image_processor(images=[Image.new("RGB", (3216, 16))], return_tensors="np")
    with pytest.raises(GenerationError, match="ratio 201 is over 200"):
        reader.check_shape(Image.new("RGB", (3216, 16)), "x")
    # Gemma 4's processor takes any shape, so its images are not refused
    gemma = _reader("gemma4")
    gemma.check_shape(Image.new("RGB", (4000, 16)), "x")
    gemma.image_processor(images=[Image.new("RGB", (4000, 16))], return_tensors="np")


def test_a_directory_a_fifo_or_a_device_is_named_as_such_and_never_read(tmp_path) -> None:
    """They exist, so not "image not found"; a FIFO with no writer must not block, /dev/zero not be read."""
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    cases = {
        tmp_path / "dir": "is a directory",
        tmp_path / "fifo": "is a pipe or other special file",
        Path("/dev/zero"): "is a device",
    }
    for path, words in cases.items():
        with pytest.raises(GenerationError, match=f"image {path} {words}, not a regular file"):
            _done_in_time(open_image, path)
    with pytest.raises(GenerationError, match="image not found"):
        open_image(tmp_path / "missing.png")
    # serve: a FIFO under the allowed directory is a 400 too, and the intake thread is not held
    with pytest.raises(ApiError, match="is a pipe or other special file"):
        _done_in_time(read_image, f"file://{tmp_path}/fifo", tmp_path, "messages[0].content[0]")


def test_file_urls_of_another_host_are_refused(tmp_path) -> None:
    """`file://evil.example/PATH` read the local PATH, ignoring the host; only no host or localhost is local."""
    Image.new("RGB", (40, 32)).save(tmp_path / "p.png")
    for host in ("evil.example", "127.0.0.2", "localhost:80"):
        with pytest.raises(ApiError, match=f"file URLs of another host are not read \\({host}\\)") as err:
            read_image(f"file://{host}{tmp_path}/p.png", tmp_path, "messages[0].content[0]")
        assert err.value.status == 400
    for local in (f"file://{tmp_path}/p.png", f"file://localhost{tmp_path}/p.png", f"file://LOCALHOST{tmp_path}/p.png"):
        assert read_image(local, tmp_path, "messages[0].content[0]").size == (40, 32)


def test_a_data_url_that_is_not_an_image_says_so() -> None:
    """Its error printed PIL's message, with the repr of a BytesIO, rather than what was wrong."""
    url = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    with pytest.raises(ApiError) as err:
        read_image(url, None, "messages[0].content[0]")
    message = err.value.message
    assert message == (
        "messages[0].content[0]: cannot read the data URL's bytes: not an image PIL can read "
        "(an unknown format or a damaged header)"
    )
    truncated = io.BytesIO()
    Image.new("RGB", (64, 64)).save(truncated, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(truncated.getvalue()[:-40]).decode()
    with pytest.raises(ApiError, match="cannot read the data URL's bytes: ") as err:
        read_image(url, None, "messages[0].content[0]")
    assert "BytesIO" not in err.value.message
