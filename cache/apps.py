from django.apps import AppConfig


class CacheConfig(AppConfig):
    name = "cache"
    default_auto_field = "django.db.models.BigAutoField"
