"""orjson parser and renderer for DRF: the API speaks JSON only."""

from __future__ import annotations

import orjson
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
