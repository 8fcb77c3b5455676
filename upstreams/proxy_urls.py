"""The verl-tool proxy path (the secret in it is the credential; see registry.PROXY_PATH)."""

from django.urls import path

from . import api

urlpatterns = [
    path("verl-tool/<str:secret>/get_observation", api.verl_tool_observations, name="verl-tool-proxy"),
]
