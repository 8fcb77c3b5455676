import sys

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from core.api.errors import DATABASE_DOWN, application_error, error_response
from core.errors import InternalError, NotFound
from tvcache_site import health
from tvcache_site.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("cache.api.urls")),
    path("api/v1/", include("sandboxes.urls")),
    path("api/v1/", include("upstreams.urls")),
    path("", include("upstreams.proxy_urls")),  # verl-tool trainers' tool_server_url (no token)
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("metrics", metrics_view, name="metrics"),  # Prometheus; TVCACHE_METRICS_ALLOW only
    path("healthz", health.healthz, name="healthz"),  # liveness and readiness, no token
    path("readyz", health.readyz, name="readyz"),
    path("", include("dashboard.urls")),  # pages, login/logout, /dashboard-api/ (session auth)
]


def handler404(request, exception=None):
    return error_response(NotFound(f"No such resource: {request.path}"))


def handler500(request):
    # A database that went away is a 503 here too, not a bug: for views outside the API's exception
    # handler (pages), and for the hot path's unexpected errors (Django's handler calls this).
    exc = sys.exc_info()[1]
    if isinstance(exc, DATABASE_DOWN):
        return error_response(application_error(exc))
    return error_response(InternalError("Internal error; nothing was half-written (each write is one transaction)."))
