"""orjson parser and renderer for DRF: the API speaks JSON (and streams NDJSON) only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import orjson
from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer

from core.inputs import load_body


class ORJSONParser(BaseParser):
    """Every JSON body of the cold endpoints is checked here, once: malformed JSON, NUL, lone
    surrogates, nesting and out-of-range numbers are refused before a view sees the data."""

    media_type = "application/json"

    def parse(self, stream, media_type=None, parser_context=None):
        return load_body(stream.read())


class ORJSONRenderer(BaseRenderer):
    media_type = "application/json"
    format = "json"
    charset = None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None:
            return b""
        return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def ndjson_streamed(blocks: Iterator[bytes]) -> StreamingHttpResponse:
    """An NDJSON answer streamed from a generator of blocks of lines that reads the database: each
    block is made in Django's sync thread (its connection), the answer sent as it comes, so a long
    export holds one block at a time (a sync iterator would be read whole first under ASGI)."""

    async def sent() -> AsyncIterator[bytes]:
        step = sync_to_async(next, thread_sensitive=True)
        while (block := await step(blocks, None)) is not None:
            yield block

    return StreamingHttpResponse(sent(), content_type="application/x-ndjson")
