"""Refuse oversized request bodies with a clear 413 before anything reads them."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


class RequestBodyLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return JsonResponse({"detail": "Content-Length is not a number."}, status=400)
        if limit is not None and length > limit:
            return JsonResponse(
                {
                    "detail": f"Request body of {length} bytes exceeds the limit of {limit} bytes.",
                    "code": "payload_too_large",
                },
                status=413,
            )
        return self.get_response(request)
