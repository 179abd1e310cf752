from rest_framework.routers import SimpleRouter

from federation.core.api import schema  # noqa: F401  (registers the OpenAPI extensions)
from federation.core.api.views import AuditEventViewSet

router = SimpleRouter()
router.register("audit-events", AuditEventViewSet, basename="auditevent")
urlpatterns = router.urls
