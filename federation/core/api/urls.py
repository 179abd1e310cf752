from rest_framework.routers import SimpleRouter

from federation.core.api.views import AuditEventViewSet

router = SimpleRouter()
router.register("audit-events", AuditEventViewSet, basename="auditevent")
urlpatterns = router.urls
