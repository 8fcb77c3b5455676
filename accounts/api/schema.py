"""OpenAPI description of the trainer token (drf-spectacular finds it when the app loads)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class TrainerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.api.auth.TrainerTokenAuthentication"
    name = "TrainerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": (
                "`Token <key>`: a token of one project with a role (trainer or maintainer); create one "
                "with `python manage.py create_token NAME --project P --role trainer|maintainer`. Task ids "
                "resolve inside the token's project."
            ),
        }
