"""Routes under /api/v1/ (token-authenticated)."""

from django.urls import path

from . import api

urlpatterns = [
    path("upstreams/<slug:name>", api.UpstreamView.as_view()),
]
