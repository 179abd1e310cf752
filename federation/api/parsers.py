"""Request body parsing that never turns hostile input into a 500."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser
from rest_framework.parsers import JSONParser as DRFJSONParser


class JSONParser(DRFJSONParser):
    """DRF's JSON parser, plus a 400 for documents nested too deeply for Python's parser
    (``[[[[…]]]]`` within the body size limit raises RecursionError otherwise)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError as exc:
            raise ParseError("JSON parse error - document is nested too deeply.") from exc


class NdjsonParser(BaseParser):
    """Newline-delimited documents, kept as bytes (each is decoded by ingestion)."""

    media_type = "application/x-ndjson"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        return [line for line in stream.read().split(b"\n") if line.strip()]
