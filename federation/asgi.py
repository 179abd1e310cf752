import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from federation.api.middleware import BodyLimitASGIMiddleware

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "federation.settings")
django_application = get_asgi_application()
# In front of Django, which reads a whole body before any of its middleware runs.
application = BodyLimitASGIMiddleware(
    django_application, limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE
)
