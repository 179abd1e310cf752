from django.urls import path
from rest_framework.routers import SimpleRouter

from federation.tenancy.api import views

router = SimpleRouter()
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register("api-keys", views.ApiKeyViewSet, basename="apikey")
router.register("users", views.UserViewSet, basename="user")

urlpatterns = [
    path("me/", views.MeView.as_view(), name="me"),
    path("auth/token/", views.AuthTokenView.as_view(), name="auth-token"),
    *router.urls,
]
