"""Images in chat requests: OpenAI's `image_url` content parts, read without touching the network.

A `data:image/...;base64,...` URL is decoded in memory. A local file (`file:///path`,
`file://localhost/path` or a plain path) is read only under the directory the operator allowed
(`serve.allowed_local_media_path`, like vLLM's `--allowed-local-media-path`; unset: none), after
resolving links, so `..` or a symlink cannot leave it; only a regular file, so a FIFO cannot block it.
Remote URLs, another host's `file://` ones too, are refused: the server has no network, and must not
fetch what a client names.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from dflash_cli.serve.protocol import ApiError

MAX_IMAGES = 8  # per request: each one is a vision-tower call and hundreds of prompt positions


def read_image(url: str, allowed: Path | None, where: str):
    """The image `url` names, as an RGB PIL image, or a 400 naming the part (`where`)."""
    from dflash_cli.decoding.images import decode_image, open_image

    if not isinstance(url, str) or not url:
        raise ApiError(f"{where}: image_url.url must be a non-empty string", param="messages")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise ApiError(f"{where}: a data URL must be data:image/<type>;base64,<data>", param="messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(f"{where}: the data URL's base64 does not decode", param="messages") from None
        return _decoded(lambda: decode_image(io.BytesIO(data), "the data URL's bytes"), where)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("http", "https", "ftp"):
        raise ApiError(
            f"{where}: remote image URLs are not fetched ({scheme}://)",
            param="messages",
            hint="send the image inline as a data:image/...;base64 URL",
        )
    if scheme == "file" and parsed.netloc.lower() not in ("", "localhost"):  # file://HOST/... names HOST's file
        raise ApiError(
            f"{where}: file URLs of another host are not read ({parsed.netloc})",
            param="messages",
            hint="name a local file as file:///path, or send the image inline",
        )
    path = Path(unquote(parsed.path) if scheme == "file" else url)
    if allowed is None:
        raise ApiError(
            f"{where}: local image files are not served",
            param="messages",
            hint="send the image inline, or start the server with --set serve.allowed_local_media_path=DIR",
        )
    real = path.resolve()
    if not real.is_relative_to(allowed.resolve()):
        raise ApiError(f"{where}: {path} is outside the allowed media directory", param="messages")
    return _decoded(lambda: open_image(real), where)


def _decoded(read, where: str):
    from dflash_cli.errors import GenerationError

    try:
        return read()
    except GenerationError as exc:
        raise ApiError(f"{where}: {exc.message}", param="messages", hint=exc.hint) from None
