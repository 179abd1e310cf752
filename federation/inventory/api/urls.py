from rest_framework.routers import SimpleRouter

from federation.inventory.api import views

router = SimpleRouter()
router.register("regions", views.RegionViewSet, basename="region")
router.register("region-links", views.RegionLinkViewSet, basename="region-link")
router.register("accelerator-types", views.AcceleratorTypeViewSet, basename="accelerator-type")
router.register("pools", views.PoolViewSet, basename="pool")
router.register("models", views.LanguageModelViewSet, basename="model")
router.register("adapters", views.AdapterViewSet, basename="adapter")
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("instances", views.InstanceViewSet, basename="instance")
router.register("edges", views.EdgeViewSet, basename="edge")
urlpatterns = router.urls
