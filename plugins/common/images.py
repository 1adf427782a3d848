"""Images in chat rows: references, placeholders, checks and lazy decoding (docs/vision.md).

A row of the internal schema keeps its images as *references* (strings) in an ``images`` column
and marks where each one goes with :data:`IMAGE` (``<image>``) in the message text, in order, as
LLaMA-Factory does. A reference is an absolute file path or a ``data:`` URL (bytes from a parquet or
arrow column are kept encoded, as the file holds them); pixels are decoded only when a batch is
built (:func:`load_image`), so a prepared corpus never holds decoded images.

Pure Python at import; PIL is imported when an image is checked or decoded.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urlparse

IMAGE = "<image>"  # where an image goes in a message's text
DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=-]+)*;base64,", re.IGNORECASE)


class ImageError(ValueError):
    """An image reference that cannot be used: ``reason`` is a short key for statistics."""

    def __init__(self, message: str, reason: str = "bad_image"):
        super().__init__(message)
        self.reason = reason


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def reference(value: Any, base: str | None, *, remote: bool = False) -> str:
    """One image as a row gives it -> its reference: an absolute path (a relative path is relative to
    ``base``, the data file's folder), a ``file://`` URL's path, a ``data:`` URL, or bytes (a parquet or
    arrow ``Image`` column: ``{"bytes", "path"}``, raw bytes, a PIL image) as a ``data:`` URL. An
    ``http(s)://`` URL is kept only with ``remote``; otherwise it is refused (nothing is fetched)."""
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        elif value.get("url") is not None:  # image_url's {"url": ...}
            value = value["url"]
        else:
            raise ImageError(f"an image object needs 'bytes', 'path' or 'url' (it has: {', '.join(map(str, value)) or 'nothing'})",
                             "wrong_type")
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise ImageError("zero-size image (no bytes)", "empty_image")
        return _data_url(bytes(value))
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (a datasets Image column, decoded)
        out = io.BytesIO()
        value.save(out, format="PNG")
        return _data_url(out.getvalue())
    if not isinstance(value, str):
        raise ImageError(f"an image must be a path, a URL or bytes, got {type(value).__name__}", "wrong_type")
    text = value.strip()
    if not text:
        raise ImageError("an empty image path", "wrong_type")
    if text[:5].lower() == "data:":
        if not DATA_URL.match(text):
            raise ImageError(f"a data: URL that is not base64 image data ({text[:40]}...)", "bad_image")
        return text
    scheme = urlparse(text).scheme.lower()
    if scheme in ("http", "https"):
        if remote:
            return text
        raise ImageError(f"{text} is a remote URL; images are never fetched from the network (download them and "
                         "give local paths)", "remote_image")
    if scheme == "file":
        text = unquote(urlparse(text).path)
    elif len(scheme) > 1:
        raise ImageError(f"{text}: unsupported URL scheme {scheme!r} (paths, file://, data: and bytes are read)",
                         "wrong_type")
    path = os.path.expanduser(text)
    if not os.path.isabs(path) and base is not None:
        path = os.path.join(base, path)
    return os.path.normpath(path)


def shown(ref: str) -> str:
    """A reference as messages name it: the path, or a data: URL's start."""
    return f"{ref[:30]}... ({len(ref)} characters)" if ref.startswith("data:") else ref


def _open(ref: str) -> Any:
    from PIL import Image

    if ref.startswith("data:"):
        try:
            data = base64.b64decode(ref[ref.index(",") + 1:], validate=False)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{shown(ref)}: not valid base64: {exc}") from None
        if not data:
            raise ImageError(f"{shown(ref)}: zero-size image (no bytes)", "empty_image")
        return Image.open(io.BytesIO(data))
    if ref.startswith(("http://", "https://")):
        raise ImageError(f"{ref}: remote images are not fetched", "remote_image")
    try:
        size = os.stat(ref).st_size
    except FileNotFoundError:
        raise ImageError(f"{ref}: no such file", "missing_image") from None
    except OSError as exc:
        raise ImageError(f"{ref}: cannot read: {exc.strerror}", "bad_image") from None
    if size == 0:
        raise ImageError(f"{ref}: zero-size file", "empty_image")
    return Image.open(ref)


@contextlib.contextmanager
def _image(ref: str) -> Iterator[Any]:
    """The image a reference names, opened (its header read, nothing decoded yet); what goes wrong, there
    or while the caller decodes it, is an :class:`ImageError` (one line)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with _open(ref) as im:
            yield im
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{shown(ref)}: not an image PIL can read", "bad_image") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{shown(ref)}: unreadable image ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                         "bad_image") from None


def load_image(ref: str) -> Any:
    """The image a reference names, decoded, in RGB. Raises :class:`ImageError` (one line)."""
    with _image(ref) as im:
        im.load()  # the whole image: a truncated file fails here, not later in a batch
        return im.convert("RGB")


def image_size(ref: str) -> tuple[int, int]:
    """``(width, height)`` of the image a reference names, from its header alone (nothing decoded).
    Raises :class:`ImageError` (one line)."""
    with _image(ref) as im:
        return im.size


def check_image(ref: str) -> None:
    """Decode the image once and drop it: a missing, empty, unreadable or truncated image is found
    when the data is read, named by its row, instead of stopping training later."""
    load_image(ref).close()


def placed(messages: list[dict], count: int) -> list[dict]:
    """``messages`` with the :data:`IMAGE` placeholders checked against ``count`` images: none in the
    text puts them all before the first user turn's text (LLaMA-Factory's rule); otherwise their
    number must be ``count``, and none may be in an assistant turn. Raises :class:`ImageError`."""
    found = [m["content"].count(IMAGE) for m in messages]
    if not sum(found):
        if count:
            first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
            if first is None:
                raise ImageError(f"the row has {count} image(s) but no user turn to put them in", "image_count")
            messages = [dict(m) for m in messages]
            messages[first]["content"] = IMAGE * count + messages[first]["content"]
        return messages
    if sum(found) != count:
        raise ImageError(f"the text holds {sum(found)} {IMAGE} placeholder(s) but the row has {count} image(s); "
                         "give one image per placeholder (or no placeholder at all)", "image_count")
    for m, n in zip(messages, found):
        if n and m["role"] == "assistant":
            raise ImageError(f"an assistant turn holds {IMAGE}: images go in user (or system) turns, and assistant "
                             "turns are what the model learns to write", "image_count")
    return messages
