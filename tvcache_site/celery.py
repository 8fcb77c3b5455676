import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tvcache_site.settings")

app = Celery("tvcache")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
