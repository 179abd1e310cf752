from django.urls import URLPattern, path

from federation.fleet.api.views import PlacementApplyView, PlacementPlansView, PlacementPlanView

urlpatterns: list[URLPattern] = [
    path("placement/plan/", PlacementPlanView.as_view(), name="placement-plan"),
    path("placement/apply/", PlacementApplyView.as_view(), name="placement-apply"),
    path("placement/plans/", PlacementPlansView.as_view(), name="placement-plans"),
]
