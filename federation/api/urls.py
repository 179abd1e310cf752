"""REST management API v1. Each domain registers its routes in its own ``api/urls.py``."""

from django.urls import include, path

urlpatterns = [
    path("", include("federation.inventory.api.urls")),
    path("", include("federation.tenancy.api.urls")),
    path("", include("federation.core.api.urls")),
]
