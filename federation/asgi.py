import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from federation.api.middleware import BodyLimitASGIMiddleware
from federation.core.tracing import trace_web

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
trace_web()  # before Django builds its middleware: the span's middleware goes first
django_application = get_asgi_application()
# In front of Django, which reads a whole body before any of its middleware runs.
application = BodyLimitASGIMiddleware(
    django_application, limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE
)
