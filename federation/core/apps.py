from django.apps import AppConfig
from django.contrib.admin import apps as admin_apps


class CoreConfig(AppConfig):
    name = "federation.core"
    label = "core"
    verbose_name = "fedinfer core"


class FedinferAdminConfig(admin_apps.AdminConfig):
    """Installed instead of ``django.contrib.admin``: makes ``admin.site`` ours (its login
    form is throttled). A string, so the site's module loads once the apps are ready."""

    default = False  # federation.core's own config stays CoreConfig
    default_site = "federation.core.admin_site.FedinferAdminSite"
