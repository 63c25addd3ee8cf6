"""Images and videos of a request: `data:image/...;base64,...` (`data:video/...`) URLs, and local
files only under the directory `allow_files` names (resolved with every symlink followed, refused
outside it); never http(s) (the server fetches nothing). Pixels are checked on the image header
before decoding, and a decoded image is shrunk at once to what the processor keeps of it; a video's
header (frames, rate, size) is read through PyAV, its frames decoded when the request is prepared.

    loader = ImageLoader(cfg, keep_pixels=vlm.encoder.limits.max_pixels)
    image = loader.load(url, "messages.0.content.1.image_url")      # PIL RGB, or raises APIError
    video = loader.load_video(url, "messages.0.content.2.video_url")  # data.video.Video, or raises APIError
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from vlforge.data.inline import DataError

from vlforge.data.video import Video, read_video_header
from vlforge.serve.config import ServeConfig
from vlforge.serve.schema import APIError

# Formats PIL may open: the common web formats only (PIL's EPS plugin, for one, runs Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
EXAMPLE = {"image": "png", "video": "mp4"}  # the media subtype the error messages show


class ImageLoader:
    def __init__(self, cfg: ServeConfig, keep_pixels: int | None = None):
        self.cfg = cfg
        self.root = Path(cfg.allow_files).resolve() if cfg.allow_files is not None else None
        # the processor shrinks anything larger to this anyway: shrinking right after decoding keeps a
        # queue of waiting requests from holding full-resolution images
        self.keep_pixels = keep_pixels

    def load(self, url: str, param: str, keep_pixels: int | None = None) -> Image.Image:
        """`keep_pixels`: the request's own bound when it names one (at most the loader's)."""
        return self._decode(self._fetch(url, param, "image"), param, keep_pixels or self.keep_pixels)

    def load_video(self, url: str, param: str) -> Video:
        """A `video_url` part's video (data:video/...;base64 or an allowed local file): its header
        read through PyAV (frames, rate, size); its frames are decoded when the request is prepared."""
        data = self._fetch(url, param, "video")
        try:
            video = read_video_header(data, param, max_pixels=self.cfg.max_image_pixels)
        except DataError as e:
            raise APIError(400, str(e).removeprefix(f"{param}: "), param=param, code="invalid_video") from None
        if video.frames > self.cfg.max_video_frames:
            raise APIError(400, f"the video has {video.frames} frames; the limit is {self.cfg.max_video_frames} "
                                "(--max-video-frames): send a shorter clip", param=param, code="video_too_long")
        return video

    def _fetch(self, url: str, param: str, kind: str) -> bytes:
        """The bytes an image or video URL names (`kind`: "image" | "video", for the messages and codes)."""
        url = url.strip()
        if url[:5].lower() == "data:":
            return self._data_url(url, param, kind)
        if re.match(r"^https?://", url, re.I):
            raise APIError(400, f"{kind} URLs are not fetched (no network access from the server); send the {kind} "
                                f"inline as a data URL: data:{kind}/{EXAMPLE[kind]};base64,<base64 of the file>",
                           param=param, code=f"unsupported_{kind}_url")
        if url[:5].lower() == "file:" or not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url):
            return self._local_file(url, param, kind)
        raise APIError(400, f"unsupported {kind} URL scheme in {url[:40]!r}; send a data:{kind}/...;base64 URL",
                       param=param, code=f"unsupported_{kind}_url")

    def _data_url(self, url: str, param: str, kind: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        fields = [f.strip().lower() for f in header.split(";")]
        if not sep or "base64" not in fields[1:]:
            raise APIError(400, f"{kind} data URLs must be base64: data:{kind}/{EXAMPLE[kind]};base64,...",
                           param=param, code=f"invalid_{kind}_url")
        if fields[0] and not fields[0].startswith(f"{kind}/"):
            raise APIError(400, f"data URL media type {fields[0]!r} is not {kind}/...", param=param,
                           code=f"invalid_{kind}_url")
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"the {kind} data URL is not valid base64", param=param,
                           code="invalid_base64") from None

    def _local_file(self, url: str, param: str, kind: str) -> bytes:
        if self.root is None:
            raise APIError(403, f"local {kind} files are not allowed on this server (the operator can allow a "
                                f"directory with --allow-files DIR); send the {kind} as a data:{kind}/...;base64 URL",
                           param=param, code="files_not_allowed")
        raw = url
        if url[:5].lower() == "file:":
            parsed = urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise APIError(400, "file:// URLs must name a local path (file:///path)", param=param,
                               code=f"invalid_{kind}_url")
            raw = unquote(parsed.path)
        if not raw or "\x00" in raw:
            raise APIError(400, f"empty or invalid {kind} path", param=param, code=f"invalid_{kind}_url")
        name = _shown(raw)
        path = Path(raw)
        if not path.is_absolute():
            path = self.root / path  # relative paths are relative to the allowed directory
        try:
            resolved = path.resolve()  # follows every symlink, removes ..
        except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13), named so inside root
            if isinstance(e, RuntimeError) and Path(os.path.abspath(path)).is_relative_to(self.root):
                raise _path_error(OSError(errno.ELOOP, "symlink loop"), name, param, kind) from None
            raise APIError(403, f"the {kind} path cannot be resolved", param=param,
                           code="path_not_allowed") from None
        if not resolved.is_relative_to(self.root):
            raise APIError(403, f"{kind} path {name} is outside the directory this server allows", param=param,
                           code="path_not_allowed")
        try:  # no symlink at the last step, no blocking on a FIFO swapped in since resolve()
            fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:  # a missing file, a name too long for the filesystem, no permission...
            raise _path_error(e, name, param, kind) from None
        try:
            # what was opened, not what was checked: closes the race of a directory on the path being
            # replaced by a symlink between resolve() and open() (Linux; elsewhere the check above stands)
            proc = Path(f"/proc/self/fd/{fd}")
            opened = Path(os.readlink(proc)) if proc.is_symlink() else resolved
            if not opened.is_relative_to(self.root):
                raise APIError(403, f"{kind} path {name} is outside the directory this server allows", param=param,
                               code="path_not_allowed")
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a device, pipe or socket)"
                raise APIError(400, f"{kind} path {name} is {what}, not a file", param=param,
                               code=f"invalid_{kind}_url")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.cfg.max_body_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.cfg.max_body_bytes:
            raise APIError(413, f"{kind} file {name} is larger than {self.cfg.max_body_bytes} bytes",
                           param=param, code=f"{kind}_too_large")
        return data

    def _decode(self, data: bytes, param: str, keep_pixels: int | None) -> Image.Image:
        limit = self.cfg.max_image_pixels
        try:
            im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
        except Image.DecompressionBombError:
            raise APIError(400, f"image has more than {limit} pixels", param=param, code="image_too_large") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
            raise APIError(400, f"cannot decode the image (supported: {', '.join(IMAGE_FORMATS)})", param=param,
                           code="invalid_image") from None
        with im:
            w, h = im.size
            if w * h > limit:
                raise APIError(400, f"image is {w}x{h} = {w * h} pixels; the limit is {limit}", param=param,
                               code="image_too_large")
            if min(w, h) < 1 or max(w, h) / min(w, h) > 200:
                raise APIError(400, f"image is {w}x{h}: sides must be >= 1 pixel and the aspect ratio at most 200",
                               param=param, code="invalid_image")
            try:
                im.load()
                rgb = im.convert("RGB")
            except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
                raise APIError(400, "cannot decode the image (truncated or corrupt)", param=param,
                               code="invalid_image") from None
        if keep_pixels and w * h > keep_pixels:
            scale = (keep_pixels / (w * h)) ** 0.5
            rgb = rgb.resize((max(1, int(w * scale)), max(1, int(h * scale))), Image.Resampling.BICUBIC)
        return rgb


def _shown(raw: str, keep: int = 80) -> str:
    """A path as an error message shows it: quoted, and cut when long (a client may send any length)."""
    return repr(raw) if len(raw) <= keep else f"{raw[:keep]!r}... ({len(raw)} characters)"


def _path_error(e: OSError, name: str, param: str, kind: str) -> APIError:
    if e.errno == errno.ENAMETOOLONG:
        return APIError(400, f"{kind} path {name} is too long for the filesystem (a file name is at most "
                             "255 bytes on most); name an existing file under the allowed directory",
                        param=param, code=f"invalid_{kind}_url")
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return APIError(400, f"{kind} file {name} not found", param=param, code=f"{kind}_not_found")
    if e.errno == errno.ELOOP:  # a symlink loop (resolve() leaves one as it is), or a symlink swapped in since
        return APIError(400, f"{kind} path {name} is a symlink that leads to no file (a symlink loop, or a link "
                             "put there after the path was checked); name the file itself", param=param,
                        code=f"invalid_{kind}_url")
    return APIError(400, f"cannot read {kind} file {name}: {e.strerror}", param=param, code=f"{kind}_not_found")


__all__ = ["IMAGE_FORMATS", "ImageLoader"]
