import sys

from django.contrib import admin
from django.http import JsonResponse
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from cache.api.errors import DATABASE_DOWN, application_error
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
    path("", include("dashboard.urls")),  # pages, login/logout, /dashboard-api/ (session auth)
]


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, "details": None}}, status=status)


def handler404(request, exception=None):
    return _error(404, "not_found", f"No such resource: {request.path}")


def handler500(request):
    # A database that went away is a 503 here too, not a bug: for views outside the API's exception
    # handler (pages) where Django calls this in the thread handling the exception (WSGI).
    exc = sys.exc_info()[1]
    if isinstance(exc, DATABASE_DOWN):
        error = application_error(exc)
        response = _error(error.status, error.code, error.message)
        response["Retry-After"] = str(error.retry_after)
        return response
    return _error(500, "internal_error", "Internal error; nothing was half-written (each write is one transaction).")
